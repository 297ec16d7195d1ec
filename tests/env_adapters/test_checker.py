"""The public conformance checker on one's own adapters: `agentgym env check NAME_OR_IMPORT_PATH`
passes a good adapter and names the violation of a broken one (given by import path)."""

from __future__ import annotations

import textwrap

import pytest
from typer.testing import CliRunner

from agentgym_cli.cli import app
from env_adapters.checker import check_adapter

OWN_ADAPTERS = textwrap.dedent('''
    from env_adapters.base import StepResult, TextEnv, format_error

    class Good(TextEnv):
        name = "good"

        def reset(self, task_id, seed=0):
            self.task = task_id
            return f"say {task_id}", {}

        def step(self, action_text):
            answer = action_text.split("Action:")[-1].strip() if "Action:" in action_text else ""
            if not answer.isascii() or not answer.isdigit():
                return format_error("Write 'Action: <number>'.")
            ok = answer == str(self.task)
            return StepResult("right" if ok else "wrong", float(ok), ok)

        def valid_actions(self):
            return [str(i) for i in range(4)]

        @classmethod
        def task_category(cls, task_id):
            return "even" if task_id % 2 == 0 else "odd"

    class RaisesOnGarbage(Good):
        name = "raises"

        def step(self, action_text):
            if not action_text:
                raise ValueError("empty reply")
            return super().step(action_text)

    class EncodesReply(Good):
        name = "encodes"

        def step(self, action_text):
            action_text.encode("utf-8")  # as a socket or a JVM bridge would: lone surrogates fail
            return super().step(action_text)

    class IntReward(Good):
        name = "intreward"

        def step(self, action_text):
            r = super().step(action_text)
            return StepResult(r.observation, int(r.reward), r.terminated, r.truncated, r.info)

    import threading

    class LeaksAThread(Good):
        name = "leaks"

        def reset(self, task_id, seed=0):
            # a worker per episode that close() never stops (Event never set)
            self._stop = threading.Event()
            threading.Thread(target=self._stop.wait, name=f"episode-worker-{task_id}",
                             daemon=True).start()
            return super().reset(task_id, seed)
''')


@pytest.fixture
def own_module(tmp_path, monkeypatch):
    (tmp_path / "my_envs.py").write_text(OWN_ADAPTERS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_envs"


def test_env_check_passes_a_good_adapter_by_import_path(own_module):
    out = CliRunner().invoke(app, ["env", "check", f"{own_module}:Good", "--task", "0", "--task", "3"])
    assert out.exit_code == 0, out.output
    assert "my_envs:Good: ok" in out.output and "tasks [0, 3]" in out.output


@pytest.mark.parametrize("cls, violation", [
    ("RaisesOnGarbage", "ValueError"),  # a malformed reply must be a format error, never raise
    ("EncodesReply", "UnicodeEncodeError"),  # invalid UTF-8 decoded with surrogateescape
    ("IntReward", "reward must be a float"),
    ("LeaksAThread", "episode-worker-0"),  # close() left a thread behind: named
])
def test_env_check_names_the_violation(own_module, cls, violation):
    out = CliRunner().invoke(app, ["env", "check", f"{own_module}:{cls}"])
    assert out.exit_code == 1, out.output
    assert "FAILED" in out.output and violation in out.output


def test_env_check_registered_adapter_and_unknown_name():
    out = CliRunner().invoke(app, ["env", "check", "keyword", "--kwargs", "{target: zzz}"])
    assert out.exit_code == 0 and "keyword: ok" in out.output, out.output
    out = CliRunner().invoke(app, ["env", "check", "nope"])
    assert out.exit_code == 2 and "unknown environment" in out.output


def test_check_adapter_in_process(own_module):
    report = check_adapter(f"{own_module}:Good", [1, 2], horizon=3)
    assert report["steps"] > 0 and report["resets"] == 4  # 2 tasks x 2 seeds
