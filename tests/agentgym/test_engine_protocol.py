"""Every inference engine implements everything the ``InferenceEngine`` protocol declares (the
rollout and the pipeline call these members directly, with no ``getattr`` fallbacks)."""

import ast
import inspect
import textwrap

import pytest

from agentgym.rollout.engines.base import InferenceEngine
from agentgym.rollout.engines.hf import HFEngine
from agentgym.rollout.engines.vllm import VLLMEngine
from agentgym.rollout.engines.vllm_server import VLLMServerEngine
from scripted_engine import NoCacheEngine  # tests/ is on sys.path

METHODS = sorted(n for n, v in vars(InferenceEngine).items() if inspect.isfunction(v) and not n.startswith("_"))
ATTRIBUTES = sorted(InferenceEngine.__annotations__)


def _assigned_in_init(cls: type) -> set[str]:
    """``self.<name>`` targets assigned in ``cls.__init__``."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls.__init__)))
    return {t.attr for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign))
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}


def test_protocol_declares_what_callers_use():
    assert {"generate", "choose", "release", "update_weights", "update_adapter", "close"} <= set(METHODS)
    assert {"generate_seconds", "syncs_adapters"} <= set(ATTRIBUTES)


@pytest.mark.parametrize("cls", [HFEngine, VLLMEngine, VLLMServerEngine])
def test_engine_implements_the_protocol(cls):
    missing = [m for m in METHODS if not callable(getattr(cls, m, None))]
    assert not missing, f"{cls.__name__} lacks {missing}"
    unset = [a for a in ATTRIBUTES if not hasattr(cls, a) and a not in _assigned_in_init(cls)]
    assert not unset, f"{cls.__name__} never sets {unset}"
    for m in METHODS:  # same parameter names as the protocol (callers pass keywords)
        want = list(inspect.signature(getattr(InferenceEngine, m)).parameters)
        assert list(inspect.signature(getattr(cls, m)).parameters) == want, (cls.__name__, m)


def test_unsupported_operations_name_the_setting():
    for cls, call in [(VLLMEngine, lambda e: e.choose([[1]], [[[2]]], None)),
                      (VLLMServerEngine, lambda e: e.choose([[1]], [[[2]]], None)),
                      (HFEngine, lambda e: e.update_adapter(lambda p: None)),
                      (VLLMEngine, lambda e: e.update_adapter(lambda p: None))]:
        engine = cls.__new__(cls)  # no model: these raise before touching one
        with pytest.raises(NotImplementedError, match="rollout.engine|update_weights"):
            call(engine)


def test_scripted_test_engines_carry_the_bookkeeping():
    assert NoCacheEngine.generate_seconds == 0.0 and NoCacheEngine.syncs_adapters is False
