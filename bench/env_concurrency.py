"""Environment concurrency: N episodes on an environment with L ms per step, together vs one by one.

    nice -n 19 .venv/bin/python bench/env_concurrency.py                     # N = 1..64, L = 50 ms, ~2 min
    nice -n 19 .venv/bin/python bench/env_concurrency.py --latency-ms 20 --sizes 1 8 64 --modes inproc

Issue #10 item 2, target: speed-up >= 0.8 * N. The real multi-turn loop
(``agentgym.rollout.loop.run_episodes``) plays N episodes of ``--horizon`` turns against ``SleepEnv``
(bench/benchlib.py: every step sleeps L ms, as an environment waiting on a simulator does), with
a scripted engine that answers at once (no model: the numbers are the loop's and the
environment's). Speed-up = (N single-episode rollouts run one after another) / (one rollout of
the N episodes). Modes:

* ``inproc`` -- the adapter in this process (the rollout's thread pool steps N envs at once);
* ``http``   -- the same adapter behind the project's HTTP env server
  (``env_adapters.http_server.serve`` in a child process, loopback), reached through
  ``HTTPEnv`` (``make_env("http", ...)``), as remote AgentGym environments are.

CPU: each run also records the CPU time this process (the rollout, the HTTP client) and the
env server process spent per episode (``runs[].cpu_ms_per_episode`` in the JSON, and on stderr):
with C ms of CPU per episode on c cores, N episodes cannot take less than N * C / c, which bounds
the speed-up at (one episode alone) / (C / c) however many episodes run at once.

``rollout.env_workers`` (the thread pool's size) is set to N here (``--env-workers`` to fix
it); where the largest N exceeds the config's default (64), an extra row shows that N with the
default, which caps the speed-up at the default.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time

import psutil

import benchlib
import results_io
from benchlib import Row


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--latency-ms", type=float, default=50.0)
    ap.add_argument("--horizon", type=int, default=4)
    ap.add_argument("--modes", nargs="+", default=["inproc", "http"], choices=["inproc", "http"])
    ap.add_argument("--env-workers", type=int, default=0, help="thread pool size (0: N)")
    ap.add_argument("--quick", action="store_true", help="N = 1, 4; inproc; horizon 2 (smoke)")
    ap.add_argument("--serve", nargs=2, metavar=("PORT", "LATENCY_MS"), help=argparse.SUPPRESS)
    results_io.add_tag_argument(ap)
    args = ap.parse_args()
    if args.quick:
        args.sizes, args.modes, args.horizon = [1, 4], ["inproc"], 2
    return args


def serve(port: int, latency_ms: float) -> None:
    """The child process: the HTTP env server over ``SleepEnv``."""
    benchlib.register_sleep_env()
    from env_adapters.http_server import serve as run_server

    run_server("sleep", port=port, max_envs=256, env_kwargs={"latency_ms": latency_ms}, log_level="warning")


class Engine(benchlib.load_tests_module("scripted_engine").NoCacheEngine):
    """Replies ``Action: wait`` + end of turn at once."""

    def __init__(self, tokenizer):
        self.reply = tokenizer("Action: wait", add_special_tokens=False)["input_ids"] + [
            tokenizer.convert_tokens_to_ids("<|im_end|>")]

    def generate(self, prompts, params, cache_keys=None):
        from agentgym.rollout.engines.base import Sample

        return [Sample(list(self.reply), [-0.1] * len(self.reply), "stop") for _ in prompts]


def _cpu_s(proc: "psutil.Process") -> float:
    """User + system CPU seconds of ``proc``, all its threads."""
    t = proc.cpu_times()
    return t.user + t.system


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_up(url: str, timeout: float = 60.0) -> None:
    import httpx

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise RuntimeError(f"the env server at {url} did not come up in {timeout:.0f} s")


def main() -> int:
    args = _parse()
    if args.serve:
        serve(int(args.serve[0]), float(args.serve[1]))
        return 0
    run = benchlib.start("env_concurrency", args)
    benchlib.register_sleep_env()
    from transformers import AutoTokenizer

    from agentgym.chat import ChatFormatter
    from agentgym.config import RolloutConfig
    from agentgym.models.folders import tiny_model_path
    from agentgym.rollout.loop import EpisodeSpec, RolloutSettings, run_episodes
    from env_adapters import make_env

    tok = AutoTokenizer.from_pretrained(tiny_model_path())
    fmt, engine = ChatFormatter(tok), Engine(tok)
    rows: list[Row] = []
    runs = []
    for mode in args.modes:
        server = None
        if mode == "http":
            port = _free_port()
            server = subprocess.Popen([sys.executable, __file__, "--serve", str(port), str(args.latency_ms)])
            url = f"http://127.0.0.1:{port}"
            _wait_up(url)
            env, kwargs = "http", {"base_url": url, "env_name": "sleep"}
        else:
            env, kwargs = "sleep", {"latency_ms": args.latency_ms}
        procs = {"client": psutil.Process()}
        if server is not None:
            procs["server"] = psutil.Process(server.pid)
        cpu: dict[str, float] = {}  # CPU ms per episode of the last rollout, by process
        try:
            def rollout(n: int, workers: int) -> float:
                specs = [EpisodeSpec(env, i, 0, f"g{i}", f"e{i}", dict(kwargs)) for i in range(n)]
                settings = RolloutSettings(horizon=args.horizon, max_new_tokens=8, env_workers=workers)
                c0 = {k: _cpu_s(p) for k, p in procs.items()}
                t0 = time.perf_counter()
                eps = run_episodes(engine, fmt, specs, settings, make_env)
                dt = time.perf_counter() - t0
                cpu.update({k: round(1e3 * (_cpu_s(p) - c0[k]) / n, 2) for k, p in procs.items()})
                assert all(e.num_turns == args.horizon and not e.infra_error for e in eps), \
                    [e.error for e in eps if e.infra_error][:3]
                return dt

            rollout(2, 2)  # warm-up: imports, thread pool, HTTP connections
            for n in args.sizes:
                together = rollout(n, args.env_workers or n)
                cpu_together = dict(cpu)
                each = [rollout(1, 1) for _ in range(n)]
                alone = sum(each)
                runs.append({"mode": mode, "n": n, "workers": args.env_workers or n, "together_s": together,
                             "one_by_one_s": alone, "each_alone_s": each, "cpu_ms_per_episode": cpu_together})
                rows.append(Row(f"{mode} N={n} speed-up", alone / together, n, target=(">=", 0.8),
                                unit="x vs ideal N"))
                print(f"[{mode} N={n}] together {together:.2f}s, one by one {alone:.2f}s; CPU per episode "
                      f"together: {cpu_together} ms", file=sys.stderr, flush=True)
            n = max(args.sizes)
            default_workers = RolloutConfig().env_workers
            if n > default_workers:
                together = rollout(n, default_workers)
                alone = next(r["one_by_one_s"] for r in runs if r["mode"] == mode and r["n"] == n)
                runs.append({"mode": mode, "n": n, "workers": default_workers, "together_s": together,
                             "one_by_one_s": alone, "cpu_ms_per_episode": dict(cpu)})
                rows.append(Row(f"{mode} N={n}, env_workers={default_workers} (config default)", alone / together, n,
                                target=(">=", 0.8), unit="x vs ideal N"))
        finally:
            if server is not None:
                server.terminate()
                server.wait(timeout=30)
    benchlib.print_table(rows, f"env_concurrency: L = {args.latency_ms:g} ms per step, horizon {args.horizon}, "
                               "scripted engine")
    benchlib.write_results(run, rows, runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
