"""MiniWoB++ in headless Chromium (env_adapters/miniwob.py), its scripted expert, and WebArena's
text interface that it speaks (env_adapters/web_text.py, also the ``webarena`` client dialect's).

The browser tests need Debian's ``chromium`` + ``chromium-driver`` (scripts/setup.sh installs them
where apt-get is available) and skip, saying so, without them. Each MiniWoBEnv starts its own
Chromium, so the module is in the slow lane. The expert test prints how many of its tasks (two
instances of each family) the expert and the random valid-action policy solve (``pytest -s``);
the random policy solves a fair share because MiniWoB's pages end an episode at the first click
on a wrong button, and some pages have one button.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from env_adapters import make_env, task_category  # noqa: E402
from env_adapters.base import InfraError  # noqa: E402
from env_adapters.baselines import random_valid_action_success  # noqa: E402
from env_adapters.checker import check_env  # noqa: E402
from env_adapters.experts import make_expert  # noqa: E402
from env_adapters.http_client import WebArenaDialect  # noqa: E402
from env_adapters.miniwob import FAMILIES, SEED_STRIDE, chromium_missing, family_of, parse_reply  # noqa: E402
from env_adapters.web_text import (  # noqa: E402
    AXNode, WebAction, extract_web_action, parse_web_action, render_accessibility_tree)

pytestmark = pytest.mark.timeout(300)
MISSING = chromium_missing()
needs_chromium = pytest.mark.skipif(MISSING is not None, reason=f"MiniWoB++ cannot run here: {MISSING}")

N = len(FAMILIES)
ENTER_TEXT = FAMILIES.index("enter-text")  # task id of enter-text, instance 0
LOGIN = FAMILIES.index("login-user")
SNAPSHOT_CLICK_TEST = (
    "OBSERVATION:\n"
    "[1] RootWebArea 'Click Test Task' focused: True\n"
    "\t[4] button 'Click Me!'\n"
    "URL: miniwob/click-test.html\n"
    "OBJECTIVE: Click the button.\n"
    "PREVIOUS ACTION: None"
)


# ---------------------------------------------------------------------------- no browser needed
def test_parse_web_action_is_webarenas_grammar():
    ok = {
        "click [12]": WebAction("click", 12),
        "click[12]": WebAction("click", 12),
        "hover [3]": WebAction("hover", 3),
        "type [5] [hello world]": WebAction("type", 5, "hello world", press_enter=True),
        "type [5] [hello] [0]": WebAction("type", 5, "hello", press_enter=False),
        "type [5] [a [b] c] [1]": WebAction("type", 5, "a [b] c", press_enter=True),
        "press [Ctrl+a]": WebAction("press", text="Ctrl+a"),
        "scroll [down]": WebAction("scroll", direction="down"),
        "scroll up": WebAction("scroll", direction="up"),
        "goto [http://x.org]": WebAction("goto", text="http://x.org"),
        "new_tab": WebAction("new_tab"), "go_back": WebAction("go_back"),
        "tab_focus [2]": WebAction("tab_focus", 2),
        "stop [42]": WebAction("stop", text="42"), "stop": WebAction("stop", text=""),
    }
    for text, want in ok.items():
        got, why = parse_web_action(text)
        assert got == want, (text, got, why)
    for bad in ["", "   ", "click", "click [x]", "Click [3]", "type [5]", "type [a] [b]",
                "press", "scroll [left]", "tab_focus [x]", "fly [3]", "look"]:
        got, why = parse_web_action(bad)
        assert got is None and why, bad
    # canonical text round-trips (what the expert writes and the adapter reports)
    for text in ["click [4]", "type [5] [Myron] [0]", "type [5] [Myron]", "press [Enter]", "scroll [up]"]:
        action, _ = parse_web_action(text)
        assert str(action) == text


def test_extract_web_action_first_block_then_action_line():
    reply = "Let's think.\nIn summary, the next action I will perform is ```click [3]``` then ```click [4]```"
    assert extract_web_action(reply, 4000) == ("click [3]", "")  # WebArena's server takes the first
    assert extract_web_action("Thought:\nok\n\nAction:\nclick [7]", 4000) == ("click [7]", "")
    assert extract_web_action("Action: `type [5] [Jo] [0]`", 4000) == ("type [5] [Jo] [0]", "")
    assert extract_web_action("click [9]", 4000) == ("click [9]", "")  # a bare one-line reply
    for bad in ["", "two\nlines", "Action:", "``````", "x" * 5000]:
        assert extract_web_action(bad, 4000)[0] is None, bad
    assert parse_reply("Action: click [4]") == ("click [4]", "")
    assert parse_reply("Action: fly")[0] is None


def test_render_accessibility_tree_in_webarenas_format():
    tree = AXNode("RootWebArea", "Shop", 1, [("focused", True)], [
        AXNode("generic", "", 2, [], [  # nameless layout: skipped, children move up
            AXNode("link", "Home", 3),
            AXNode("StaticText", "It's  here"),
            AXNode("checkbox", "Gift", 5, [("checked", False)]),
        ]),
        AXNode("textbox", "", 6, [("value", "abc")]),
    ])
    assert render_accessibility_tree(tree) == (
        "[1] RootWebArea 'Shop' focused: True\n"
        "\t[3] link 'Home'\n"
        "\tStaticText \"It's here\"\n"
        "\t[5] checkbox 'Gift' checked: False\n"
        "\t[6] textbox '' value: 'abc'")


def test_webarena_dialect_refuses_what_the_server_could_not_parse():
    d = WebArenaDialect()
    reply = "In summary, the next action I will perform is ```type [164] [restaurants near CMU] [1]```"
    assert d.extract_action(reply) == (reply, None)  # sent raw: the server parses it
    assert d.extract_action("Action: click [3]")[0] is None  # no ``` block (AgentGym's client rule)
    action, error = d.extract_action("```fly [3]```")
    assert action is None and "unknown command" in error


def test_task_ids_map_to_families_and_seeds():
    assert [family_of(t)[0] for t in range(N)] == list(FAMILIES)
    assert family_of(N + 2) == (FAMILIES[2], 1)
    assert task_category("miniwob", 3 * N + 4) == FAMILIES[4]
    assert SEED_STRIDE > 10_000  # (task, seed) pairs never share a page seed for tasks < 10^4 * N


# ---------------------------------------------------------------------------- in the browser
@pytest.fixture(scope="module")
def env():
    if MISSING:
        pytest.skip(f"MiniWoB++ cannot run here: {MISSING}")
    e = make_env("miniwob")
    yield e
    e.close()


def element(env, role: str, name: str | None = None) -> int:
    """The id of the first element of ``role`` (named ``name``) the observation shows."""
    return next(n.node_id for n in env.shown if n.role == role and (name is None or n.name == name))


def act(env, action: str):
    return env.step(f"Let's think step by step. In summary, the next action I will perform is ```{action}```")


@needs_chromium
def test_conformance_checker_passes():
    # click-checkboxes and login-user (test_conformance.py runs click-test, click-collapsible, enter-text)
    report = check_env(lambda: make_env("miniwob"), [FAMILIES.index("click-checkboxes"), LOGIN], horizon=4)
    print(f"miniwob: {report['ms_per_step']:.0f} ms/step (incl. reset), {report['ms_per_reset']:.0f} ms/reset")
    assert report["steps"] > 0


@needs_chromium
def test_snapshot_and_success(env):
    obs, info = env.reset(0)
    assert obs == SNAPSHOT_CLICK_TEST
    assert info["family"] == "click-test" and info["success"] is False
    assert env.valid_actions() == ["click [4]"]
    res = act(env, "click [4]")
    assert res.terminated and not res.truncated and res.reward == 1.0 and res.info["success"] is True
    assert res.info["raw_reward"] == 1.0 and res.info["parsed_action"] == "click [4]"
    assert act(env, "click [4]").terminated  # a finished episode stays finished


@needs_chromium
def test_failure_is_reward_zero(env):
    env.reset(ENTER_TEXT)
    res = act(env, f"click [{element(env, 'button', 'Submit')}]")  # submit with the field empty
    assert res.terminated and res.reward == 0.0 and res.info["success"] is False
    assert res.info["raw_reward"] == -1.0


@needs_chromium
def test_reset_reproduces_a_fresh_page(env):
    first, info = env.reset(LOGIN, seed=1)
    assert info["page_seed"] == 0 + SEED_STRIDE
    # change the page: type into both fields, then leave the episode half done
    boxes = [a for a in env.valid_actions() if a.startswith("type")]
    for a in boxes[:2]:
        res = act(env, a + " [0]")
        assert not res.info["format_error"] and not res.info["invalid_action"], res.observation
    assert env.observe() != first
    env.reset(0)  # another family in between
    again, _ = env.reset(LOGIN, seed=1)
    assert again == first
    fresh = make_env("miniwob")
    try:
        assert fresh.reset(LOGIN, seed=1)[0] == first
        assert fresh.reset(LOGIN, seed=0)[0] != first  # the seed changes the page
    finally:
        fresh.close()


@needs_chromium
def test_two_instances_are_isolated():
    a, b = make_env("miniwob"), make_env("miniwob")
    try:
        obs_a, _ = a.reset(ENTER_TEXT)
        obs_b, _ = b.reset(ENTER_TEXT)
        assert obs_a == obs_b
        assert not set(a.browser_pids()) & set(b.browser_pids())  # one browser each
        typed = act(a, [x for x in a.valid_actions() if x.startswith("type")][0] + " [0]")
        assert "value: " in typed.observation
        assert b.observe() == obs_b  # A's typing did not reach B's page
        submit = element(a, "button", "Submit")
        wrong = act(b, f"click [{submit}]")  # B submits its empty field: its episode ends
        assert wrong.terminated and not wrong.info["success"]
        assert a.observe() == typed.observation  # ...and A's goes on as it was
        assert act(a, f"click [{submit}]").info["success"] is True
    finally:
        a.close()
        b.close()


@needs_chromium
def test_malformed_replies_are_format_errors_and_impossible_actions_invalid(env):
    obs, _ = env.reset(ENTER_TEXT)
    page = obs.split("URL:")[0]
    for junk in ["", "I am not sure.\nLet me think", "Action:", "```fly [3]```", "```click```",
                 "```click [abc]```", "```Click [5]```", "x" * 5000, "```type [5]```"]:
        res = env.step(junk)
        assert res.info["format_error"] is True, junk
        assert res.reward == 0.0 and not res.terminated and not res.truncated
        assert res.observation.startswith("Invalid action:") and page in res.observation
    for wrong, why in [("click [999]", "no element [999]"), ("type [6] [hi]", "is a button"),
                       ("hover [5]", "not available"), ("goto [http://example.com]", "not available"),
                       ("stop [done]", "not available"), ("new_tab", "not available"),
                       ("press [Hyper+q]", "unknown key")]:
        res = act(env, wrong)
        assert res.info["invalid_action"] is True and res.info["format_error"] is False, wrong
        assert res.reward == 0.0 and not res.terminated and why in res.observation, (wrong, res.observation)
    assert env.observe().split("URL:")[0] == page  # none of it touched the page
    for text in ["日本語 😀", "nul\x00 tab\t", "\udcff\ud800"]:  # typed, never an exception
        env.reset(ENTER_TEXT)
        res = act(env, f"type [{element(env, 'textbox')}] [{text}] [0]")
        assert not res.info["invalid_action"] and not res.info["format_error"] and not res.terminated
    res = act(env, "press [Tab]")  # a key press, accepted
    assert not res.info["invalid_action"] and not res.terminated
    res = act(env, "scroll [down]")
    assert not res.info["invalid_action"] and not res.terminated


@needs_chromium
def test_expert_solves_the_families_and_random_valid_actions_do_not():
    tasks = list(range(2 * N))  # two instances of each family
    env, expert = make_env("miniwob"), make_expert("miniwob")
    wins, turns = 0, 0
    try:
        for task in tasks:
            obs, info = env.reset(task)
            expert.reset(env, obs, info)
            for _ in range(8):
                action = expert.act(obs)
                assert action is not None, (task, obs)
                assert parse_reply("Action: " + action)[0] == action  # parses to itself
                res = env.step("Action: " + action)
                assert not res.info["format_error"] and not res.info["invalid_action"], (action, res.observation)
                obs, turns = res.observation, turns + 1
                if res.terminated:
                    wins += res.info["success"]
                    break
    finally:
        env.close()
    expert_rate = wins / len(tasks)
    print(f"expert: {wins}/{len(tasks)} in {turns} turns")
    assert expert_rate >= 0.95  # printed above; the bar admits at most one miss

    floor = random_valid_action_success("miniwob", tasks, horizon=5, seed=0)
    print(f"random valid actions: {floor['successes']}/{floor['episodes']}")
    assert 0.3 <= floor["success_rate"] <= 0.75  # printed above: a band around what it solves
    assert floor["success_rate"] < expert_rate - 0.25


@needs_chromium
def test_expert_repairs_a_wrong_text_and_checkbox(env):
    expert = make_expert("miniwob")
    obs, info = env.reset(ENTER_TEXT)
    expert.reset(env, obs, info)
    res = act(env, [a for a in env.valid_actions() if a.startswith("type")][0].replace("] [", "] [zz") + " [0]")
    assert "value: 'zz" in res.observation
    for _ in range(30):
        res = env.step("Action: " + expert.act(res.observation))
        if res.terminated:
            break
    assert res.info["success"] is True
    checkboxes = FAMILIES.index("click-checkboxes")
    for task in (checkboxes, checkboxes + N):
        obs, info = env.reset(task)
        expert.reset(env, obs, info)
        wanted = {v for k, v in env.fields if k.startswith("target")}
        unwanted = [n.node_id for n in env.shown if n.role == "checkbox" and n.name not in wanted]
        assert unwanted, "choose an instance with a box to leave unchecked"
        obs = act(env, f"click [{unwanted[0]}]").observation  # checked by mistake: the expert unchecks it
        for _ in range(12):
            res = env.step("Action: " + expert.act(obs))
            obs = res.observation
            if res.terminated:
                break
        assert res.info["success"] is True


@needs_chromium
def test_close_quits_the_browser_and_leaves_no_process():
    psutil = pytest.importorskip("psutil")
    env = make_env("miniwob")
    env.close()  # never started: nothing to do
    env = make_env("miniwob")
    env.reset(0)
    env.reset(ENTER_TEXT)
    procs = [psutil.Process(p) for p in env.browser_pids()]
    assert len(procs) >= 2  # chromedriver and Chromium
    profile = env._browser.profile
    assert os.path.isdir(profile)
    env.close()
    env.close()  # idempotent
    left = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                left.append((p.pid, p.name()))
        except psutil.NoSuchProcess:
            pass
    assert not left, f"processes left running after close(): {left}"
    assert not os.path.exists(profile)
    with pytest.raises(RuntimeError):
        env.reset(0)


@needs_chromium
def test_a_dead_browser_is_an_infra_error():
    psutil = pytest.importorskip("psutil")
    env = make_env("miniwob")
    try:
        env.reset(0)
        for pid in env.browser_pids():  # the browser dies under the episode
            try:
                psutil.Process(pid).kill()
            except psutil.NoSuchProcess:
                pass
        with pytest.raises(InfraError):
            act(env, "click [4]")
    finally:
        env.close()
