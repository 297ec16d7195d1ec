"""The ``mcp`` environment (env_adapters/mcp_env.py) against the real ``mcp-server-git`` from PyPI:
no mock server. Each reset starts a server process, so the module is in the slow lane."""

from __future__ import annotations

import gc
import json
import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

from env_adapters import make_env
from env_adapters.base import InfraError
from env_adapters.checker import check_env
from env_adapters.mcp_env import DEFAULT_TASK_FILE, EPISODE_MARKER, WORKDIR_ALIAS, MCPEnv, load_tasks

pytestmark = pytest.mark.slow


def call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def calls(*blocks: str) -> str:
    return "Let me do that.\n" + "\n".join(blocks)


# task id -> replies that solve it, and replies that do not (the packaged git tasks)
SOLUTIONS: dict[int, list[str]] = {
    0: [call("git_create_branch", branch_name="feature/login", base_branch="main"), call("submit")],
    1: [call("git_status"),
        calls(call("git_add", files=["notes.txt"]), call("git_commit", message="Add meeting notes")),
        call("submit")],
    2: [call("git_log", max_count=1), call("submit", answer="Fix typo in README")],
    3: [call("git_checkout", branch_name="docs"), call("git_add", files=["docs/guide.md"]),
        call("git_commit", message="Add user guide"), call("submit")],
    4: [call("git_reset"), call("git_add", files=["app.py"]), call("git_commit", message="Add app"),
        call("submit")],
    5: [call("git_log"), call("submit", answer="3")],
}
WRONG: dict[int, list[str]] = {
    0: [call("git_create_branch", branch_name="feature/logon", base_branch="main"), call("submit")],
    1: [call("git_add", files=["notes.txt"]), call("git_commit", message="add notes"), call("submit")],
    2: [call("git_log", max_count=1), call("submit", answer="Add changelog")],
    3: [call("git_add", files=["docs/guide.md"]), call("git_commit", message="Add user guide"), call("submit")],
    4: [call("git_commit", message="Add app"), call("submit")],
    5: [call("submit", answer="2")],
}


def play(env: MCPEnv, task_id: int, replies: list[str]) -> list:
    env.reset(task_id)
    results = []
    for reply in replies:
        r = env.step(reply)
        results.append(r)
        assert not r.info["format_error"], r.observation
        if r.terminated:
            break
    return results


def marked_pids(token: str) -> list[int]:
    """Every process on the machine whose environment carries this episode's marker."""
    want = f"{EPISODE_MARKER}={token}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                env = Path(f"/proc/{entry}/environ").read_bytes()
            except OSError:
                continue
            if want in env.split(b"\0"):
                pids.append(int(entry))
    return pids


def children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


@pytest.fixture
def env(tmp_path):
    e = MCPEnv(work_root=str(tmp_path / "work"))
    yield e
    e.close()


def test_the_packaged_tasks_load_and_the_registry_builds_the_env():
    tasks = load_tasks(DEFAULT_TASK_FILE)
    assert set(SOLUTIONS) == set(WRONG) == set(range(len(tasks)))
    assert all(t.hidden_arguments == {"repo_path": "{workdir}"} for t in tasks)
    e = make_env("mcp")
    try:
        assert isinstance(e, MCPEnv) and e.name == "mcp" and e.task_file == DEFAULT_TASK_FILE
    finally:
        e.close()


@pytest.mark.parametrize("task_id", sorted(SOLUTIONS))
def test_a_scripted_solution_scores_one_and_a_wrong_one_zero(env, task_id):
    right = play(env, task_id, SOLUTIONS[task_id])
    assert right[-1].terminated and right[-1].reward == 1.0 and right[-1].info["success"] is True, right[-1].info
    assert all(r.reward == 0.0 and not r.terminated for r in right[:-1])
    wrong = play(env, task_id, WRONG[task_id])
    assert wrong[-1].terminated and wrong[-1].reward == 0.0 and wrong[-1].info["success"] is False
    assert wrong[-1].info["checks_passed"] < wrong[-1].info["checks_total"]


def test_partial_credit_is_the_share_of_checks_passed(tmp_path):
    with MCPEnv(work_root=str(tmp_path), partial_credit=True) as e:
        # commit-file with the wrong message: 3 of its 4 checks pass
        r = play(e, 1, WRONG[1])[-1]
        assert (r.info["checks_passed"], r.info["checks_total"]) == (3, 4)
        assert r.reward == 0.75 and r.info["success"] is False
        assert play(e, 1, SOLUTIONS[1])[-1].reward == 1.0


def test_the_hidden_repo_path_is_never_shown(env):
    obs, _ = env.reset(1)
    workdir = env.workdir
    assert workdir and os.path.isdir(os.path.join(workdir, ".git"))
    secrets = {workdir, os.path.realpath(workdir), os.path.dirname(workdir)}
    shown = json.dumps(env.tools()) + env.system_prompt() + obs
    assert "repo_path" not in shown
    for t in env.tools():
        assert "repo_path" not in t["function"]["parameters"].get("required", [])
    seen = []
    for reply in [call("git_status"),
                  call("git_add", files=["/etc/passwd"]),            # the server names the repository
                  call("git_add", files=["../outside"]),
                  call("git_status", repo_path="/"),                 # a path of the model's is replaced
                  call("git_show", revision="no-such-revision"),
                  call("git_add", files=[f"{WORKDIR_ALIAS}/notes.txt"]),  # the alias in arguments works
                  call("git_diff_staged"),
                  call("git_commit", message="Add meeting notes"),
                  call("git_log")]:
        r = env.step(reply)
        seen.append(r.observation)
        seen += [t["content"] for t in r.info["tool_results"]]
    text = "\n".join(seen)
    for s in secrets:
        assert s not in text, f"the work folder's path {s} leaked into an observation"
    # the server did name the folder, and the adapter put the alias in its place
    assert f"outside the repository '{WORKDIR_ALIAS}'" in text
    assert "On branch main" in seen[6] and "notes.txt" in seen[12]     # git_status with repo_path="/"
    assert "+Meeting notes" in text and "Add meeting notes" in seen[-1]
    assert env.step(call("submit")).reward == 1.0


def test_tool_errors_are_observations_and_an_unknown_tool_is_a_tool_error(env):
    env.reset(0)
    bad = env.step(call("git_add", files=7))         # the server's own argument validation: is_error
    assert bad.info.get("tool_error") is True and not bad.terminated and bad.reward == 0.0
    assert "valid list" in bad.observation
    unknown = env.step(call("git_push", remote="origin"))
    assert unknown.info.get("invalid_action") is True and "unknown tool 'git_push'" in unknown.observation
    assert "git_status" in unknown.observation and "submit" in unknown.observation
    assert env.step("no tool call here").info["format_error"] is True
    assert env.step(call("git_status")).info.get("tool_error") is None   # still works


def test_a_killed_server_is_an_infra_error_and_the_next_episode_recovers(env):
    env.reset(1)
    env.step(call("git_status"))
    pid, token = env.server_pid, env.episode_token
    assert pid is not None and token is not None
    assert pid in marked_pids(token), (pid, token, marked_pids(token))
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(InfraError, match="died or closed its connection during git_add"):
        env.step(call("git_add", files=["notes.txt"]))
    with pytest.raises(InfraError, match="during git_add"):   # the episode stays broken, never a reward
        env.step(call("submit"))
    assert play(env, 1, SOLUTIONS[1])[-1].reward == 1.0   # reset starts a fresh server
    assert env.server_pid is None or env.server_pid != pid
    assert not marked_pids(token)


def test_a_hung_server_is_an_infra_error_within_the_call_timeout(tmp_path):
    e = MCPEnv(work_root=str(tmp_path), call_timeout_s=2.0)
    try:
        e.reset(0)
        token, pid = e.episode_token, e.server_pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(InfraError, match="did not answer git_status within 2.0 s"):
            e.step(call("git_status"))
        assert time.monotonic() - t0 < 8
    finally:
        t0 = time.monotonic()
        e.close()
    assert time.monotonic() - t0 < 10
    assert not marked_pids(token)


def test_close_leaves_no_process_thread_or_folder_behind(tmp_path):
    before_children = children()
    before_threads = {t.ident for t in threading.enumerate()}
    e = MCPEnv(work_root=str(tmp_path))
    e.reset(4)
    for reply in SOLUTIONS[4][:-1]:       # git runs subprocesses of the server
        e.step(reply)
    token, episode = e.episode_token, os.path.dirname(e.workdir or "")
    assert marked_pids(token) and os.path.isdir(episode)
    assert children() - before_children
    e.close()
    e.close()                             # idempotent
    assert not marked_pids(token), "a process of the episode outlived close()"
    deadline = time.monotonic() + 5
    while children() - before_children and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not children() - before_children
    assert not os.path.exists(episode) and not os.listdir(tmp_path)
    deadline = time.monotonic() + 5
    while {t.ident for t in threading.enumerate()} - before_threads and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not {t.ident for t in threading.enumerate()} - before_threads


def test_an_env_dropped_without_close_is_cleaned_up_when_collected(tmp_path):
    e = MCPEnv(work_root=str(tmp_path))
    e.reset(0)
    token = e.episode_token
    assert token and marked_pids(token)
    del e
    gc.collect()
    deadline = time.monotonic() + 5
    while marked_pids(token) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not marked_pids(token) and not os.listdir(tmp_path)


def test_commit_hashes_are_the_same_in_every_episode(tmp_path):
    def commit_hash(e: MCPEnv) -> str:
        e.reset(1)
        r = e.step(calls(call("git_add", files=["notes.txt"]), call("git_commit", message="Add meeting notes")))
        m = re.search(r"hash ([0-9a-f]{40})", r.info["tool_results"][1]["content"])
        assert m, r.observation
        return m.group(1)

    with MCPEnv(work_root=str(tmp_path)) as a, MCPEnv(work_root=str(tmp_path)) as b:
        first = commit_hash(a)
        assert commit_hash(a) == first == commit_hash(b)


def test_episodes_of_two_envs_in_worker_threads(tmp_path):
    """The rollout steps environments from a thread pool: each instance has its own loop and server."""
    def solve(task_id: int) -> float:
        with MCPEnv(work_root=str(tmp_path)) as e:
            return play(e, task_id, SOLUTIONS[task_id])[-1].reward

    with ThreadPoolExecutor(2) as pool:
        assert list(pool.map(solve, [3, 4])) == [1.0, 1.0]


def _task_file(tmp_path: Path, **changes) -> str:
    data = json.loads(DEFAULT_TASK_FILE.read_text())
    task = {**data["tasks"][0], **changes}
    data["tasks"] = [task]
    path = tmp_path / "tasks.yaml"
    path.write_text(json.dumps(data))   # JSON is YAML: the YAML reader takes both
    return str(path)


def test_a_judge_check_needs_the_judge(tmp_path):
    path = _task_file(tmp_path, checks=[{"judge": "The branch name follows the team's convention."}])
    with MCPEnv(task_file=path, work_root=str(tmp_path / "w")) as e:
        e.reset(0)
        with pytest.raises(NotImplementedError, match=r"reward\.judge"):
            e.step(call("submit"))


def test_a_failing_fixture_or_server_start_is_an_infra_error(tmp_path):
    work = tmp_path / "w"
    broken_fixture = _task_file(tmp_path, fixture=[{"run": "exit 3"}])
    with MCPEnv(task_file=broken_fixture, work_root=str(work)) as e:
        with pytest.raises(InfraError, match="exited 3"):
            e.reset(0)
    data = json.loads(Path(broken_fixture).read_text())
    data["tasks"][0].pop("fixture")
    data["defaults"]["mcpServers"] = {"bad": {"command": "/bin/false"}}
    Path(broken_fixture).write_text(json.dumps(data))
    before = children()
    t0 = time.monotonic()
    with MCPEnv(task_file=broken_fixture, work_root=str(work)) as e:
        with pytest.raises(InfraError, match="failed to start"):
            e.reset(0)
    assert time.monotonic() - t0 < 20
    assert not os.listdir(work) and not children() - before


def test_a_process_a_fixture_leaves_running_is_killed_too(tmp_path):
    """A fixture command's daemon (double fork: another parent, another group) carries the
    episode's marker, and the sweep at the episode's end kills it."""
    path = _task_file(tmp_path, fixture=[{"run": "(sleep 300 >/dev/null 2>&1 &)"}])
    with MCPEnv(task_file=path, work_root=str(tmp_path / "w")) as e:
        e.reset(0)
        token = e.episode_token
        assert token
        daemons = [p for p in marked_pids(token) if psutil.Process(p).name() == "sleep"]
        assert daemons and all(psutil.Process(p).ppid() != os.getpid() for p in daemons)
    assert not marked_pids(token)


def test_malformed_task_files_are_named(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"tasks": [{"name": "x", "request": "r", "checks": [{"expect": "y"}]}]}))
    with pytest.raises(ValueError, match=r"(?s)bad\.json.*exactly one of 'run'"):
        MCPEnv(task_file=str(bad))
    bad.write_text(json.dumps({"tasks": [{"name": "x", "request": "r", "checks": [{"run": "true"}],
                                          "fixture": [{"write": "../escape", "content": ""}]}]}))
    with pytest.raises(ValueError, match="inside the work folder"):
        MCPEnv(task_file=str(bad))
    with pytest.raises(ValueError, match="names no server"):
        bad.write_text(json.dumps({"tasks": [{"name": "x", "request": "r", "checks": [{"run": "true"}]}]}))
        MCPEnv(task_file=str(bad))
    with pytest.raises(FileNotFoundError, match="no-such-mcp-server"):
        MCPEnv(task_file=_task_file(tmp_path, mcpServers={"x": {"command": "no-such-mcp-server"}}))


def test_conformance(tmp_path):
    report = check_env(lambda: MCPEnv(work_root=str(tmp_path)), [1, 4], horizon=4)
    print(f"mcp: {report['steps']} steps, {report['ms_per_step']:.0f} ms/step (incl. reset), "
          f"{report['ms_per_reset']:.0f} ms/reset")
    assert report["steps"] > 0
    assert not os.listdir(tmp_path)


def test_the_rollout_plays_mcp_episodes_with_the_tools_in_the_prompt(tiny_path, tmp_path):
    """The rollout loop (agentgym.rollout.loop) over the real server with the tiny test model, each
    reply one of the listed argument-free calls (constrain_actions): no infra error, the tools
    (but no repo_path, no folder path) in the first prompt, every folder removed afterwards."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentgym.chat import ChatFormatter
    from agentgym.rollout.engines.hf import HFEngine
    from agentgym.rollout.loop import EpisodeSpec, RolloutSettings, run_episodes

    tok = AutoTokenizer.from_pretrained(tiny_path)
    engine = HFEngine(AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32), tok)
    specs = [EpisodeSpec("mcp", t, 0, f"g{t}", f"e{t}", {"work_root": str(tmp_path)}) for t in (0, 4)]
    # the tiny model's tokenizer spends ~3,500 tokens on the tool schemas in the system text
    settings = RolloutSettings(horizon=3, max_new_tokens=16, seed=7, constrain_actions=True,
                               max_context_tokens=8192)
    episodes = run_episodes(engine, ChatFormatter(tok), specs, settings, make_env)
    for ep in episodes:
        assert not ep.infra_error, ep.error
        assert 1 <= ep.num_turns <= 3 and all(not t.format_error for t in ep.turns)
        head = tok.decode(ep.input_ids[:ep.loss_mask.index(1)])
        assert "git_status" in head and '"submit"' in head and "repo_path" not in head
        assert str(tmp_path) not in tok.decode(ep.input_ids)
        assert all("<tool_call>" in t.action_text for t in ep.turns)
    assert not os.listdir(tmp_path)

