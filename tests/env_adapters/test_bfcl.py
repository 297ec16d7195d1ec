"""The BFCL multi-turn adapter (env_adapters/bfcl.py): the ground truth scores 1 on all 800 tasks
through ``step``; a changed argument scores less, exactly where BFCL's own checker says so;
episodes of one task are isolated; model text never runs; the conformance check passes; the
train / held-out split keeps each base task on one side.

bfcl-eval is installed by scripts/setup.sh (``--no-deps``); the tests that need it skip, naming
the install command, only where it is missing.
"""

from __future__ import annotations

import builtins
import json
import random
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from env_adapters import make_env, task_category
from env_adapters.bfcl import (
    ADDED_FUNCTIONS_MESSAGE,
    CATEGORIES,
    FINISH_TURN,
    NUM_TASKS,
    BFCLEnv,
    base_task,
    bfcl_missing,
    ground_truth_calls,
    load_data,
    split_task_ids,
    task_id_of,
)
from env_adapters.checker import check_env

needs_bfcl = pytest.mark.skipif(bfcl_missing() is not None, reason=str(bfcl_missing()))
ROOT = Path(__file__).resolve().parents[2]
CALLS_PER_REPLY = 7  # below tool_calls.MAX_CALLS_PER_REPLY, with room for finish_turn


def block(name: str, arguments: dict[str, Any]) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def replies(turns: list[list[tuple[str, dict[str, Any]]]]) -> list[str]:
    """The replies that make ``turns``' calls, a few per reply, then finish_turn per turn."""
    out = []
    for turn in turns:
        for i in range(0, len(turn), CALLS_PER_REPLY):
            out.append("\n".join(block(n, a) for n, a in turn[i:i + CALLS_PER_REPLY]))
        out.append(block(FINISH_TURN, {}))
    return out


def play(env: BFCLEnv, task_id: int, turns: list[list[tuple[str, dict[str, Any]]]]):
    env.reset(task_id)
    r = None
    for reply in replies(turns):
        r = env.step(reply)
        if r.terminated:
            break
    return r


def perturbed(task_id: int) -> tuple[list[list[tuple[str, dict[str, Any]]]], tuple[int, int, str]]:
    """The ground truth with one argument of one call changed (a seeded choice among the
    strings, numbers and booleans): a string gets "_x", a number +1 (x1.5 + 1 for a float), a
    boolean flips."""
    turns = ground_truth_calls(task_id)
    spots = [(t, c, k) for t, turn in enumerate(turns) for c, (_, args) in enumerate(turn)
             for k, v in args.items() if isinstance(v, (str, int, float))]
    t, c, k = random.Random(task_id).choice(spots)
    v = turns[t][c][1][k]
    turns[t][c][1][k] = (not v if isinstance(v, bool) else v + 1 if isinstance(v, int)
                         else v * 1.5 + 1 if isinstance(v, float) else v + "_x")
    return turns, (t, c, k)


# ---------------------------------------------------------------------------------- ids and split


def test_task_ids_categories_and_the_split_by_base_task():
    assert NUM_TASKS == 800
    assert [task_id_of(c, 7) for c in CATEGORIES] == [7, 207, 407, 607]
    assert [BFCLEnv.task_category(i) for i in (0, 199, 200, 450, 799)] == [
        "multi_turn_base", "multi_turn_base", "multi_turn_miss_param", "multi_turn_miss_func",
        "multi_turn_long_context"]
    assert task_category("bfcl", 607) == "multi_turn_long_context"  # the table's path, no instance
    for bad in (-1, 800, True):
        with pytest.raises(ValueError):
            BFCLEnv.task_category(bad)
    train, heldout = split_task_ids()
    assert sorted(train + heldout) == list(range(NUM_TASKS))
    assert not {base_task(i) for i in train} & {base_task(i) for i in heldout}, "a base task on both sides"
    assert len(heldout) == 160 and all(base_task(i) % 5 == 0 for i in heldout)
    # every held-out base task is held out in all four categories
    assert {(i // 200, base_task(i)) for i in heldout} == {(c, k) for c in range(4) for k in range(0, 200, 5)}
    base_train, base_heldout = split_task_ids(["multi_turn_base"])
    assert base_train == [i for i in train if i < 200] and base_heldout == [i for i in heldout if i < 200]


# ---------------------------------------------------------------------------------- scoring


@needs_bfcl
@pytest.mark.parametrize("reward", ["strict", "partial"])
def test_ground_truth_replay_scores_one_on_all_800_tasks(reward):
    env = BFCLEnv(reward=reward)
    t0 = time.perf_counter()
    failed = []
    for task_id in range(NUM_TASKS):
        r = play(env, task_id, ground_truth_calls(task_id))
        if not (r.terminated and r.reward == 1.0 and r.info["success"] is True):
            failed.append((task_id, r.reward, r.info.get("bfcl_turn")))
        assert not r.info.get("invalid_action"), (task_id, r.observation[-300:])
    elapsed = time.perf_counter() - t0
    print(f"ground truth of {NUM_TASKS} tasks replayed through step ({reward}): {elapsed:.2f} s")
    assert not failed, f"{len(failed)} tasks did not score 1: {failed[:10]}"


@needs_bfcl
def test_one_changed_argument_scores_less_strict_and_partial():
    strict, partial = BFCLEnv(reward="strict"), BFCLEnv(reward="partial")
    rng = random.Random(0)
    sample = sorted(rng.sample(range(NUM_TASKS), 60))
    lower = 0
    for task_id in sample:
        turns, where = perturbed(task_id)
        r = play(strict, task_id, turns)
        if r.reward == 1.0:  # a change BFCL does not see either (checked against it below)
            continue
        lower += 1
        assert r.terminated and r.info["success"] is False and r.reward == 0.0, (task_id, where)
        p = play(partial, task_id, turns)
        assert p.terminated and p.reward < 1.0 and p.info["success"] is False, (task_id, where, p.reward)
    assert lower >= 50, f"only {lower} of {len(sample)} changed arguments scored less"


def bfcl_verdict(task_id: int, turns: list[list[tuple[str, dict[str, Any]]]]) -> dict[str, Any]:
    """BFCL's own ``multi_turn_checker`` on ``turns`` (one step per turn). This oracle runs BFCL's
    eval-based executor, in these tests only, on call strings written here from literals with
    ``repr`` (the adapter never runs it); its instances live in that module's globals under a
    unique name, removed afterwards."""
    from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_checker as mtc
    from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils as mtu

    def text(name: str, args: dict[str, Any]) -> str:
        return f"{name}(" + ", ".join(f"{k}={v!r}" for k, v in args.items()) + ")"

    entry = json.loads(json.dumps(load_data().entries[task_id]))
    model = f"agentgym_oracle_{uuid.uuid4().hex}"
    try:
        return mtc.multi_turn_checker(
            [[[text(n, a) for n, a in turn]] if turn else [] for turn in turns],
            [[text(n, a) for n, a in turn] for turn in ground_truth_calls(task_id)],
            entry, entry["id"].rsplit("_", 1)[0], model)
    finally:
        for key in [k for k in vars(mtu) if k.startswith(model)]:
            del vars(mtu)[key]


@needs_bfcl
def test_turn_verdicts_match_bfcls_own_checker_on_changed_arguments():
    """Our verdict (every judged turn passes) against BFCL's ``multi_turn_checker`` on the same
    calls, for one changed argument in each of the 800 tasks."""
    env = BFCLEnv()
    verdicts = {True: 0, False: 0}
    for task_id in range(NUM_TASKS):
        turns, where = perturbed(task_id)
        r = play(env, task_id, turns)
        ours = bool(r.terminated and r.info["success"])
        theirs = bfcl_verdict(task_id, turns)["valid"]
        assert ours == theirs, f"task {task_id}, change at {where}: ours {ours}, BFCL {theirs}"
        verdicts[ours] += 1
    assert verdicts[False] > 0.8 * NUM_TASKS, verdicts


@needs_bfcl
def test_a_turn_with_ground_truth_calls_fails_without_calls_even_when_state_and_results_match():
    """base_4: turn 1 is a read-only sort(report.txt). Made early, in turn 0, it leaves turn 1's
    state and results matching, yet a turn with no call fails, as in BFCL
    (multi_turn:empty_turn_model_response)."""
    task = task_id_of("multi_turn_base", 4)
    gt = ground_truth_calls(task)
    assert [n for n, _ in gt[1]] == ["sort"]
    shifted = [gt[0] + gt[1], []] + gt[2:]
    assert bfcl_verdict(task, shifted)["error_type"] == "multi_turn:empty_turn_model_response"
    r = play(BFCLEnv(), task, shifted)
    assert r.terminated and r.reward == 0.0 and r.info["bfcl_turn"] == 1
    assert r.info["bfcl_turns_passed"] == 1 and r.info["bfcl_turn_passed"] is False


@needs_bfcl
def test_finish_turn_without_calls_fails_the_turn_strict_ends_partial_goes_on():
    task = task_id_of("multi_turn_base", 1)  # turn 0 is a read-only ls(a=True): skipping it changes no state
    turns = ground_truth_calls(task)
    assert [n for n, _ in turns[0]] == ["ls"]
    skipped = [[]] + turns[1:]
    r = play(BFCLEnv(reward="strict"), task, skipped)
    assert r.terminated and r.reward == 0.0 and r.info["bfcl_turn"] == 0 and r.info["bfcl_turn_passed"] is False
    p = play(BFCLEnv(reward="partial"), task, skipped)
    judged = sum(1 for t in turns if t)
    assert p.terminated and p.info["bfcl_turn"] == len(turns) - 1
    assert p.reward == pytest.approx((judged - 1) / judged) and p.info["success"] is False


@needs_bfcl
def test_miss_func_offers_the_held_back_functions_at_their_turn():
    task = task_id_of("multi_turn_miss_func", 0)  # sort is held back until turn 3
    env = BFCLEnv()
    obs, _ = env.reset(task)
    assert obs and "sort" not in {t["function"]["name"] for t in env.tools()}
    assert FINISH_TURN in {t["function"]["name"] for t in env.tools()}
    turns = ground_truth_calls(task)
    r = None
    for turn in turns[:3]:
        for reply in replies([turn])[:-1]:
            env.step(reply)
        r = env.step(block(FINISH_TURN, {}))
    assert r is not None and not r.terminated
    assert ADDED_FUNCTIONS_MESSAGE in r.observation and '"name": "sort"' in r.observation
    assert r.info["bfcl_functions_added"] == ["sort"]
    assert "sort" in {t["function"]["name"] for t in env.tools()}


# ---------------------------------------------------------------------------------- isolation


@needs_bfcl
def test_two_episodes_of_one_task_interleaved_stay_isolated():
    """Episode A replays the ground truth while episode B, same task, replays a changed one,
    step for step in turn: each ends exactly as it does alone; a file B makes is never seen by A."""
    for task_id in (0, 3, 250, 455, 610) + tuple(range(1, NUM_TASKS, 37)):
        good = replies(ground_truth_calls(task_id))
        bad_turns, _ = perturbed(task_id)
        bad = replies(bad_turns)
        alone = [play(BFCLEnv(), task_id, ground_truth_calls(task_id)), play(BFCLEnv(), task_id, bad_turns)]
        a, b = BFCLEnv(), BFCLEnv()
        a.reset(task_id)
        b.reset(task_id)
        last: list[Any] = [None, None]
        for i in range(max(len(good), len(bad))):
            for j, (env, script) in enumerate(((a, good), (b, bad))):
                if i < len(script) and not (last[j] and last[j].terminated):
                    last[j] = env.step(script[i])
        for j in (0, 1):
            assert (last[j].reward, last[j].info["success"], last[j].observation) == (
                alone[j].reward, alone[j].info["success"], alone[j].observation), (task_id, "AB"[j])
        assert last[0].reward == 1.0


@needs_bfcl
def test_a_change_in_one_episode_is_not_seen_by_another_nor_after_reset():
    task = task_id_of("multi_turn_base", 1)  # the file system, starting in /alex
    a, b = BFCLEnv(), BFCLEnv()
    a.reset(task)
    b.reset(task)
    before = b.step(block("ls", {"a": True})).observation
    made = a.step(block("mkdir", {"dir_name": "leak_probe"}) + block("ls", {"a": True})).observation
    assert "leak_probe" in made and "leak_probe" not in before
    assert "leak_probe" not in b.step(block("ls", {"a": True})).observation
    a.reset(task)  # a used instance starts from the task's initial state again
    assert a.step(block("ls", {"a": True})).observation == before
    # the judge's ground-truth instances are not the model's
    assert a._model is not None and a._truth is not None
    assert all(a._model.objects[c] is not a._truth.objects[c] for c in a._model.objects)


# ---------------------------------------------------------------------------------- safety


@needs_bfcl
def test_model_text_is_never_evaluated(monkeypatch, tmp_path):
    marker = Path("/tmp") / f"pwned_{uuid.uuid4().hex}"
    payload = f"__import__('os').system('touch {marker}')"
    env = BFCLEnv()
    env.reset(task_id_of("multi_turn_base", 1))
    refused = [
        block(payload, {}),                                  # the name
        block(f"ls(a={payload})", {}),                       # a BFCL-style call string as the name
        block("ls", {payload: True}),                        # an argument name
        block(FINISH_TURN, {"x": payload}),                  # finish_turn's (absent) argument
        block(f"ls; {payload}", {"a": True}),
    ]
    for reply in refused:
        r = env.step(reply)
        assert r.info["invalid_action"] is True and r.info["format_error"] is False, reply
        assert "Error:" in r.info["tool_results"][0]["content"]
        assert not r.terminated
    # as an argument value it is a string the file system is given, never code
    for reply in (block("cd", {"folder": payload}), block("touch", {"file_name": payload}),
                  block("echo", {"content": payload, "file_name": payload})):
        r = env.step(reply)
        assert not r.info.get("invalid_action"), r.observation
    assert not marker.exists(), "model text ran"
    # and no eval anywhere in an episode: a full replay with eval / exec / BFCL's executor disabled
    from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils as mtu

    def forbidden(*_a: Any, **_k: Any) -> Any:
        raise AssertionError("eval-based execution used")

    monkeypatch.setattr(builtins, "eval", forbidden)
    monkeypatch.setattr(builtins, "exec", forbidden)
    monkeypatch.setattr(mtu, "execute_multi_turn_func_call", forbidden)
    for task_id in (0, 250, 449, 638):
        assert play(BFCLEnv(), task_id, ground_truth_calls(task_id)).reward == 1.0
    assert not marker.exists()


@needs_bfcl
def test_arguments_checked_against_the_function_doc():
    env = BFCLEnv(reward="partial")  # a failed turn does not end the episode
    env.reset(task_id_of("multi_turn_base", 1))
    r = env.step(block("mv", {"source": "log.txt"}))
    assert r.info["invalid_action"] and "needs destination" in r.observation
    r = env.step(block("ls", {"a": True, "colour": "red"}))
    assert r.info["invalid_action"] and "no parameter 'colour'" in r.observation
    r = env.step(block("get_stock_info", {"symbol": "AAPL"}))  # a function of a class this task lacks
    assert r.info["invalid_action"] and "no function named 'get_stock_info'" in r.observation
    r = env.step(block("pwd", {}) + block(FINISH_TURN, {}) + block("pwd", {}))
    results = [x["content"] for x in r.info["tool_results"]]
    assert not r.terminated and len(results) == 3, results
    assert "ends the turn" in results[2] and r.info["invalid_action"]
    assert results[1] == load_data().entries[task_id_of("multi_turn_base", 1)]["question"][1][0]["content"]


@needs_bfcl
@pytest.mark.timeout(60)  # unguarded, 10 ** 10 ** 12 would run for hours
def test_calls_that_would_hang_are_refused_and_mpmath_state_is_restored():
    import mpmath

    env = BFCLEnv()
    task = next(i for i in range(NUM_TASKS) if "MathAPI" in load_data().entries[i]["involved_classes"])
    env.reset(task)
    dps = mpmath.mp.dps
    t0 = time.perf_counter()
    for reply in (block("logarithm", {"value": 10, "base": 2, "precision": 10**9}),
                  block("square_root", {"number": 2, "precision": 10**9}),
                  block("power", {"base": 10, "exponent": 10**12})):
        r = env.step(reply)
        assert r.info["invalid_action"] and "at most" in r.observation
    assert time.perf_counter() - t0 < 5
    r = env.step(block("logarithm", {"value": 10, "base": 2, "precision": 40}))
    assert "3.3219280948873623478703194294893901758" in r.observation
    assert mpmath.mp.dps == dps


@needs_bfcl
def test_the_adapter_imports_no_single_turn_checker_nor_model_handler():
    code = ("import sys; from env_adapters.bfcl import BFCLEnv; e = BFCLEnv(); e.reset(0); "
            "bad = [m for m in sys.modules if m.startswith(('bfcl_eval.eval_checker.ast_eval', "
            "'bfcl_eval.eval_checker.eval_runner', 'bfcl_eval.model_handler', 'openai', 'anthropic', "
            "'numpy'))]; print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


# ---------------------------------------------------------------------------------- conformance


@needs_bfcl
def test_conformance_check_passes():
    report = check_env(lambda: make_env("bfcl"), [0, 250, 449, 638, 799], horizon=5)
    print(f"bfcl: {report['ms_per_step']:.2f} ms/step (incl. reset), {report['ms_per_reset']:.2f} ms/reset")
    assert report["steps"] > 0


@needs_bfcl
def test_tools_are_openai_functions_without_the_class_preamble():
    env = BFCLEnv()
    env.reset(0)
    tools = env.tools()
    assert tools[-1]["function"]["name"] == FINISH_TURN
    for t in tools:
        f = t["function"]
        assert t["type"] == "function" and f["parameters"]["type"] == "object"
        assert "This tool belongs to" not in f["description"], f["name"]
        assert all(p["type"] in ("string", "integer", "number", "boolean", "array", "object")
                   for p in f["parameters"]["properties"].values()), f["name"]
    assert "Gorilla file system" in env.system_prompt()
    tools[0]["function"]["name"] = "changed"  # a copy: the shared docs are not touched
    assert env.tools()[0]["function"]["name"] != "changed"
    acts = env.valid_actions()
    assert acts and all(a.startswith("<tool_call>") for a in acts) and FINISH_TURN in acts[-1]
