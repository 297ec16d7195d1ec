"""The relative judge (agentgym.rewards.judge, ``reward.judge``) against a real HTTP server on
127.0.0.1: the fake vLLM server's ``/v1/chat/completions`` route, whose answers each test
scripts. The scripted judge reads each episode's score from its text ("quality 0.35"), so a
score that lands on the wrong episode shows."""

from __future__ import annotations

import json
import math
import re
import socket
import time

import pytest
import torch
from pydantic import ValidationError

from agentgym.rewards.judge import (CACHE_DIR, GroupJudge, JudgeError, MalformedAnswer, build_request,
                                    combine, parse_scores, shuffle_order, transcript)
from agentgym.rewards.judge_config import JudgeConfig, RewardConfig
from agentgym.store.trajectory_store import TrajectoryStore
from agentgym.types import Episode, Turn
from env_adapters.base import InfraError
from fake_vllm_server import FakeVLLM  # tests/ is on sys.path (rootdir conftest)

_EPISODE = re.compile(r'<episode id="([^"]+)">\n(.*?)\n</episode>', re.S)
_QUALITY = re.compile(r"quality (\d+(?:\.\d+)?)")


def shown(body: dict) -> list[tuple[str, str]]:
    """(label, transcript) of each episode in a chat request, in the order shown."""
    return _EPISODE.findall(body["messages"][1]["content"])


def keyword_judge(body: dict) -> str:
    """Scores each episode by the first "quality X" in its transcript (0 without one)."""
    scores = []
    for label, text in shown(body):
        m = _QUALITY.search(text)
        scores.append({"id": label, "explanation": "scripted", "score": float(m.group(1)) if m else 0.0})
    return json.dumps({"scores": scores})


def turn(k: int, observation: str, action: str, **kw) -> Turn:
    return Turn(turn=k, observation=observation, action_text=action, parsed_action=action, reward=0.0,
                terminated=False, truncated=False, format_error=False, gen_tokens=3, env_latency_ms=1.0, **kw)


def episode(group: str, i: int, actions: list[str], reward: float = 0.0, *, env: str = "keyword",
            task: int = 7, first_obs: str = "Goal: open the red door.") -> Episode:
    turns = [turn(k, first_obs if k == 0 else f"you see wall {k}", a) for k, a in enumerate(actions)]
    return Episode(episode_id=f"{group}-e{i}", group_id=group, env=env, task_id=task, seed=0, horizon=5,
                   turns=turns, reward=reward, success=reward == 1.0, terminated=True)


def group_of(group: str, qualities: list[float], rewards: list[float] | None = None) -> list[Episode]:
    rewards = rewards or [0.0] * len(qualities)
    return [episode(group, i, ["go forward", f"toggle; quality {q}"], rewards[i]) for i, q in enumerate(qualities)]


def cfg_for(url: str, **kw) -> JudgeConfig:
    return JudgeConfig(**{"base_url": f"{url}/v1", "model": "base-model", "retry_backoff_s": 0.0,
                          "max_retries": 2, "timeout_s": 5.0, **kw})


@pytest.fixture()
def server():
    fake = FakeVLLM(None, lambda ids, body: [], chat=keyword_judge)
    yield fake
    fake.close()


def dead_port() -> int:
    with socket.socket() as s:  # bound then closed: nothing listens there
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- scores land on the right episodes ---------------------------------------------------------
def test_scores_map_back_to_their_episodes_despite_the_shuffle(server):
    qualities = [0.1, 0.9, 0.35, 0.6, 0.0, 0.75]
    eps = group_of("s3-g1-keyword-7", qualities)
    judge = GroupJudge(cfg_for(server.url))
    try:
        got = judge.score_group("s3-g1-keyword-7", eps, stage=0, iteration=3, global_step=3)
    finally:
        judge.close()
    assert got.scores == {e.episode_id: q for e, q in zip(eps, qualities)}
    assert not got.cached and got.requests == 1 and len(server.chat_requests) == 1
    labels_and_text = shown(server.chat_requests[0])
    order_shown = [float(_QUALITY.search(t).group(1)) for _, t in labels_and_text]
    assert order_shown != qualities, "the group was shown in its stored order: not shuffled"
    assert sorted(order_shown) == sorted(qualities)
    assert [label for label, _ in labels_and_text] == ["1", "2", "3", "4", "5", "6"]
    prompt = json.dumps(server.chat_requests[0]["messages"])
    assert "-e0" not in prompt and "s3-g1" not in prompt, "episode ids would reveal the stored order"
    body = server.chat_requests[0]
    assert body["temperature"] == 0.0 and body["response_format"] == {"type": "json_object"}


def test_same_seed_same_shuffle_and_prompt_other_step_other_order(server):
    eps = group_of("g", [0.2, 0.4, 0.6, 0.8, 1.0])
    judge = GroupJudge(cfg_for(server.url))
    try:
        a = judge.score_group("g", eps, stage=0, iteration=0, global_step=5)
        b = judge.score_group("g", list(reversed(eps)), stage=0, iteration=0, global_step=5)  # another read order
    finally:
        judge.close()
    assert a.scores == b.scores
    assert server.chat_requests[0]["messages"] == server.chat_requests[1]["messages"]
    cfg = cfg_for(server.url)
    ids = [e.episode_id for e in eps]
    assert build_request(cfg, "g", eps, 5) == build_request(cfg, "g", eps[::-1], 5)
    orders = {tuple(shuffle_order(ids, "g", step, 0)) for step in range(6)}
    assert len(orders) > 1, "the order does not depend on the global step"
    assert any(shuffle_order(ids, "g", s, 0) != shuffle_order(ids, "g", s, 1) for s in range(4)), \
        "the seed is not used"


# -- cache ------------------------------------------------------------------------------------
def test_cache_is_reused_by_a_resumed_run_and_never_asks_twice(server, tmp_path):
    store = TrajectoryStore(str(tmp_path / "store"), "run-1")
    eps = group_of("s2-g0-keyword-7", [0.3, 0.7, 0.5]) + group_of("s2-g1-keyword-8", [0.9, 0.1])
    first = GroupJudge.for_store(cfg_for(server.url), store)
    out1 = first.judge_iteration(eps, stage=1, iteration=2, global_step=2)
    first.close()
    assert len(server.chat_requests) == 2 and out1.metrics["judge/requests"] == 2
    for g in ("s2-g0-keyword-7", "s2-g1-keyword-8"):
        path = tmp_path / "store" / "run-1" / CACHE_DIR / "1-2" / f"{g}.json"
        record = json.loads(path.read_text())
        assert record["scores"] == {e.episode_id: out1.scores[e.episode_id] for e in eps if e.group_id == g}
    assert not list((tmp_path / "store" / "run-1" / CACHE_DIR).rglob(".tmp-*")), "a temp file was left"

    resumed = GroupJudge.for_store(cfg_for(server.url), TrajectoryStore(str(tmp_path / "store"), "run-1"))
    out2 = resumed.judge_iteration(eps, stage=1, iteration=2, global_step=2)
    assert len(server.chat_requests) == 2, "the resumed run asked the judge again"
    assert resumed.requests == 0
    assert out2.scores == out1.scores and out2.combined == out1.combined
    assert out2.metrics["judge/groups_cached"] == 2 and out2.metrics["judge/requests"] == 0

    # the same group id with other episodes (the iteration was rolled out again): asked again
    changed = group_of("s2-g0-keyword-7", [0.8, 0.2, 0.4])
    again = resumed.score_group("s2-g0-keyword-7", changed, stage=1, iteration=2, global_step=2)
    resumed.close()
    assert len(server.chat_requests) == 3 and not again.cached
    assert again.scores == {e.episode_id: q for e, q in zip(changed, [0.8, 0.2, 0.4])}


def test_cache_names_are_safe_for_any_group_id(tmp_path):
    judge = GroupJudge(cfg_for("http://127.0.0.1:9"), tmp_path)
    try:
        odd = judge.cache_path(0, 1, "s0-g0-pkg.mod:Env/x-3")
        plain = judge.cache_path(0, 1, "s0-g0-keyword-3")
    finally:
        judge.close()
    assert plain == f"{tmp_path}/0-1/s0-g0-keyword-3.json"
    assert odd is not None and "/" not in odd[len(f"{tmp_path}/0-1/"):] and ":" not in odd
    assert odd != judge.cache_path(0, 1, "s0-g0-pkg.mod_Env_x-3"), "two group ids share a cache file"


# -- combined reward --------------------------------------------------------------------------
@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.8])
def test_alpha_mixes_environment_and_judge_in_closed_form(server, alpha):
    qualities, rewards = [0.2, 0.9, 0.5], [1.0, 0.0, 0.5]
    eps = group_of("g", qualities, rewards) + group_of("h", [0.4, 0.6], [0.0, 0.25])
    eps.append(Episode(episode_id="g-e9", group_id="g", env="keyword", task_id=7, seed=0, horizon=5,
                       turns=[turn(0, "Goal", "quality 0.99")], reward=math.nan, infra_error=True))
    judge = GroupJudge(cfg_for(server.url, alpha=alpha))
    try:
        out = judge.judge_iteration(eps, stage=0, iteration=0, global_step=0)
    finally:
        judge.close()
    want_judge = dict(zip([e.episode_id for e in eps[:5]], qualities + [0.4, 0.6]))
    want_env = dict(zip([e.episode_id for e in eps[:5]], rewards + [0.0, 0.25]))
    assert out.scores == pytest.approx(want_judge)
    assert "g-e9" not in out.combined, "an infra-error episode was judged"
    assert all("quality 0.99" not in b["messages"][1]["content"] for b in server.chat_requests)
    for eid, j in want_judge.items():
        assert out.combined[eid] == pytest.approx(alpha * want_env[eid] + (1 - alpha) * j)
        assert combine(alpha, want_env[eid], j) == pytest.approx(out.combined[eid])
    rescored = out.rescored(eps[:5])
    assert [e.reward for e in rescored] == [out.combined[e.episode_id] for e in eps[:5]]
    assert [e.reward for e in eps[:5]] == rewards + [0.0, 0.25], "the episodes themselves were changed"


# -- failures are infrastructure errors, never a 0 --------------------------------------------
def _malformed(body):
    return "I think episode 1 is best."


def _wrong_ids(body):
    return json.dumps({"scores": [{"id": str(int(label) + 10), "score": 0.5} for label, _ in shown(body)]})


def _out_of_range(body):
    return json.dumps({"scores": [{"id": label, "score": 1.5} for label, _ in shown(body)]})


def _slow(body):
    time.sleep(1.5)
    return keyword_judge(body)


@pytest.mark.parametrize("how", ["refused", "timeout", "http500", "malformed", "wrong_ids", "out_of_range"])
def test_a_failing_judge_is_an_infra_error_never_a_zero(server, tmp_path, how):
    url = server.url
    if how == "refused":
        url = f"http://127.0.0.1:{dead_port()}"
    elif how == "http500":
        server.chat_fail_status, server.chat_fail_times = 500, 99
    else:
        server.chat = {"timeout": _slow, "malformed": _malformed, "wrong_ids": _wrong_ids,
                       "out_of_range": _out_of_range}[how]
    cfg = cfg_for(url, max_retries=1, timeout_s=0.3 if how == "timeout" else 5.0)
    judge = GroupJudge(cfg, tmp_path / "cache")
    eps = group_of("g", [0.5, 0.6])
    try:
        with pytest.raises(JudgeError) as err:
            judge.judge_iteration(eps, stage=0, iteration=0, global_step=0)
    finally:
        judge.close()
    assert isinstance(err.value, InfraError)
    assert "2 tries" in str(err.value) and "group g" in str(err.value)
    want = {"refused": "ConnectError", "timeout": "timed out", "http500": "HTTP 500", "malformed": "not JSON",
            "wrong_ids": "unknown episode id", "out_of_range": "not a number in [0, 1]"}[how]
    assert want in str(err.value)
    assert judge.requests == 2
    assert len(server.chat_requests) == (0 if how == "refused" else 2)
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").rglob("*.json")), \
        "a failed group was cached"


def test_a_rejected_request_is_not_retried(server):
    judge = GroupJudge(cfg_for(server.url, model="no-such-model"))
    try:
        with pytest.raises(JudgeError, match=r"HTTP 404.*check reward.judge.model"):
            judge.score_group("g", group_of("g", [0.1, 0.2]), stage=0, iteration=0, global_step=0)
    finally:
        judge.close()
    assert len(server.chat_requests) == 1


def test_a_malformed_answer_is_retried_with_the_reason_and_then_succeeds(server):
    answers = iter(['{"scores": [', None])

    def flaky(body):
        bad = next(answers)
        return bad if bad is not None else keyword_judge(body)

    server.chat = flaky
    eps = group_of("g", [0.25, 0.75])
    judge = GroupJudge(cfg_for(server.url))
    try:
        got = judge.score_group("g", eps, stage=0, iteration=0, global_step=0)
    finally:
        judge.close()
    assert got.scores == {eps[0].episode_id: 0.25, eps[1].episode_id: 0.75} and got.requests == 2
    first, second = server.chat_requests
    assert second["messages"][:2] == first["messages"]
    assert second["messages"][2] == {"role": "assistant", "content": '{"scores": ['}
    assert "not JSON" in second["messages"][3]["content"]


def test_a_5xx_then_a_good_answer_succeeds(server):
    server.chat_fail_status, server.chat_fail_times = 503, 1
    eps = group_of("g", [0.4, 0.1])
    judge = GroupJudge(cfg_for(server.url))
    try:
        got = judge.score_group("g", eps, stage=0, iteration=0, global_step=0)
    finally:
        judge.close()
    assert got.scores == {eps[0].episode_id: 0.4, eps[1].episode_id: 0.1} and got.requests == 2
    assert server.chat_requests[0]["messages"] == server.chat_requests[1]["messages"]


def test_the_api_key_comes_from_the_named_environment_variable(server, monkeypatch):
    seen = []
    original = server.chat

    def spy(body):
        seen.append(body)
        return original(body)

    server.chat = spy
    with pytest.raises(ValueError, match="JUDGE_KEY_T.*not set"):
        GroupJudge(cfg_for(server.url, api_key_env="JUDGE_KEY_T"))
    monkeypatch.setenv("JUDGE_KEY_T", "sk-test")
    judge = GroupJudge(cfg_for(server.url, api_key_env="JUDGE_KEY_T"))
    try:
        assert judge._client.headers["Authorization"] == "Bearer sk-test"
        judge.score_group("g", group_of("g", [0.1, 0.2]), stage=0, iteration=0, global_step=0)
    finally:
        judge.close()
    assert seen and "sk-test" not in json.dumps(seen), "the key leaked into the request body"


# -- the answer and the prompt ----------------------------------------------------------------
def test_parse_scores_is_strict():
    ok = parse_scores('```json\n{"scores": [{"id": 1, "score": 1}, {"id": "2", "score": 0.5, '
                      '"explanation": "x"}]}\n```', ["1", "2"])
    assert ok == {"1": (1.0, ""), "2": (0.5, "x")}
    bad = {
        "": "empty", "[1, 2]": '"scores" list', '{"scores": [{"id": "1", "score": 0.2}]}': "no score for episode id",
        '{"scores": [{"id": "1", "score": 0.2}, {"id": "1", "score": 0.3}]}': "scored twice",
        '{"scores": [{"id": "1", "score": true}, {"id": "2", "score": 0}]}': "not a number",
        '{"scores": [{"id": "1", "score": NaN}, {"id": "2", "score": 0}]}': "not a number",
        '{"scores": [{"id": "1", "score": -0.1}, {"id": "2", "score": 0}]}': "not a number",
        '{"scores": [{"id": "3", "score": 0.1}, {"id": "2", "score": 0}]}': "unknown episode id",
        'Sure! {"scores": []}': "not JSON",
    }
    for text, why in bad.items():
        with pytest.raises(MalformedAnswer, match=re.escape(why)):
            parse_scores(text, ["1", "2"])


def test_transcripts_are_cut_to_the_budget_and_keep_the_outcome():
    cfg = cfg_for("http://127.0.0.1:9", max_chars_per_episode=400, max_task_chars=150)
    long = episode("g", 0, ["start " + "a" * 2000, "b" * 2000 + " finish"], reward=1.0,
                   first_obs="Goal: " + "t" * 1000 + " END")
    text = transcript(long, cfg)
    assert len(text) <= 400
    assert text.startswith("Action 1: start") and "characters cut" in text
    assert text.endswith("Outcome: the task ended after 2 turns; environment reward 1, success: yes")
    assert "finish" in text.splitlines()[-2]
    user = build_request(cfg, "g", [long], 0).messages[1]["content"]
    task = user.split("</task>")[0]
    assert len(task) < 150 + 60 and task.rstrip().endswith("END")
    hidden = transcript(long, cfg_for("http://127.0.0.1:9", show_env_reward=False))
    assert "environment reward" not in hidden and "success" not in hidden
    flagged = episode("g", 1, ["x", "y"])
    flagged.turns[1].format_error = True
    assert "Action 2 [format error]: y" in transcript(flagged, cfg)
    assert "Observation: you see wall 1" in transcript(flagged, cfg)


# -- config -----------------------------------------------------------------------------------
def test_judge_config_describes_every_field_and_says_how_to_fix():
    for model in (JudgeConfig, RewardConfig):
        for name, f in model.model_fields.items():
            assert f.description, f"{model.__name__}.{name} has no description"
    assert RewardConfig().judge is None
    good = {"base_url": "http://127.0.0.1:8000/v1", "model": "m"}
    assert RewardConfig(judge=good).judge.alpha == 0.5
    cases = [({"alpha": 1.0}, "alpha=1 gives the judge no weight"),
             ({"alpha": 1.5}, "less than or equal to 1"),
             ({"base_url": "http://h:8000/v1/chat/completions"}, "set it to the base the routes hang off, http://h:8000/v1"),
             ({"base_url": "127.0.0.1:8000/v1"}, "not an http(s) URL"),
             ({"api_key_env": " "}, "api_key_env is empty"),
             ({"max_retries": -1}, "greater than or equal to 0"),
             ({"temprature": 0.1}, "Extra inputs are not permitted")]
    for change, msg in cases:
        with pytest.raises(ValidationError, match=re.escape(msg)):
            JudgeConfig(**{**good, **change})
    with pytest.raises(ValidationError, match="model"):
        JudgeConfig(base_url="http://h/v1")


# -- through the pipeline ---------------------------------------------------------------------
def test_the_pipeline_compares_combined_rewards_and_reuses_the_judge_on_resume(server, tmp_path, model_cache):
    """PolicySession.advantages with a judge: GRPO over alpha x env + (1 - alpha) x judge (the
    scripted judge scores by each reply's length), stored rewards unchanged; a second session on
    the same run (a resume whose advantages were not committed) asks nothing."""
    from agentgym import algorithms as A
    from agentgym.batch import EpisodeBatch
    from agentgym.pipeline import IterationRef, PolicySession, episode_scores
    from configs import parse_tiny_config  # tests/ is on sys.path

    def by_length(body):
        return json.dumps({"scores": [{"id": label, "score": min(len(text) / 200, 1.0)}
                                      for label, text in shown(body)]})

    server.chat = by_length
    cfg = parse_tiny_config(model_cache, store_root=tmp_path / "store", rollout={"group_size": 3})
    judge_cfg = cfg_for(server.url, alpha=0.25, show_env_reward=False)
    ref = IterationRef(0, 0, 0)
    session = PolicySession(cfg, "judged")
    assert session.judge is None  # no reward.judge in the config: the environment's rewards alone
    session.judge = GroupJudge.for_store(judge_cfg, session.store)
    try:
        session.collect(ref, horizon=1)
        out = session.advantages(ref)
        episodes = session.store.read_episodes(0, 0)
    finally:
        session.close()
    assert len(server.chat_requests) == 2 and out["judge/groups"] == 2 and out["judge/requests"] == 2
    judge_score = {}
    for body in server.chat_requests:
        for label, text in shown(body):
            judge_score[text] = min(len(text) / 200, 1.0)
    combined = torch.tensor([0.25 * e.reward + 0.75 * judge_score[transcript(e, judge_cfg)] for e in episodes])
    assert len(set(combined.tolist())) > 1
    batch = EpisodeBatch.from_episodes(episodes).padded(0)
    want, _ = A.compute_advantages("grpo", A.place_outcome_reward(combined, batch.loss_mask), batch.loss_mask,
                                   [e.group_id for e in episodes])
    env_only, _ = A.compute_advantages("grpo", A.place_outcome_reward(episode_scores(episodes), batch.loss_mask),
                                       batch.loss_mask, [e.group_id for e in episodes])
    table = {r.episode_id: list(r.advantages) for r in
             session.store.read_table("advantages", stage=0, iteration=0).itertuples(index=False)}
    for i, e in enumerate(episodes):
        n = len(e.input_ids)
        torch.testing.assert_close(torch.tensor(table[e.episode_id]), want[i, :n].float(), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(want, env_only), "the judge changed nothing the test can see"
    assert all(0.0 <= e.reward <= 1.0 for e in episodes)

    # a resume: the advantages commit is gone (retracted), the judge's answers are cached
    session.store.retract(0, 0, ("advantages",))
    again = PolicySession(cfg, "judged")
    again.judge = GroupJudge.for_store(judge_cfg, again.store)
    try:
        out2 = again.advantages(ref)
    finally:
        again.close()
    assert len(server.chat_requests) == 2 and out2["judge/groups_cached"] == 2 and out2["judge/requests"] == 0
