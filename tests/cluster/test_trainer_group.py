"""World size N > 1: two DeepSpeed ranks as Ray actors (``RayTrainerGroup``, gloo on CPU) on the
shared two-node loopback cluster (conftest.py), placed SPREAD: one rank per node.

Each test starts one group (two Ray worker processes importing torch/DeepSpeed/transformers and
building their engines) and, for the comparisons, one ``PolicyTrainer`` in this process.
"""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentgym.batch import EpisodeBatch
from agentgym.cluster.digest import weights_digest
from agentgym.cluster.trainer_group import RayTrainerGroup
from agentgym.config import RayConfig, parse_config
from agentgym.pipeline import IterationRef, PolicySession
from agentgym.store.trajectory_store import TrajectoryStore
from agentgym.training.batch import TrainBatch
from agentgym.training.policy_trainer import PolicyTrainer
from agentgym.training.protocol import GroupError, Trainer, create_trainer
from batches import synthetic_rows  # tests/ is on sys.path
from configs import keyword_env, parse_tiny_config, rank_group_configs

pytestmark = pytest.mark.timeout(300)

# Two ranks each train on half of every mini-batch; DeepSpeed averages their gradients. The
# micro-batch weights (share of the whole mini-batch, times the world size) make that average
# the full mini-batch gradient, so results match one process up to float summation order.
WEIGHT_ATOL = 1e-5  # 1% of one AdamW step at lr 1e-3
LOSS_RTOL = 1e-6


def _rows(vocab: int, n: int, seed: int) -> list[dict]:
    return synthetic_rows(vocab, n, seed, ids=True)


def _batch(vocab: int, n: int, seed: int) -> TrainBatch:
    return TrainBatch.from_rows(_rows(vocab, n, seed), pad_id=0)


def _spread(address: str) -> RayConfig:
    """The shared cluster, one rank per node."""
    return RayConfig(address=address, placement="SPREAD")


def _weight_loads(group: RayTrainerGroup) -> list[int]:
    """``policy_trainer.weight_loads()`` in each rank's process: the policy weights it read from
    disk (model folder, checkpoints), asked inside the actor (Ray's ``__ray_call__``)."""
    import ray

    def loads(_rank) -> int:
        from agentgym.training.policy_trainer import weight_loads

        return weight_loads()

    return ray.get([a.__ray_call__.remote(loads) for a in group._ranks])


def _gone(pids: dict[int, int], timeout: float = 30.0) -> list[int]:
    """The pids among ``pids`` still running after ``timeout`` seconds (zombies count as gone)."""
    procs = []
    for pid in pids.values():
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    return [p.pid for p in alive if p.status() != psutil.STATUS_ZOMBIE]


@pytest.mark.parametrize("stage", [2, 3])
def test_two_rank_actors_on_two_nodes_train_like_one_process(tmp_path, tiny_path, stage, ray_address):
    tok = AutoTokenizer.from_pretrained(tiny_path)
    # 7 rows: mini-batches of 4 and 3, so in the second one rank 1 has 1 row and rank 0 has 2
    # (uneven shares; ZeRO-3 needs both ranks to run the same number of passes).
    batch = _batch(512, n=7, seed=0)
    group = create_trainer(tiny_path, tok, *rank_group_configs(zero_stage=stage), seed=0,
                           ray_cfg=_spread(ray_address))
    pids = {}
    try:
        assert isinstance(group, RayTrainerGroup) and isinstance(group, Trainer) and group.pad_id == tok.pad_token_id
        pids = group.rank_pids
        assert len(set(pids.values())) == 2 and os.getpid() not in pids.values()
        assert len(set(group.rank_nodes.values())) == 2  # SPREAD: one rank on each node
        if stage == 2:  # the pipeline's path: every rank reads the batch from the trajectory store
            store = TrajectoryStore(str(tmp_path / "store"), "dist")
            store.write_train_batch(EpisodeBatch.from_rows(_rows(512, n=7, seed=0)), stage=0, iteration=0)
            got = group.train_from_store(store.spec(), 0, 0, seed=5)
        else:  # the batch through Ray's object store
            got = group.train_on_batch(batch, seed=5)
        digests = group.weight_digests()
        assert digests[0] == digests[1]  # both ranks hold the same weights, bit for bit
        weights = dict(group.named_weights())
        assert weights_digest(weights.items()) == digests[0]  # rank 0's weights reached the driver whole
        assert group.optimizer_steps == 2
        with pytest.raises(FileNotFoundError):  # checked before the ranks see it: the group stays up
            group.load_checkpoint(tmp_path / "nothing")
        assert group.weight_digests() == digests
        if stage == 3:  # an exception inside the ranks takes the group down, with its traceback
            with pytest.raises(GroupError, match=r"(?s)failed in probe: a rank raised.*no_such_method"):
                group._all("probe", "no_such_method")
            with pytest.raises(GroupError, match="restart"):  # still down on the next call
                group.weight_digests()
            assert _gone(pids) == []  # a failure takes the other rank down too
    finally:
        group.close()
    assert _gone(pids) == []  # after close() no rank process is left
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


def test_a_rank_group_in_the_pipeline_loads_weights_once(tmp_path, model_cache, ray_address, monkeypatch):
    """PolicySession with trainer.world_size=2: three iterations, one weight load per rank, and
    every update read from the trajectory store (``train_from_store``; the driver never sends a
    batch through Ray)."""

    def no_batches(*a, **k):
        raise AssertionError("the pipeline sent a batch through Ray instead of the store")

    monkeypatch.setattr(RayTrainerGroup, "train_on_batch", no_batches)
    cfg = parse_tiny_config(
        model_cache, store_root=tmp_path / "store",
        envs=[keyword_env(tasks=list(range(8)))],
        rollout={"group_size": 4, "max_new_tokens": 8},
        algorithm={"estimator": "grpo", "ppo_epochs": 1, "mini_batches": 2, "skip_tied_groups": False},
        trainer={"learning_rate": 5e-3, "bf16": True, "micro_batch_size": 2, "world_size": 2, "zero_stage": 2},
        ray={"address": ray_address, "placement": "SPREAD"},
        schedule={"stages": [{"horizon": 1, "iterations": 3}]})
    session = PolicySession(cfg, "group-pipeline")
    try:
        import ray

        assert session.pool is not None
        before = ray.get([w.digest.remote() for w in session.pool._workers])
        pids = None
        for step in range(3):
            ref = IterationRef(0, step, step)
            session.collect(ref, horizon=1)
            session.advantages(ref)
            out = session.update(ref)
            assert out["updated"] and out["optimizer_steps"] == 2
            group = session.trainer
            assert isinstance(group, RayTrainerGroup)
            pids = pids or group.rank_pids
            assert group.rank_pids == pids
        assert _weight_loads(group) == [1, 1]  # each rank read the model folder once, for 3 updates
        assert group.restarts == 0
        assert len(set(group.rank_nodes.values())) == 2
        assert all(psutil.pid_exists(p) for p in pids.values())  # the same two processes throughout
        assert [(m.iteration, m.rows) for m in session.store.commits("train_batch")] == [(i, 8) for i in range(3)]
        assert group.optimizer_steps == 6
        trained = group.weight_digests()
        held = ray.get([w.digest.remote() for w in session.pool._workers])
        assert held == [trained[0]] and held != before  # the rollout worker got the new weights
        exported = AutoModelForCausalLM.from_pretrained(session.export(tmp_path / "hf"), dtype=torch.float32)
        assert weights_digest(exported.named_parameters()) == trained[0]  # and the export holds them
    finally:
        session.close()


def test_a_killed_rank_is_a_clear_error_and_restart_resumes_from_the_checkpoint(tmp_path, tiny_path, ray_address):
    tok = AutoTokenizer.from_pretrained(tiny_path)
    group = RayTrainerGroup(tiny_path, tok, *rank_group_configs(), seed=0, ray_cfg=_spread(ray_address))
    pids = group.rank_pids
    try:
        group.train_on_batch(_batch(512, 8, seed=0), seed=0)
        group.save_checkpoint(tmp_path / "ckpt", {"global_step": 1})
        saved = group.weight_digests()
        group.train_on_batch(_batch(512, 8, seed=1), seed=1)
        want = dict(group.named_weights())
        os.kill(pids[1], signal.SIGKILL)
        time.sleep(0.5)
        with pytest.raises(GroupError) as err:
            group.train_on_batch(_batch(512, 8, seed=1), seed=1)
        msg = str(err.value)
        print(msg)
        assert "failed in train_on_batch: rank 1 died" in msg and "restart()" in msg
        with pytest.raises(GroupError, match="restart"):  # still down on the next call
            group.named_weights()
        assert _gone(pids) == []  # the group took the other rank down too
        # The next attempt: place a new group, reload the last checkpoint, redo the lost update.
        assert group.restart() == {"global_step": 1}
        assert set(group.rank_pids.values()).isdisjoint(pids.values())  # new rank processes
        assert group.optimizer_steps == 2 and group.restarts == 1
        assert _weight_loads(group) == [2, 2]  # each new rank: the model folder, then the checkpoint
        assert group.weight_digests() == saved  # the checkpoint's weights, on both ranks
        group.train_on_batch(_batch(512, 8, seed=1), seed=1)
        got = dict(group.named_weights())
        assert all(torch.equal(want[k], got[k]) for k in want)  # bit-exact resume
    finally:
        pids = group.rank_pids
        group.close()
    assert _gone(pids) == []


def test_sft_on_two_ranks_matches_one_process(tmp_path, tiny_path, model_cache, ray_address):
    """The SFT stage's trainer calls (``train_epoch``, ``sft_metrics``, ``advance_lr_schedule``
    after a weights-only resume) through a group of 2 rank actors give what one process gives:
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
            # the run's ray section reaches the SFT group: SPREAD puts one rank on each node
            "ray": {"address": ray_address, "placement": "SPREAD"} if world == 2 else {},
        })
        total = S.steps_per_epoch(len(episodes), cfg.sft.batch_size) * cfg.sft.epochs
        trainer = S.build_trainer(cfg, tiny_path, tok, total)
        try:
            assert isinstance(trainer, RayTrainerGroup if world == 2 else PolicyTrainer)
            if isinstance(trainer, RayTrainerGroup):
                assert len(set(trainer.rank_nodes.values())) == 2
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
