"""PPO with a learned critic (estimator gae) through the real Prefect flow: the critic's metrics
reach MLflow and the checkpoint carries the critic beside a loadable policy; a resumed session
starts from that critic."""

from pathlib import Path

import torch
from mlflow.tracking import MlflowClient
from transformers import AutoModelForCausalLM

from configs import parse_tiny_config  # tests/ is on sys.path

CRITIC_METRICS = ("vf_loss", "vf_clipfrac", "explained_variance", "value_mean", "return_mean",
                  "critic_grad_norm", "old_logprob_abs_diff", "policy_loss", "entropy", "clipfrac_low",
                  "clipfrac_high", "approx_kl", "grad_norm", "adv_mean", "adv_std", "vpred_mean", "ratio_mean",
                  "loss", "lr")


def test_gae_flow_logs_critic_metrics_and_checkpoints_the_critic(tmp_path, model_cache):
    from flows.train import scaling_inter_rl

    cfg = parse_tiny_config(
        model_cache, store_root=tmp_path / "store", tracking_dir=tmp_path, run_id="flow-gae", seed=1,
        algorithm={"estimator": "gae", "lam": 0.95, "critic": {"model": "separate", "learning_rate": 1e-3},
                   "recompute_old_logprobs": True},
        schedule={"stages": [{"horizon": 1, "iterations": 2}]}, tracking={"experiment": "flow-gae"})
    result = scaling_inter_rl(cfg)
    client = MlflowClient(cfg.tracking.tracking_uri)
    for key in CRITIC_METRICS:
        history = client.get_metric_history(result["mlflow_run_id"], key)
        assert [m.step for m in history] == [0, 1], key
    local = Path(result["stages"][-1]["checkpoint"].replace("file://", ""))
    AutoModelForCausalLM.from_pretrained(local)  # the policy folder stays loadable
    assert {"critic.json", "value_head.safetensors", "model.safetensors"} <= {f.name for f in (local / "critic").iterdir()}
    from agentgym.training.value_head import read_critic_folder

    assert read_critic_folder(local, "separate") == local / "critic"
    head = __import__("safetensors.torch", fromlist=["x"]).load_file(str(local / "critic" / "value_head.safetensors"))
    assert head["weight"].abs().sum() > 0 and torch.isfinite(head["weight"]).all()  # a trained head
