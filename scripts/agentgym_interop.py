"""Interoperability with AgentGym (github.com/WooooDyy/AgentGym), both ways, from a checkout of it.

``clients``: AgentGym's own client classes (``BabyAIEnvClient``, ``TextCraftEnvClient``,
``SciworldEnvClient``, ``SearchQAEnvClient``; AgentGym-RL trains with them) against
``agentgym env serve ENV`` (the CLI, default dialect, a free loopback port): create, reset, step
to a reward, close, for ``--tasks`` tasks per environment.

``servers``: this project's ``HTTPEnv`` (dialects ``babyai``, ``textcraft``) against AgentGym's own
BabyAI and TextCraft servers, each installed from the checkout into its own venv
(``.cache/agentgym-servers/<env>``, ``pip install agentenv-<env>``) and started with its own
entry point.

Replies are the project's scripted expert's actions written as ReAct replies (Deep Search: the raw
``<search>``/``<answer>`` reply), the expert acting on an in-process twin of the remote instance:
the environments are deterministic, so the twin sees what the remote instance sees, and every
observation the client gets is compared with the twin's. AgentGym's TextCraft picks a task's goal
in ``os.listdir`` order (which differs between file systems; this project sorts), so there the
twin is reset to the remote's goal, read from its first observation.

AgentGym is not on PyPI (the ``agentenv`` name there is an empty placeholder), so nothing here
runs in CI; tests/env_adapters/test_http_dialects.py pins the schemas these clients read.
Usage (results: docs/serving.md):

    git clone https://github.com/WooooDyy/AgentGym /tmp/AgentGym
    .venv/bin/python scripts/agentgym_interop.py clients --agentgym /tmp/AgentGym [--tasks 10]
    .venv/bin/python scripts/agentgym_interop.py servers --agentgym /tmp/AgentGym [--tasks 10]

Their ``agentenv.controller`` imports ``openai``; when the venv lacks it, it is installed once into
``.cache/agentgym-client-deps`` (appended to ``sys.path``, so it cannot shadow the venv's packages).
"""

from __future__ import annotations

import argparse
import importlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: environment -> (AgentGym module, client class, the tasks: data_idx of AgentGym's servers)
CLIENTS = {
    "babyai": ("agentenv.envs.babyai", "BabyAIEnvClient"),
    "textcraft": ("agentenv.envs.textcraft", "TextCraftEnvClient"),
    "sciworld": ("agentenv.envs.sciworld", "SciworldEnvClient"),
    "deepsearch": ("agentenv.envs.searchqa", "SearchQAEnvClient"),
}
MAX_TURNS = 80


def tasks_of(env_name: str, n: int) -> list[int]:
    """``n`` tasks: BabyAI's GoTo levels (one room), TextCraft's first goals, the first variation of
    SciWorld's first task types, Deep Search's first training questions."""
    if env_name == "babyai":
        return [40 * seed + level for seed in range(n) for level in (0, 1, 2, 4, 8, 9, 10)][:n]
    if env_name == "sciworld":
        from env_adapters.sciworld import TASK_OFFSETS
        return list(TASK_OFFSETS[:n])
    return list(range(n))


def import_clients(agentgym: Path) -> None:
    sys.path.insert(0, str(agentgym / "agentenv"))
    try:
        import openai  # noqa: F401  (agentenv.controller imports it)
    except ImportError:
        deps = ROOT / ".cache" / "agentgym-client-deps"
        if not (deps / "openai").exists():
            subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", "--target", str(deps), "openai"])
        sys.path.append(str(deps))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(env_name: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cli = Path(sys.executable).parent / "agentgym"
    proc = subprocess.Popen([str(cli), "env", "serve", env_name, "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"agentgym env serve {env_name} did not come up on {url}")


def play(env_name: str, client_cls: type, url: str, task: int) -> dict:
    import env_adapters
    from env_adapters.experts import make_expert

    client = client_cls(env_server_base=url, data_len=10_000)  # POST /create
    twin = env_adapters.make_env(env_name)
    try:
        client.reset(task)  # POST /reset
        obs, info = twin.reset(task, 0)
        expert = make_expert(env_name)
        expert.reset(twin, obs, info)
        same, reward, turns, done = True, 0.0, 0, False
        while turns < MAX_TURNS and not done:
            action = expert.act(None)
            if action is None:
                break
            reply = action if env_name == "deepsearch" else f"Thought:\nI follow the plan.\n\nAction:\n{action}"
            out = client.step(reply)  # POST /step
            res = twin.step(reply)
            turns += 1
            same &= out.state == res.observation
            reward, done = float(out.reward), bool(out.done)
        return {"task": task, "turns": turns, "reward": reward, "done": done, "same": same,
                "success": bool(res.info.get("success")) if turns else False}
    finally:
        client.close()  # POST /close
        twin.close()


SERVERS = {"babyai": "babyai", "textcraft": "textcraft"}  # environment -> client dialect


def agentgym_server(agentgym: Path, env_name: str) -> tuple[subprocess.Popen, str]:
    """AgentGym's own server of ``env_name``, installed from the checkout into its own venv."""
    venv = ROOT / ".cache" / "agentgym-servers" / env_name
    exe = venv / "bin" / env_name
    if not exe.exists():
        subprocess.check_call([sys.executable, "-m", "venv", "--clear", str(venv)])
        subprocess.check_call([str(venv / "bin" / "python"), "-m", "pip", "install", "-q",
                               str(agentgym / f"agentenv-{env_name}")])
    port = free_port()
    # TextCraft reads its recipes from "agentenv_textcraft/" relative to the working directory
    proc = subprocess.Popen([str(exe), "--host", "127.0.0.1", "--port", str(port)],
                            cwd=agentgym / f"agentenv-{env_name}",
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"AgentGym's {env_name} server did not come up on {url}")


def play_remote(env_name: str, url: str, task: int) -> dict:
    """One task with this project's ``HTTPEnv`` against AgentGym's server."""
    import env_adapters
    from env_adapters.experts import make_expert
    from env_adapters.http_client import HTTPEnv

    remote = HTTPEnv(url, env_name, dialect=SERVERS[env_name], timeout_s=60)
    twin = env_adapters.make_env(env_name)
    try:
        first, _ = remote.reset(task, 0)
        twin_task = task
        if env_name == "textcraft":  # the remote's goal, whatever its listdir order
            from env_adapters.textcraft import recipes
            goal = "minecraft:" + first.rsplit("Goal: craft ", 1)[1].rstrip(".").replace(" ", "_")
            twin_task = next(i for i, (item, _) in enumerate(recipes().goals) if item == goal)
        obs, info = twin.reset(twin_task, 0)
        expert = make_expert(env_name)
        expert.reset(twin, obs, info)
        same, turns, res, out = True, 0, None, None
        while turns < MAX_TURNS:
            action = expert.act(None)
            if action is None:
                break
            reply = f"Thought:\nI follow the plan.\n\nAction:\n{action}"
            out, res = remote.step(reply), twin.step(reply)
            turns += 1
            same &= out.observation == res.observation
            if out.terminated or out.truncated:
                break
        return {"task": task, "turns": turns, "reward": float(out.reward) if out else 0.0,
                "done": bool(out and out.terminated), "same": same, "first_same": first == obs,
                "success": bool(res and res.info.get("success"))}
    finally:
        remote.close()
        twin.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("direction", choices=("clients", "servers"),
                   help="clients: AgentGym's clients -> agentgym env serve; servers: HTTPEnv -> AgentGym's servers")
    p.add_argument("--agentgym", type=Path, required=True, help="a checkout of github.com/WooooDyy/AgentGym")
    p.add_argument("--tasks", type=int, default=10, help="tasks per environment")
    p.add_argument("--envs", nargs="+", default=None, choices=list(CLIENTS))
    args = p.parse_args()
    if not (args.agentgym / "agentenv" / "agentenv" / "envs").is_dir():
        print(f"{args.agentgym}: not a checkout of WooooDyy/AgentGym (no agentenv/agentenv/envs)", file=sys.stderr)
        return 2
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.direction == "servers":
        return servers(args)
    import_clients(args.agentgym)
    print("| environment | AgentGym client | tasks | created, reset, stepped, closed | reached a reward "
          "| success | observations as in-process | turns (mean) |")
    print("|---|---|---|---|---|---|---|---|")
    failed = False
    for env_name in args.envs or list(CLIENTS):
        module, cls_name = CLIENTS[env_name]
        client_cls = getattr(importlib.import_module(module), cls_name)
        proc, url = serve(env_name)
        rows, errors = [], []
        try:
            for task in tasks_of(env_name, args.tasks):
                try:
                    rows.append(play(env_name, client_cls, url, task))
                except Exception as exc:  # noqa: BLE001 -- reported in the table
                    errors.append(f"task {task}: {type(exc).__name__}: {exc}")
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        rewarded = sum(r["reward"] > 0 for r in rows)
        ok = len(rows) == args.tasks and rewarded == len(rows) and all(r["same"] for r in rows)
        failed |= not ok
        turns = sum(r["turns"] for r in rows) / max(len(rows), 1)
        print(f"| {env_name} | `{cls_name}` | {args.tasks} | {len(rows)} | {rewarded} | "
              f"{sum(r['success'] for r in rows)} | {sum(r['same'] for r in rows)} | {turns:.1f} |", flush=True)
        for e in errors:
            print(f"  {env_name} {e}", file=sys.stderr)
    return 1 if failed else 0


def servers(args: argparse.Namespace) -> int:
    print("| environment | AgentGym server | tasks | played | reached a reward | first observation "
          "as in-process | observations as in-process | turns (mean) |")
    print("|---|---|---|---|---|---|---|---|")
    failed = False
    for env_name in [e for e in (args.envs or list(SERVERS)) if e in SERVERS]:
        proc, url = agentgym_server(args.agentgym, env_name)
        rows, errors = [], []
        try:
            for task in tasks_of(env_name, args.tasks):
                try:
                    rows.append(play_remote(env_name, url, task))
                except Exception as exc:  # noqa: BLE001 -- reported in the table
                    errors.append(f"task {task}: {type(exc).__name__}: {exc}")
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        rewarded = sum(r["reward"] > 0 and r["done"] for r in rows)
        failed |= not (len(rows) == args.tasks and rewarded == len(rows) and all(r["same"] for r in rows))
        turns = sum(r["turns"] for r in rows) / max(len(rows), 1)
        print(f"| {env_name} | `agentenv-{env_name}` | {args.tasks} | {len(rows)} | {rewarded} | "
              f"{sum(r['first_same'] for r in rows)} | {sum(r['same'] for r in rows)} | {turns:.1f} |", flush=True)
        for e in errors:
            print(f"  {env_name} {e}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
