"""World size N > 1: the resident DeepSpeed group (2 CPU ranks on loopback, gloo).

Each test starts one group (~15-25 s on the 2-core machine: two python processes importing
torch/DeepSpeed/transformers and building their engines).
"""

from __future__ import annotations

import os
import signal
import tempfile
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentgym.config import AlgorithmConfig, TrainerConfig, parse_config
from agentgym.pipeline import IterationRef, PolicySession
from agentgym.store.trajectory_store import TrajectoryStore
from agentgym.training.batch import TrainBatch
from agentgym.training.group.driver import GroupError, ResidentGroup
from agentgym.training.group.launcher import exit_codes, hostfile_slots, launcher_cmd, root_cause
from agentgym.training.policy_trainer import PolicyTrainer
from agentgym.training.protocol import Trainer, create_trainer
from agentgym.batch import EpisodeBatch
from batches import synthetic_rows  # tests/ is on sys.path
from configs import keyword_env, parse_tiny_config, rank_group_configs

pytestmark = pytest.mark.timeout(300)

# Two ranks each train on half of every mini-batch; DeepSpeed averages their gradients. The
# micro-batch weights (share of the whole mini-batch, times the world size) make that average
# the full mini-batch gradient, so results match one process up to float summation order.
WEIGHT_ATOL = 1e-5  # 1% of one AdamW step at lr 1e-3 (measured: 0 to 3e-7)
LOSS_RTOL = 1e-6


def _rows(vocab: int, n: int, seed: int) -> list[dict]:
    return synthetic_rows(vocab, n, seed, ids=True)


def _batch(vocab: int, n: int, seed: int) -> TrainBatch:
    return TrainBatch.from_rows(_rows(vocab, n, seed), pad_id=0)


@pytest.mark.parametrize("stage", [2, 3])
def test_two_ranks_train_like_one_process(tmp_path, tiny_path, stage, monkeypatch):
    # an isolated temp folder (this process's and the ranks'): the group must leave nothing in it
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    monkeypatch.setenv("TMPDIR", str(tmp))
    tok = AutoTokenizer.from_pretrained(tiny_path)
    # 7 rows: mini-batches of 4 and 3, so in the second one rank 1 has 1 row and rank 0 has 2
    # (uneven shares; ZeRO-3 needs both ranks to run the same number of passes).
    batch = _batch(512, n=7, seed=0)
    group = create_trainer(tiny_path, tok, *rank_group_configs(zero_stage=stage), seed=0)
    try:
        assert isinstance(group, ResidentGroup) and isinstance(group, Trainer) and group.pad_id == tok.pad_token_id
        assert group.run_dir.parent == tmp and group.run_dir.name.startswith("agentgym-group-")
        if stage == 2:  # the pipeline's path: every rank reads the batch from the trajectory store
            store = TrajectoryStore(str(tmp_path / "store"), "dist")
            store.write_train_batch(EpisodeBatch.from_rows(_rows(512, n=7, seed=0)), stage=0, iteration=0)
            got = group.train_from_store(store.spec(), 0, 0, seed=5)
            assert group.batch_bytes_sent == 0
        else:  # the batch over the driver's connections
            got = group.train_on_batch(batch, seed=5)
            assert group.batch_bytes_sent > 0
        digests = group.weight_digests()
        assert digests[0] == digests[1]  # both ranks hold the same weights, bit for bit
        weights = dict(group.named_weights())
        assert group.optimizer_steps == 2
        with pytest.raises(FileNotFoundError):  # checked before the ranks see it: group stays up
            group.load_checkpoint(tmp_path / "nothing")
        if stage == 3:  # an exception inside the ranks takes the group down, with its traceback
            with pytest.raises(GroupError, match=r"(?s)rank \d of 2 failed.*raised an exception.*unknown command"
                                                 r".*removed when the group is closed"):
                group._command("no-such-command")
            assert (group.log_dir / "launcher.log").exists()  # kept until close(): restart() uses it
            with pytest.raises(GroupError, match="restart"):
                group.ping()
        assert any((group.log_dir / "torchrun").iterdir())  # torchrun's log folder is in ours
    finally:
        group.close()
    # after a run (and after a failure, stage 3) nothing is left: no agentgym-group-* folder
    # (logs, DeepSpeed env file) and no torchelastic_* folder of torchrun's
    assert sorted(p.name for p in tmp.iterdir()) == []
    single = PolicyTrainer(tiny_path, tok, *rank_group_configs(zero_stage=stage, world_size=1), seed=0)
    want = single.train_on_batch(batch, seed=5)
    want_w = {k: v.detach().clone() for k, v in single.named_weights()}
    assert set(weights) == set(want_w)
    worst = max(float((weights[k] - want_w[k]).abs().max()) for k in want_w)
    print(f"zero-{stage}: loss 2 ranks {got['loss']:.9f} vs 1 process {want['loss']:.9f}; "
          f"max weight diff {worst:.2e}")
    assert got["loss"] == pytest.approx(want["loss"], rel=LOSS_RTOL)
    assert worst <= WEIGHT_ATOL
    assert got["optimizer_steps"] == want["optimizer_steps"] == 2


def test_resident_group_in_the_pipeline_loads_weights_once(tmp_path, model_cache):
    """PolicySession with trainer.world_size=2: three iterations, one weight load per rank."""
    cfg = parse_tiny_config(
        model_cache, store_root=tmp_path / "store",
        envs=[keyword_env(tasks=list(range(8)))],
        rollout={"group_size": 4, "max_new_tokens": 8},
        algorithm={"estimator": "grpo", "ppo_epochs": 1, "mini_batches": 2, "skip_tied_groups": False},
        trainer={"learning_rate": 5e-3, "bf16": True, "micro_batch_size": 2, "world_size": 2, "zero_stage": 2},
        schedule={"stages": [{"horizon": 1, "iterations": 3}]})
    session = PolicySession(cfg, "group-pipeline")
    try:
        before = {k: v.clone() for k, v in session.engine.model.state_dict().items()}
        for step in range(3):
            ref = IterationRef(0, step, step)
            session.collect(ref, horizon=1)
            session.advantages(ref)
            out = session.update(ref)
            assert out["updated"] and out["optimizer_steps"] == 2
        group = session.trainer
        assert isinstance(group, ResidentGroup)
        assert group.weight_loads == 1  # each rank read the model folder once, for 3 updates
        # the ranks read each update's batch from the trajectory store, none came over the socket
        assert group.batch_bytes_sent == 0
        assert [(m.iteration, m.rows) for m in session.store.commits("train_batch")] == [(i, 8) for i in range(3)]
        assert group.optimizer_steps == 6
        after = session.engine.model.state_dict()
        assert any(not torch.equal(before[k], after[k]) for k in before)  # the engine got new weights
        exported = AutoModelForCausalLM.from_pretrained(session.export(tmp_path / "hf"), dtype=torch.float32)
        synced = dict(session.engine.model.named_parameters())
        for k, p in exported.named_parameters():
            assert torch.equal(p.to(synced[k].dtype), synced[k]), k
    finally:
        if session._trainer is not None:
            session._trainer.close()


def test_dead_rank_is_a_clear_error_and_restart_resumes_from_the_checkpoint(tmp_path, tiny_path):
    tok = AutoTokenizer.from_pretrained(tiny_path)
    group = ResidentGroup(tiny_path, tok, *rank_group_configs(), seed=0, run_dir=tmp_path / "run")
    try:
        group.train_on_batch(_batch(512, 8, seed=0), seed=0)
        group.save_checkpoint(tmp_path / "ckpt", {"global_step": 1})
        group.train_on_batch(_batch(512, 8, seed=1), seed=1)
        want = dict(group.named_weights())
        pids = group.rank_pids
        os.kill(pids[1], signal.SIGKILL)
        time.sleep(0.5)
        with pytest.raises(GroupError) as err:
            group.train_on_batch(_batch(512, 8, seed=1), seed=1)
        msg = str(err.value)
        print(msg)
        assert "rank 1 of 2" in msg and "exit code -9 (SIGKILL)" in msg and "restart()" in msg
        assert "rank1.log" in msg  # the rank's log tail is included
        with pytest.raises(GroupError, match="restart"):  # still down on the next call
            group.named_weights()
        for pid in pids.values():  # the launcher took the other rank down too
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
        # The next attempt: relaunch from the last checkpoint and redo the lost update.
        assert group.restart() == {"global_step": 1}
        assert group.optimizer_steps == 2 and group.weight_loads == 2  # model folder + checkpoint
        group.train_on_batch(_batch(512, 8, seed=1), seed=1)
        got = dict(group.named_weights())
        assert all(torch.equal(want[k], got[k]) for k in want)  # bit-exact resume
    finally:
        pids = group.rank_pids
        group.close()
    for pid in pids.values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_launch_helpers(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# hosts\nnode-a slots=2\nnode-b slots=2  # second\n")
    assert hostfile_slots(str(hostfile)) == 4
    report = ("[1]:\n  rank      : 0 (local_rank: 0)\n  exitcode  : -15 (pid: 11)\n"
              "Root Cause (first observed failure):\n[0]:\n  host      : h\n"
              "  rank      : 1 (local_rank: 1)\n  exitcode  : -9 (pid: 12)\n")
    assert exit_codes(report) == {0: -15, 1: -9} and root_cause(report) == 1
    with pytest.raises(ValueError, match="slots"):
        ResidentGroup("unused", type("T", (), {"pad_token_id": 0})(),
                      TrainerConfig(world_size=2, hostfile=str(hostfile)), AlgorithmConfig())
    cfg = TrainerConfig(world_size=4, hostfile=str(hostfile), master_addr="10.0.0.1")
    cmd = launcher_cmd(cfg, 4, ("10.0.0.1", 5000), 5001, Path(tmp_path))
    assert "--hostfile" in cmd and "--no_local_rank" in cmd and "--module" in cmd
    assert cmd[cmd.index("--module") + 1] == "agentgym.training.group.worker" and "10.0.0.1:5000" in cmd
    assert not any("key" in c.lower() or "token" in c.lower() for c in cmd)  # the authkey goes by env


def test_sft_on_two_ranks_matches_one_process(tmp_path, tiny_path, model_cache):
    """The SFT stage's trainer calls (``train_epoch``, ``sft_metrics``, ``advance_lr_schedule``
    after a weights-only resume) through a resident group of 2 ranks give what one process gives:
    the held-out measure and the learning rate exactly, the trained weights within round-off."""
    from agentgym.training import sft as S

    from agentgym.types import Episode

    tok = AutoTokenizer.from_pretrained(tiny_path)
    rows = _rows(512, n=6, seed=3)

    episodes = [Episode(r["episode_id"], "g", "keyword", 0, 0, 4, input_ids=r["input_ids"], loss_mask=r["loss_mask"],
                        old_logprobs=[0.0] * len(r["input_ids"])) for r in rows]
    results = {}
    for world in (2, 1):
        cfg = parse_config({
            "model": {"name_or_path": str(tiny_path), "cache_dir": model_cache},
            "trainer": {"micro_batch_size": 2, "bf16": False, "world_size": world, "zero_stage": 2},
            "sft": {"enabled": True, "epochs": 2, "batch_size": 3, "learning_rate": 3e-3, "warmup_steps": 0},
        })
        total = S.steps_per_epoch(len(episodes), cfg.sft.batch_size) * cfg.sft.epochs
        trainer = S.build_trainer(cfg, tiny_path, tok, total)
        try:
            assert isinstance(trainer, ResidentGroup if world == 2 else PolicyTrainer)
            held = S.as_batch(episodes[:2], trainer.pad_id)
            before = trainer.sft_metrics(held)
            trainer.advance_lr_schedule(1)  # as a resume after one step from weights alone does
            logged = []
            S.train_epoch(trainer, episodes, cfg, 1, 1, lambda s, m: logged.append(m))
            results[world] = (before, trainer.sft_metrics(held), [m["lr"] for m in logged],
                              {k: v.detach().clone() for k, v in trainer.named_weights()})
        finally:
            trainer.close()
    (b2, a2, lr2, w2), (b1, a1, lr1, w1) = results[2], results[1]
    assert b2 == pytest.approx(b1, rel=1e-9) and lr2 == pytest.approx(lr1, rel=1e-12)
    assert lr1[0] < 3e-3  # the schedule was advanced before the first step: cosine, not its start
    assert a2["sft_loss"] == pytest.approx(a1["sft_loss"], rel=1e-4) and a1["sft_loss"] < b1["sft_loss"]
    assert max(float((w2[k] - w1[k]).abs().max()) for k in w1) <= WEIGHT_ATOL
