"""Evaluation: pass@k / avg@k in closed form, categories, aggregation, and a tiny-model run."""

import importlib
import math
from itertools import combinations
from math import comb

import gymnasium as gym
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentgym.chat import ChatFormatter
from agentgym.config import parse_config
from agentgym.rollout.engines.base import Sample
from agentgym.rollout.engines.hf import HFEngine
from scripted_engine import NoCacheEngine  # tests/ is on sys.path
from env_adapters.babyai import BABYAI_FAMILIES
from agentgym.evaluation.metrics import (
    OVERALL,
    EvalReport,
    TaskResult,
    avg_at_k,
    eval_targets,
    evaluate,
    pass_at_k,
    task_category,
)


# -- estimators ------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 4, 5, 10, 16])
def test_pass_at_k_is_the_codex_closed_form(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k), abs=1e-12)


def test_pass_at_k_is_the_probability_that_a_random_k_subset_has_a_success():
    samples = [1, 0, 0, 1, 0, 0]  # n=6, c=2
    for k in range(1, 7):
        subsets = list(combinations(samples, k))
        exact = sum(any(s) for s in subsets) / len(subsets)
        assert pass_at_k(6, 2, k) == pytest.approx(exact)


def test_pass_at_k_edges():
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 = c/n
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 1, 4) == 1.0  # n == k: any success
    assert pass_at_k(2, 1, 4) == 1.0 and pass_at_k(2, 0, 4) == 0.0  # n < k: empirical
    assert math.isnan(pass_at_k(0, 0, 1))
    for bad in [(3, 4, 1), (3, -1, 1), (3, 1, 0)]:
        with pytest.raises(ValueError):
            pass_at_k(*bad)
    assert avg_at_k([True, False, False, True]) == 0.5 and math.isnan(avg_at_k([]))


# -- categories ------------------------------------------------------------------------------------
def test_babyai_families_are_minigrids_modules():
    from env_adapters.babyai import LEVELS, NUM_LEVELS

    import minigrid  # noqa: F401 - registers the BabyAI levels

    for level, name in LEVELS.items():
        module, cls = gym.spec(name).entry_point.split(":")
        defined_in = getattr(importlib.import_module(module), cls).__module__.rsplit(".", 1)[-1]
        data_idx = level - 1 + 3 * NUM_LEVELS  # any data_idx with this level
        assert task_category("babyai", data_idx) == BABYAI_FAMILIES[defined_in], name
    assert task_category("babyai", 0) == "GoTo" and task_category("babyai", 23) == "Unlock"
    assert task_category("babyai", 38) == "Synth"  # BossLevel


def test_textcraft_depth_and_other_categories():
    # AgentGym's goal order: 0..124 depth 1, 125..415 depth 2, 416..532 depth 3, 533..543 depth 4
    expect = {0: 1, 124: 1, 125: 2, 415: 2, 416: 3, 532: 3, 533: 4, 543: 4, 544: 1}
    assert {t: task_category("textcraft", t) for t in expect} == {t: f"depth-{d}" for t, d in expect.items()}
    assert task_category("keyword", 7) == "keyword"
    assert task_category("sciworld", 7) == "sciworld"
    assert task_category("http", 2, {"env_name": "babyai"}) == "GoTo"
    assert task_category("http", 2, {"env_name": "webshop"}) == "webshop"


# -- aggregation -----------------------------------------------------------------------------------
def _t(env, task, cat, n, c, infra=0):
    return TaskResult(env=env, task_id=task, category=cat, n=n, successes=c, reward_mean=c / n if n else float("nan"),
                      infra_errors=infra)


def test_aggregation_by_category_env_and_overall():
    k = 4
    tasks = [
        _t("babyai", 0, "GoTo", 4, 4), _t("babyai", 1, "GoTo", 4, 0), _t("babyai", 11, "Open", 4, 1),
        _t("babyai", 16, "Pickup", 0, 0, infra=4),  # all infra faults: not scored
        _t("textcraft", 0, "depth-1", 4, 2), _t("textcraft", 130, "depth-2", 3, 0, infra=1),
    ]
    rep = EvalReport.from_tasks(tasks, k=k, n=4, greedy=False, horizon=5, seed=0)
    goto = rep.row("babyai", "GoTo")
    assert (goto.tasks, goto.episodes) == (2, 8)
    assert goto.avg_at_k == pytest.approx((1.0 + 0.0) / 2) and goto.pass_at_k == pytest.approx(0.5)
    assert rep.row("babyai", "Open").avg_at_k == pytest.approx(0.25)
    assert rep.row("babyai", "Open").pass_at_k == 1.0
    pick = rep.row("babyai", "Pickup")
    assert pick.tasks == 0 and math.isnan(pick.avg_at_k) and pick.infra_errors == 4
    ov = rep.row("babyai", OVERALL)  # mean over the 3 scored tasks
    assert ov.avg_at_k == pytest.approx((1 + 0 + 0.25) / 3) and ov.pass_at_k == pytest.approx(2 / 3)
    assert ov.infra_errors == 4
    tc = rep.row("textcraft", OVERALL)
    # n=3 < k=4 on task 130: the empirical pass (no success -> 0)
    assert tc.avg_at_k == pytest.approx(0.25) and tc.pass_at_k == pytest.approx(0.5)
    assert rep.score == pytest.approx(((1 + 0 + 0.25) / 3 + 0.25) / 2)  # mean over envs
    m = rep.metrics("eval")
    assert m["eval/babyai/GoTo/avg_at_4"] == pytest.approx(0.5) and m["eval/babyai/Open/pass_at_4"] == 1.0
    assert m["eval/textcraft/depth-1/n_tasks"] == 1.0 and m["eval/overall/avg_at_4"] == pytest.approx(rep.score)
    assert [r["category"] for r in rep.table()] == ["GoTo", "Open", "Pickup", OVERALL, "depth-1", "depth-2", OVERALL]
    back = EvalReport.from_dict(rep.to_dict())
    assert back.rows[0] == rep.rows[0] and back.score == pytest.approx(rep.score)
    greedy = EvalReport.from_tasks([_t("keyword", 0, "keyword", 1, 1)], k=1, n=1, greedy=True, horizon=1, seed=0)
    assert greedy.metrics("eval") == {"eval/keyword/keyword/greedy_at_1": 1.0, "eval/keyword/keyword/n_tasks": 1.0,
                                      "eval/keyword/overall/greedy_at_1": 1.0, "eval/keyword/overall/n_tasks": 1.0,
                                      "eval/overall/greedy_at_1": 1.0}


def test_eval_targets_labels_duplicates_and_overrides():
    cfg = parse_config({"envs": [
        {"name": "keyword", "tasks": [0], "eval_tasks": [5, 5, 6]},
        {"name": "keyword", "tasks": [0], "eval_tasks": [7], "kwargs": {"target": "no"}},
        {"name": "babyai", "tasks": [0]},  # no eval tasks: skipped
    ]})
    got = [(t.label, t.tasks) for t in eval_targets(cfg)]
    assert got == [("keyword", [5, 6]), ("keyword-2", [7])]
    assert [(t.label, t.tasks) for t in eval_targets(cfg, {"babyai": [1, 2]})] == \
        [("keyword", [5, 6]), ("keyword-2", [7]), ("babyai", [1, 2])]
    with pytest.raises(ValueError, match="unknown environments"):
        eval_targets(cfg, {"sciworld": [1]})


# -- evaluate() end to end ---------------------------------------------------------------------------
class ScriptedEngine(NoCacheEngine):
    """Replies 'yes' to sample j of task t iff j < wins[t] (episode ids are eval:<env>:<task>:<j>)."""

    def __init__(self, tokenizer, wins):
        self.tok, self.wins, self.calls = tokenizer, wins, []
        self.generated_tokens = 0

    def generate(self, prompts, params, cache_keys=None):
        self.calls.append((len(prompts), params.greedy, params.seed))
        out = []
        for key in cache_keys:
            _, _, task, j = key.split(":")
            text = "yes" if int(j) < self.wins.get(int(task), 0) else "no"
            ids = self.tok(text, add_special_tokens=False)["input_ids"] + [self.tok.convert_tokens_to_ids("<|im_end|>")]
            out.append(Sample(ids, [-0.1] * len(ids), "stop"))
        return out


def test_evaluate_scores_match_the_closed_form(tiny_path):
    tok = AutoTokenizer.from_pretrained(tiny_path)
    wins = {0: 0, 1: 1, 2: 3, 3: 6}  # successes out of n=6 samples
    engine = ScriptedEngine(tok, wins)
    cfg = parse_config({"envs": [{"name": "keyword", "tasks": [9], "eval_tasks": [0, 1, 2, 3],
                                  "kwargs": {"target": "yes"}}],
                        "schedule": {"stages": [{"horizon": 1, "iterations": 1}]}})
    rep = evaluate(engine, ChatFormatter(tok), cfg, k=2, n=6, seed=5, batch_episodes=12)
    row = rep.row("keyword", "keyword")
    assert row.tasks == 4 and row.episodes == 24
    assert row.avg_at_k == pytest.approx(sum(c / 6 for c in wins.values()) / 4)
    assert row.pass_at_k == pytest.approx(sum(1 - comb(6 - c, 2) / comb(6, 2) for c in wins.values()) / 4)
    assert [c[0] for c in engine.calls] == [12, 12]  # two batches of whole tasks
    from agentgym.rollout.loop import turn_seed

    assert [c[2] for c in engine.calls] == [turn_seed(5 * 1_000_003 + b, 0) for b in (0, 1)]
    greedy = evaluate(engine, ChatFormatter(tok), cfg, k=4, greedy=True)
    assert (greedy.k, greedy.n) == (1, 1) and engine.calls[-1][1] is True
    assert greedy.row("keyword").avg_at_k == pytest.approx(3 / 4)  # sample 0 wins on tasks 1, 2, 3


@pytest.fixture(scope="module")
def tiny_engine(tiny_path):
    tok = AutoTokenizer.from_pretrained(tiny_path)
    engine = HFEngine(AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32), tok)
    return engine, ChatFormatter(tok)


def test_tiny_model_on_babyai_and_textcraft(tiny_engine):
    engine, fmt = tiny_engine
    cfg = parse_config({
        "envs": [{"name": "babyai", "tasks": [100], "eval_tasks": [0, 11, 16, 23, 38]},
                 {"name": "textcraft", "tasks": [200], "eval_tasks": [0, 130, 420]}],
        "rollout": {"max_new_tokens": 6, "max_context_tokens": 2048},
        "schedule": {"stages": [{"horizon": 2, "iterations": 1}]},
    })
    rep = evaluate(engine, fmt, cfg, k=2, seed=3)
    assert rep.horizon == 2 and (rep.k, rep.n) == (2, 2)
    cats = [(r.env, r.category) for r in rep.rows]
    assert cats == [("babyai", c) for c in ("GoTo", "Open", "Pickup", "Synth", "Unlock", OVERALL)] + \
        [("textcraft", c) for c in ("depth-1", "depth-2", "depth-3", OVERALL)]
    assert all(t.n == 2 and t.infra_errors == 0 for t in rep.tasks)
    for r in rep.rows:
        assert 0.0 <= r.avg_at_k <= r.pass_at_k <= 1.0
    assert rep.row("babyai").tasks == 5 and rep.row("textcraft").episodes == 6
    again = evaluate(engine, fmt, cfg, k=2, seed=3)  # same seed: the same episodes, same scores
    assert [t.successes for t in again.tasks] == [t.successes for t in rep.tasks]
    assert [t.reward_mean for t in again.tasks] == [t.reward_mean for t in rep.tasks]
    greedy = evaluate(engine, fmt, cfg, greedy=True, seed=3)
    assert all(t.n == 1 for t in greedy.tasks) and set(greedy.metrics()) >= {"eval/overall/greedy_at_1"}
