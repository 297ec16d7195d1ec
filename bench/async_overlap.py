"""Synchronous vs asynchronous RL (``rollout.async_steps``): wall time per iteration and idle time.

    nice -n 19 .venv/bin/python bench/async_overlap.py                       # ~15 min idle
    nice -n 19 .venv/bin/python bench/async_overlap.py --latencies 0 --iterations 3   # smoke
    nice -n 19 .venv/bin/python bench/async_overlap.py --engine vllm_server --latencies 0   # (b): needs .venv-vllm

The real training flow (``scaling_inter_rl`` on a temporary Prefect server, MLflow in a temp
folder) with the quickstart's settings (SmolLM2-135M-Instruct, BabyAI GoTo, GRPO, 4 tasks x 8
episodes, constrained actions), one stage of ``--iterations`` at ``--horizon``, run once
synchronously and once with each ``--async-steps`` k (default 1 and 2), for each environment latency in
``--latencies``: every environment step first sleeps that many ms (``LatencyBabyAI``), which is
what an environment server on another host costs the rollout (the rollout's threads wait, no
CPU is spent). Both runs of a pair use the same seed, so they play the same first iteration.

Reported per run, over the whole stage (its first iteration is synchronous in both modes, and the
trainer is built during it): wall seconds per iteration (from the stage's MLflow run start to its
last iteration's metrics, over the iterations), the
generator's idle share (1 - ``rollout_seconds`` / wall) and the trainer's (1 - advantages and
update seconds / wall). The ratio column is sync wall / async wall (> 1: async is faster),
measured on the same machine in the same invocation. On 2 CPU cores the rollout and the update compete for the same cores, so
overlap pays only where the rollout waits (environment latency); a GPU trainer beside remote
generators is the case it is built for.

``--engine vllm_server`` (issue 24 (b)): the rollouts go to a ``vllm serve`` of SmolLM2 on loopback,
started by ``vllm_server_launch`` in ``.venv-vllm`` (``bash scripts/setup_vllm_env.sh``) with its
start outside the timed runs, weights synced as LoRA adapters (``trainer.lora`` r 8 instead of the
top 8 layers). vLLM has no action-constrained decoding here, so the replies are free text
(``rollout.constrain_actions: false``, 24 new tokens); SmolLM2 from its base weights rarely names
a valid action, so nearly every GRPO group ties, and ``algorithm.skip_tied_groups: false`` with
``rollout.max_draws: 1`` makes every iteration run its update all the same (what is timed is the
overlap, not the learning). The server shares the same 2 cores.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import benchlib
import results_io
from benchlib import Row

from env_adapters.babyai import BabyAIEnv

ROOT = Path(__file__).resolve().parents[1]


class LatencyBabyAI(BabyAIEnv):
    """BabyAI whose every step first waits ``latency_ms`` (a remote environment's round trip)."""

    def __init__(self, latency_ms: float = 0.0, **kwargs):
        super().__init__(**kwargs)
        self.latency_s = float(latency_ms) / 1000.0

    def step(self, action_text: str):
        time.sleep(self.latency_s)
        return super().step(action_text)


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--latencies", type=float, nargs="+", default=[0.0, 300.0], help="ms per env step")
    ap.add_argument("--iterations", type=int, default=5)
    ap.add_argument("--horizon", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--async-steps", type=int, nargs="+", default=[1, 2],
                    help="the async settings k compared with synchronous (0)")
    ap.add_argument("--engine", choices=["hf", "vllm_server"], default="hf",
                    help="hf: in-process rollouts (constrained actions); vllm_server: a `vllm serve` "
                         "on loopback (free text, LoRA sync)")
    results_io.add_tag_argument(ap)
    return ap.parse_args()


def _engine_overrides(args: argparse.Namespace, server_url: str | None, tmp: Path) -> list[str]:
    if args.engine == "hf":
        return []
    return [
        "rollout.engine=vllm_server", f'rollout.servers=["{server_url}"]', f"rollout.adapter_dir={tmp / 'adapters'}",
        "rollout.constrain_actions=false", "rollout.max_new_tokens=24", "rollout.max_draws=1",
        "algorithm.skip_tied_groups=false", "trainer.train_layers=null", "trainer.lora={r: 8, alpha: 16}",
    ]


def _start_server(args: argparse.Namespace):
    """The loopback ``vllm serve`` for ``--engine vllm_server`` (None for hf)."""
    if args.engine == "hf":
        return None
    from agentgym.models.folders import resolve_model
    from agentgym.rollout.engines.vllm_server_launch import start_vllm_server

    # a token budget that prefills all 32 episodes' prompts in one step, as in bench/README.md's row
    log = Path(tempfile.mkdtemp(prefix="agentgym-overlap-logs-")) / "vllm-serve.log"
    server = start_vllm_server(resolve_model("smollm2"), log, lora_rank=8,
                               max_model_len=2048, kv_cache_gb=1.0,
                               extra_args=["--max-num-batched-tokens", "65536"])
    print(f"vllm serve up at {server.url} in {server.start_seconds:.0f} s (log {server.log_path})",
          file=sys.stderr, flush=True)
    return server


def _run(tmp: Path, latency_ms: float, async_steps: int, args: argparse.Namespace,
         server_url: str | None = None) -> dict[str, Any]:
    from mlflow.tracking import MlflowClient

    from agentgym.config import load_config, with_overrides
    from flows.train import scaling_inter_rl

    run_id = f"overlap-{args.engine}-l{int(latency_ms)}-a{async_steps}"
    cfg = with_overrides(load_config(ROOT / "configs" / "quickstart.yaml"), [
        f"run_id={run_id}", f"seed={args.seed}", "heldout.enabled=false",
        'envs.0.name=async_overlap:LatencyBabyAI',
        f'envs.0.kwargs={{"observation_style": "compact", "latency_ms": {latency_ms}}}',
        f'schedule.stages=[{{"horizon": {args.horizon}, "iterations": {args.iterations}}}]',
        f"rollout.async_steps={async_steps}",
        f"store.root={tmp / 'store'}", f"tracking.tracking_uri=sqlite:///{tmp / 'mlflow.db'}",
        f"tracking.experiment={run_id}",
        *_engine_overrides(args, server_url, tmp),
    ])
    result = scaling_inter_rl(cfg)
    client = MlflowClient(cfg.tracking.tracking_uri)
    stage = client.get_run(result["stages"][0]["mlflow_run_id"])
    hist = {k: sorted(client.get_metric_history(stage.info.run_id, k), key=lambda m: m.step)
            for k in ("reward_mean", "rollout_seconds", "update_seconds", "time/advantages_compute_s")}
    # the stage's loop: from its MLflow run's start to its last iteration's metrics
    wall = hist["reward_mean"][-1].timestamp / 1000.0 - stage.info.start_time / 1000.0

    def busy(key: str) -> float:
        return sum(m.value for m in hist[key]) / wall

    per_iteration = [{"step": m.step, "end_s": m.timestamp / 1000.0 - stage.info.start_time / 1000.0,
                      **{k: next((x.value for x in hist[k] if x.step == m.step), None) for k in hist}}
                     for m in hist["reward_mean"]]
    return {"wall_s": wall / len(hist["reward_mean"]), "generator_busy": busy("rollout_seconds"),
            "trainer_busy": busy("update_seconds") + busy("time/advantages_compute_s"),
            "iterations": per_iteration}


def main() -> None:
    args = _parse()
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # async_overlap:LatencyBabyAI for the config
    run = benchlib.start("async_overlap", args)
    rows, raw = [], {}
    server = _start_server(args)
    try:
        for latency in args.latencies:
            got = {}
            for a in (0, *args.async_steps):
                with tempfile.TemporaryDirectory(prefix="agentgym-overlap-") as tmp:
                    t0 = time.perf_counter()
                    got[a] = _run(Path(tmp), latency, a, args, server.url if server else None)
                    print(f"latency {latency:.0f} ms, async_steps {a}: "
                          f"{ {k: v for k, v in got[a].items() if k != 'iterations'} } "
                          f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
            raw[str(latency)] = got
    finally:
        if server is not None:
            server.stop()
    for latency in args.latencies:
        got = raw[str(latency)]
        sync = got[0]
        for a in args.async_steps:
            asy = got[a]
            rows += [
                Row(f"env {latency:.0f} ms/step, k={a}: wall per iteration (ours async, baseline sync)",
                    asy["wall_s"], sync["wall_s"], ratio=sync["wall_s"] / asy["wall_s"], unit="s"),
                Row(f"env {latency:.0f} ms/step, k={a}: generator idle share", 1 - asy["generator_busy"],
                    1 - sync["generator_busy"], ratio=float("nan")),
                Row(f"env {latency:.0f} ms/step, k={a}: trainer idle share", 1 - asy["trainer_busy"],
                    1 - sync["trainer_busy"], ratio=float("nan")),
            ]
    benchlib.print_table(rows, f"async_steps ({args.engine}): wall per iteration over the stage")
    repeats = [{"latency_ms": latency, "async_steps": a, **got} for latency in args.latencies
               for a, got in raw[str(latency)].items()]
    benchlib.write_results(run, rows, repeats)


if __name__ == "__main__":
    main()
