"""A checkpoint export when training rank 0 runs on another node than the flow's process: the
files come back through the object store, identical to an export written in place."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file
from transformers import AutoTokenizer

from agentgym.config import RayConfig
from agentgym.training.protocol import create_trainer
from configs import rank_group_configs

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("node", ["agentgym_node0", "agentgym_node1"])
def test_an_export_from_a_rank_on_another_node_lands_on_the_driver(tmp_path, tiny_path, ray_address, node):
    import ray

    tok = AutoTokenizer.from_pretrained(tiny_path)
    trainer_cfg, algo = rank_group_configs(world_size=1)
    group = create_trainer(tiny_path, tok, trainer_cfg, algo, seed=0,
                           ray_cfg=RayConfig(address=ray_address, rank_resources={node: 0.5}))
    try:
        driver_node = ray.get_runtime_context().get_node_id()
        assert (group.rank_nodes[0] == driver_node) == (node == "agentgym_node0")  # the head is node 0
        out = group.save_hf(tmp_path / "export")
        assert (out / "config.json").is_file() and (out / "tokenizer_config.json").is_file()
        got = load_file(out / "model.safetensors")
        want = load_file(f"{tiny_path}/model.safetensors")
        assert got.keys() == want.keys()
        assert all((got[k] == want[k]).all() for k in want)  # untrained: the base weights, exactly
    finally:
        group.close()
