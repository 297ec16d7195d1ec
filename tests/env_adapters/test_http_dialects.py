"""``agentgym env serve`` answers AgentGym's own clients as AgentGym's servers do, and no request
changes an instance it does not name.

The schemas pinned here are read from AgentGym's servers (WooooDyy/AgentGym, commit 3ef9235):
``agentenv-babyai/agentenv_babyai/environment.py`` (``BabyAIEnv.create/reset/step/observe``),
``agentenv-textcraft/agentenv_textcraft/env_wrapper.py``, ``agentenv-sciworld/agentenv_sciworld/
environment.py`` and ``agentenv-searchqa/agentenv_searchqa/server.py`` + ``env_wrapper.py``; the
requests are the ones their clients (``agentenv/agentenv/envs/<env>.py``) send. The same clients,
run for real against these servers, are ``scripts/agentgym_interop.py clients`` (docs/serving.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

_HERE = Path(__file__).resolve().parent
if str(_HERE) not in sys.path:
    sys.path.insert(0, str(_HERE))

from serving import ServerThread  # noqa: E402
from test_conformance import CASES, unavailable  # noqa: E402

import env_adapters  # noqa: E402
from env_adapters.checker import check_server_isolation  # noqa: E402
from env_adapters.experts import make_expert  # noqa: E402
from env_adapters.http_client import HTTPEnv  # noqa: E402
from env_adapters.http_server import ID_MIN, create_app  # noqa: E402
from env_adapters.http_server_dialects import DIALECT_HEADER, DIALECTS, NATIVE  # noqa: E402


@pytest.fixture(scope="module")
def servers():
    """One server per served environment, in its default (native) dialect, with the adapter's
    defaults (no small move limits: episodes here run to success)."""
    started: dict[str, ServerThread] = {}

    def get(env_name: str) -> ServerThread:
        if env_name not in started:
            started[env_name] = ServerThread(create_app(env_name, max_envs=8))
        return started[env_name]

    yield get
    for s in started.values():
        s.stop()


def _keys(data) -> set[str]:
    assert isinstance(data, dict), data
    return set(data)


# ----------------------------------------------------------- AgentGym's schemas, route by route
def test_babyai_answers_as_agentenv_babyai(servers):
    url = servers("babyai").url
    created = httpx.post(f"{url}/create").json()  # BabyAIEnvClient posts no body
    assert _keys(created) == {"id"} and isinstance(created["id"], int) and created["id"] >= ID_MIN
    i = created["id"]
    reset = httpx.post(f"{url}/reset", json={"data_idx": 0, "id": i}).json()
    assert _keys(reset) == {"observation", "reward", "score", "deleted", "done"}
    assert isinstance(reset["observation"], str) and reset["reward"] == 0 and reset["score"] == 0
    assert reset["deleted"] is False and reset["done"] is False
    step = httpx.post(f"{url}/step", json={"action": "turn left", "id": i}).json()
    assert _keys(step) == {"observation", "reward", "score", "done"}
    assert isinstance(step["observation"], str) and isinstance(step["done"], bool)
    obs = httpx.get(f"{url}/observation", params={"id": i}).json()  # BabyAI's observe() is a dict
    assert _keys(obs) == {"observation", "reward", "score", "done", "deleted"}
    bad = httpx.post(f"{url}/step", json={"action": "turn left", "id": i + 1})
    assert bad.status_code == 200 and isinstance(bad.json()["error"], str)  # AgentGym's error shape
    assert httpx.post(f"{url}/close", json={"id": i}).json() is True


def test_textcraft_answers_as_agentenv_textcraft(servers):
    url = servers("textcraft").url
    body = {"minecraft_dir": "agentenv_textcraft/", "commands": None, "goal": None}  # TextCraftEnvClient's
    created = httpx.post(f"{url}/create", json=body).json()
    assert _keys(created) == {"id", "observation", "done", "reward"}  # the client reads "observation" here
    assert "Goal: craft" in created["observation"] and created["done"] is False and created["reward"] == 0
    i = created["id"]
    reset = httpx.post(f"{url}/reset", json={"data_idx": 300, "id": i}).json()
    assert _keys(reset) == {"id", "observation", "done", "reward"} and reset["id"] == i
    step = httpx.post(f"{url}/step", json={"action": "inventory", "id": i}).json()
    assert _keys(step) == {"observation", "reward", "done"}
    assert isinstance(httpx.get(f"{url}/observation", params={"id": i}).json(), str)
    refused = httpx.post(f"{url}/create", json={**body, "goal": "minecraft:stick"}).json()
    assert "custom crafting commands" in refused["error"]
    assert httpx.post(f"{url}/close", json={"id": i}).json() is True


def test_sciworld_answers_as_agentenv_sciworld(servers):
    url = servers("sciworld").url
    i = httpx.post(f"{url}/create").json()["id"]
    reset = httpx.post(f"{url}/reset", json={"data_idx": 0, "id": i}).json()
    assert _keys(reset) == {"task_name", "var_num", "task_description", "observation", "reward", "score",
                            "deleted", "done"}
    assert reset["task_name"] == "boil" and reset["var_num"] == 0 and reset["score"] == 0
    # the client prepends the description itself: the observation is the first "look around" alone
    assert reset["task_description"].startswith("Your task is to boil")
    assert reset["task_description"] not in reset["observation"] and "This room is called" in reset["observation"]
    step = httpx.post(f"{url}/step", json={"action": "look around", "id": i}).json()
    assert _keys(step) == {"observation", "reward", "score", "done"}
    assert isinstance(step["score"], (int, float)) and step["reward"] == 0
    assert isinstance(httpx.get(f"{url}/observation", params={"id": i}).json(), str)
    desc = httpx.get(f"{url}/task_description", params={"id": i}).json()
    assert desc == {"task_description": reset["task_description"]}
    assert httpx.post(f"{url}/close", json={"id": i}).json() is True


def test_deepsearch_answers_as_agentenv_searchqa(servers):
    url = servers("deepsearch").url
    env_idx = httpx.post(f"{url}/create", json={"id": 0}).json()  # SearchQAEnvClient: a bare int back
    assert isinstance(env_idx, int) and not isinstance(env_idx, bool)
    first = httpx.get(f"{url}/observation", params={"env_idx": env_idx}).json()
    assert isinstance(first, str) and "Question:" in first  # created on question 0, as AgentGym's
    obs = httpx.post(f"{url}/reset", json={"id": 3, "env_idx": env_idx}).json()
    local = env_adapters.make_env("deepsearch")
    assert obs == local.reset(3)[0]  # a bare string: question 3's prompt
    step = httpx.post(f"{url}/step", json={"action": "<search>x</search>", "env_idx": env_idx}).json()
    assert _keys(step) == {"observation", "reward", "done", "info"} and step["info"] is None
    assert step["observation"].startswith("<information>") and step["reward"] == 0 and step["done"] is False
    assert httpx.post(f"{url}/close", json={"env_idx": env_idx}).json() is True
    local.close()


def test_running_scores_follow_agentgym(servers):
    """BabyAI's ``score`` is the sum of the episode's rewards (AgentGym adds each step's reward to
    it); SciWorld's ``reward`` is the change of ScienceWorld's 0..100 score."""
    url = servers("babyai").url
    i = httpx.post(f"{url}/create").json()["id"]
    httpx.post(f"{url}/reset", json={"id": i, "data_idx": 0})
    shadow, expert = _shadow("babyai", 0)
    total, step = 0.0, {}
    while not step.get("done"):
        action = expert.act(None)
        step = httpx.post(f"{url}/step", json={"id": i, "action": action}).json()
        total += shadow.step(f"Action: {action}").reward
        assert step["score"] == pytest.approx(total)
    assert step["reward"] > 0 and step["score"] == pytest.approx(step["reward"])  # one reward, at the end
    shadow.close()

    url = servers("sciworld").url
    i = httpx.post(f"{url}/create").json()["id"]
    httpx.post(f"{url}/reset", json={"id": i, "data_idx": 0})
    shadow, expert = _shadow("sciworld", 0)
    last, scores = 0, []
    while len(scores) < 60 and last < 100:
        action = expert.act(None)
        step = httpx.post(f"{url}/step", json={"id": i, "action": action}).json()
        shadow.step(f"Action: {action}")
        assert step["reward"] == step["score"] - last
        last = step["score"]
        scores.append(last)
    assert len(set(scores)) > 2 and last == 100  # the gold path earns the score in parts
    shadow.close()


def _shadow(env_name: str, task: int):
    """An in-process twin of a served instance on ``task`` and its scripted expert: what the
    server's instance will do is what the twin does (the environments are deterministic)."""
    env = env_adapters.make_env(env_name)
    obs, info = env.reset(task, 0)
    expert = make_expert(env_name)
    expert.reset(env, obs, info)
    return env, expert


# ---------------------------------------- this project's client, in AgentGym's dialects, to a reward
@pytest.mark.parametrize("env_name,task", [("babyai", 40), ("textcraft", 0), ("sciworld", 0), ("deepsearch", 3)])
def test_own_client_in_agentgym_dialects_reaches_the_reward(servers, env_name, task):
    """``HTTPEnv(dialect=X)`` is what talks to AgentGym's real servers; against ours (no dialect
    header: the server's native default) it plays an expert episode to success."""
    url = servers(env_name).url
    remote = HTTPEnv(url, env_name, dialect=NATIVE[env_name], timeout_s=60)
    shadow, expert = _shadow(env_name, task)
    try:
        remote.reset(task, 0)
        res = None
        for _ in range(60):
            action = expert.act(None)
            assert action is not None
            reply = action if env_name == "deepsearch" else f"Thought:\nplan\n\nAction:\n{action}"
            res, twin = remote.step(reply), shadow.step(reply)
            assert (res.observation, res.reward) == (twin.observation, twin.reward)
            if twin.terminated or twin.truncated:
                break
        assert twin.info.get("success") and res.terminated and res.reward > 0
    finally:
        remote.close()
        shadow.close()


# ------------------------------------------------------------------ instance isolation (issue 28)
@pytest.mark.parametrize("env_name", sorted(CASES))
def test_no_request_changes_an_instance_it_does_not_name(servers, env_name):
    """Two clients on one server, every route of every dialect: client B's requests, including
    ones that carry client A's id under another instance key, never change A's episode."""
    if why := unavailable(env_name):
        pytest.skip(why)
    tasks = tuple(CASES[env_name][:2])
    for dialect in DIALECTS:
        sent = check_server_isolation(servers(env_name).url, dialect, task_ids=tasks)
        assert sent >= 10


def test_deep_search_reads_the_instance_from_env_idx_and_the_question_from_id(servers):
    """The reported case: ``/reset {"id": 3, "env_idx": 2}`` resets instance 2 to question 3, and
    a request naming an instance only by ``id`` is a 400 that changes nothing."""
    url = servers("deepsearch").url
    mine = httpx.post(f"{url}/create", json={"id": 0}).json()
    theirs = httpx.post(f"{url}/create", json={"id": 0}).json()
    httpx.post(f"{url}/reset", json={"env_idx": theirs, "id": 5})
    theirs_obs = httpx.get(f"{url}/observation", params={"env_idx": theirs}).json()
    got = httpx.post(f"{url}/reset", json={"id": 3, "env_idx": mine}).json()
    assert "Question:" in got and got != theirs_obs
    refused = httpx.post(f"{url}/reset", json={"id": theirs})
    assert refused.status_code == 400 and "env_idx" in refused.json()["error"]
    refused = httpx.post(f"{url}/step", json={"id": theirs, "env_idx": mine, "action": "<answer>x</answer>"})
    assert refused.status_code == 400
    assert httpx.get(f"{url}/observation", params={"env_idx": theirs}).json() == theirs_obs
    for i in (mine, theirs):
        assert httpx.post(f"{url}/close", json={"env_idx": i}).json() is True


def test_a_task_index_sent_as_an_instance_names_no_instance(servers):
    url = servers("keyword").url
    i = httpx.post(f"{url}/create", json={}).json()["id"]
    assert i >= ID_MIN  # ids are never small task-like numbers
    r = httpx.post(f"{url}/reset", json={"id": 3, "data_idx": 0}).json()
    assert r["code"] == "unknown_id"
    httpx.post(f"{url}/close", json={"id": i})


def test_the_dialect_header_and_health(servers):
    url = servers("deepsearch").url
    assert httpx.get(f"{url}/health").json()["dialect"] == "deepsearch"
    generic = httpx.post(f"{url}/create", json={}, headers={DIALECT_HEADER: "agentgym"}).json()
    assert _keys(generic) == {"id"}  # the same server, asked in this project's dialect
    r = httpx.post(f"{url}/create", json={}, headers={DIALECT_HEADER: "klingon"})
    assert r.status_code == 400 and "klingon" in r.json()["error"]
    httpx.post(f"{url}/close", json={"id": generic["id"]}, headers={DIALECT_HEADER: "agentgym"})
    assert httpx.get(f"{servers('keyword').url}/health").json()["dialect"] == "agentgym"


def test_env_serve_refuses_an_unknown_dialect():
    from typer.testing import CliRunner

    from agentgym_cli.cli import app

    result = CliRunner().invoke(app, ["env", "serve", "babyai", "--dialect", "klingon"])
    assert result.exit_code == 2 and "choose native or one of" in result.output
