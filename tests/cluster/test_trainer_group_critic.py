"""World size 2 with a critic (estimator gae): two rank actors, one on each node of the shared
loopback cluster (conftest.py), train the critic like one process.

One group (two Ray worker processes), as tests/cluster/test_trainer_group.py.
"""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from agentgym.cluster.trainer_group import RayTrainerGroup
from agentgym.config import AlgorithmConfig, RayConfig, TrainerConfig
from agentgym.training.batch import TrainBatch
from agentgym.training.policy_trainer import PolicyTrainer
from agentgym.training.protocol import create_trainer
from batches import synthetic_batch  # tests/ is on sys.path
from configs import rank_group_configs

pytestmark = pytest.mark.timeout(300)

WEIGHT_ATOL = 1e-5  # as test_trainer_group: 1% of one AdamW step at lr 1e-3


def _batch(n: int, seed: int) -> TrainBatch:
    return synthetic_batch(512, n, seed, returns=True)


def test_two_rank_actors_train_a_separate_critic_like_one_process(tmp_path, tiny_path, ray_address):
    tok = AutoTokenizer.from_pretrained(tiny_path)
    algo = AlgorithmConfig(estimator="gae", critic={"model": "separate", "learning_rate": 1e-3},
                           mini_batches=2, recompute_old_logprobs=True)

    def trainer_cfg(world: int) -> TrainerConfig:
        return rank_group_configs(world_size=world)[0]

    batch, probe = _batch(7, seed=0), _batch(3, seed=1)
    group = create_trainer(tiny_path, tok, trainer_cfg(2), algo, seed=0,
                           ray_cfg=RayConfig(address=ray_address, placement="SPREAD"))
    try:
        assert isinstance(group, RayTrainerGroup)
        assert len(set(group.rank_nodes.values())) == 2
        got = group.train_on_batch(batch, seed=5)
        got_values = group.compute(probe, ["values", "logprobs"])
        group.save_hf(tmp_path / "hf", tok)  # rank 0 writes it; this process reads it back
        assert (tmp_path / "hf" / "critic" / "model.safetensors").exists()
    finally:
        group.close()
    single = PolicyTrainer(tiny_path, tok, trainer_cfg(1), algo, seed=0)
    want = single.train_on_batch(batch, seed=5)
    want_values = single.compute(probe, ["values", "logprobs"])
    assert got["optimizer_steps"] == want["optimizer_steps"] == 2
    assert got["vf_loss"] == pytest.approx(want["vf_loss"], rel=1e-5)
    assert got["old_logprob_abs_diff"] == pytest.approx(want["old_logprob_abs_diff"], rel=1e-6)
    assert got_values["values"][probe.loss_mask.bool()].abs().min() > 0  # the critic trained
    for k in want_values:
        worst = float((got_values[k] - want_values[k]).abs().max())
        print(f"{k}: max diff 2 ranks vs 1 process {worst:.2e}")
        assert worst <= 1e-4, k
