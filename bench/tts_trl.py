"""The TRL side of ``bench/time_to_success.py``: TRL 1.16's ``GRPOTrainer`` on the quickstart's
BabyAI tasks, run as a child process in ``bench/.venv-trl``.

How it imports this project there: TRL's venv pins the main venv's torch / transformers (
``update_throughput.TRL_PINS``) and already holds pydantic, PyYAML and numpy (TRL's own
dependencies); the parent adds the main venv's minigrid and gymnasium versions to it
(``time_to_success.ensure_env_deps``) and starts the child with ``PYTHONPATH=<repo>:<repo>/bench``,
so ``agentgym`` (its rollout loop, ``HFEngine``, ``ChatFormatter``) and ``env_adapters`` are the
repository's own source, not a copy. Nothing here imports TRL at module level: the main venv's
tests import it to check the pure parts.

Two modes (arms):

* ``choose`` (``trl-choose``): ``GRPOTrainer(rollout_func=...)``. The function plays the
  generation batch's episodes with this project's rollout loop (``agentgym.rollout.loop.
  run_episodes``) on this project's engine: an ``HFEngine`` over a copy of the model in the
  engine dtype ours uses (``model.dtype: auto``), which gets the TRL model's current weights
  before every rollout (``update_weights``, as ours' weight sync), keeps each conversation's KV
  cache across turns and draws each reply among the turn's valid actions (``choose``). It returns
  the prompt ids, the completion ids of all turns, the sampler's log-probs, the ``env_mask``
  (1 = the policy's tokens) and each episode's reward; TRL trains on them.
* ``env`` (``trl-env``): ``GRPOTrainer(environment_factory=...)``, TRL's documented multi-turn
  path: the environment's ``reset`` text joins the prompt, its one public method ``act(action)``
  is a tool the model calls in free text in its chat template's tool-call format, up to
  ``max_tool_calling_iterations`` rounds; ``get_reward`` scores the episode. SmolLM2's own chat
  template cannot render tool calls (TRL refuses it), so the tokenizer gets TRL's Qwen2.5 template
  (ChatML on SmolLM2's own ``<|im_start|>``/``<|im_end|>`` tokens).

In both (``bench_trainer_class``):

* gradient checkpointing off (``GRPOConfig(gradient_checkpointing=False)``; the trainer's and
  the model's setting are recorded);
* generation never in training mode: the ``choose`` engine's model is in eval mode and scores
  under ``torch.no_grad``; in ``env`` mode TRL's own ``_generate_single_turn`` runs with the
  model in eval mode and under ``torch.no_grad``, its training mode restored after;
* the horizon follows ours' schedule by iteration (``tts_report.horizon_at``): before each
  generation batch the iteration is ``global_step // mini_batches``; ``choose`` plays at that
  horizon, ``env`` sets ``max_tool_calling_iterations`` (the trainer reads it at each tool loop) and
  the environment's own step cap to it;
* ``_generate`` (the whole rollout: generation, environment steps, tool loop) is timed apart
  from the rest of each optimizer step (``rollout_s`` / ``update_s``);
* at each of ours' stage ends the policy is saved as an HF folder (with the base model's own
  tokenizer) for the one evaluator (``tts_eval``), its training seconds beside it; saving is left
  out of the training time, as are the resume checkpoints.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from tts_report import horizon_at  # noqa: E402

#: new tokens per generation in environment mode: a tool call naming the longest BabyAI action is
#: ~40 SmolLM2 tokens (this project's replies need 12)
TOOL_REPLY_TOKENS = 64
ENV = "babyai"


@contextmanager
def generation_mode(model):
    """The model in eval mode and no autograd while it generates; its mode restored after."""
    import torch

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield model
    finally:
        model.train(was_training)


def freeze_below(model, layers: int | None) -> None:
    """As the pipeline's ``trainer.train_layers``: only the top ``layers`` decoder layers and the
    final norm train."""
    if not layers:
        return
    model.requires_grad_(False)
    for layer in model.model.layers[-layers:]:
        layer.requires_grad_(True)
    model.model.norm.requires_grad_(True)


# ----------------------------------------------------------------------------- choose mode


def episode_specs(tasks: list[int], iteration: int, group_size: int, seed: int, env_kwargs: dict[str, Any]):
    """The ``EpisodeSpec`` of each row of a TRL generation batch (``tasks``: its rows' task ids,
    each task's ``group_size`` copies next to each other, as TRL's ``RepeatSampler`` lays them):
    group ids as ours names them, environment seed = the run's seed (as ours' ``plan_episodes``)."""
    from agentgym.rollout.loop import EpisodeSpec

    if len(tasks) % group_size:
        raise ValueError(f"{len(tasks)} rows is not a whole number of groups of {group_size}")
    specs = []
    for i, task in enumerate(tasks):
        g = i // group_size
        if tasks[g * group_size] != task:
            raise ValueError(f"row {i} (task {task}) is not in its group's task {tasks[g * group_size]}")
        group = f"s{iteration}-g{g}-{ENV}-{task}"
        specs.append(EpisodeSpec(ENV, int(task), seed, group, f"{group}-e{i % group_size}", dict(env_kwargs)))
    return specs


def to_trl(episodes) -> dict[str, list]:
    """Played ``agentgym.types.Episode``s as ``rollout_func``'s output: the prompt ids (up to the
    first sampled token), the completion ids (every later token: replies, template glue,
    observations), the sampler's log-probs and the ``env_mask`` over them (1 = the policy's),
    each episode's reward and success. TRL builds its loss mask as completion mask x env_mask."""
    out: dict[str, list] = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "env_mask": [],
                            "env_reward": [], "env_success": []}
    for ep in episodes:
        if ep.context_starts:
            raise ValueError(f"episode {ep.episode_id} restarted its context: not one sequence for TRL")
        ids, mask = list(ep.input_ids), list(ep.loss_mask)
        first = mask.index(1) if 1 in mask else len(ids) - 1  # an episode with no reply keeps one masked token
        out["prompt_ids"].append(ids[:first])
        out["completion_ids"].append(ids[first:])
        out["logprobs"].append([float(x) for x in ep.old_logprobs[first:]])
        out["env_mask"].append(mask[first:])
        out["env_reward"].append(float(ep.reward))
        out["env_success"].append(float(ep.success))
    return out


class ChooseRollout:
    """``rollout_func`` of the ``choose`` mode: this project's rollout loop and engine over the
    TRL model's current weights (see the module docstring). ``horizon`` and ``iteration`` are set
    by the trainer before each call (``bench_trainer_class``)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        from agentgym.chat import ChatFormatter
        from agentgym.models.folders import load_model
        from agentgym.rollout.engines.hf import HFEngine

        model, tok = load_model(spec["model"], spec["engine_dtype"])
        self.engine = HFEngine(model, tok)
        self.formatter = ChatFormatter(tok, spec["response_prefix"])
        self.spec = spec
        self.horizon = int(spec["stages"][0]["horizon"])
        self.iteration = 0

    def __call__(self, prompts: list, trainer) -> dict[str, list]:
        from agentgym.rollout.loop import RolloutSettings, run_episodes
        from env_adapters import make_env

        model = trainer.accelerator.unwrap_model(trainer.model)
        with generation_mode(model):  # the weight copy; the engine's model is in eval mode itself
            self.engine.update_weights((n, p.detach()) for n, p in model.named_parameters())
        spec = self.spec
        settings = RolloutSettings(**{**spec["rollout_settings"], "horizon": self.horizon,
                                      "seed": spec["seed"] * 1_000_003 + self.iteration, "greedy": False})
        specs = episode_specs([int(p[-1]["content"]) for p in prompts], self.iteration, spec["group_size"],
                              spec["seed"], spec["env_kwargs"])
        return to_trl(run_episodes(self.engine, self.formatter, specs, settings, make_env))


# ----------------------------------------------------------------------------- env mode


def tool_env_class(env_kwargs: dict[str, Any], schedule: dict[str, Any]):
    """The BabyAI adapter as a TRL environment (``environment_factory``): ``reset`` gives the
    first observation, ``act`` is the one tool (TRL exposes every public method as one),
    ``get_reward`` the episode's reward; steps beyond the current horizon (``schedule["horizon"]``,
    which the trainer sets per iteration) are refused."""
    from env_adapters.babyai import BabyAIEnv

    class BabyAIToolEnv:
        def __init__(self) -> None:
            self._env = BabyAIEnv(**env_kwargs)
            self._reward, self._turns, self._done, self.success = 0.0, 0, False, False

        @property
        def over(self) -> bool:
            """Solved, or out of turns (a property: TRL lists only functions as tools)."""
            return self._done or self._turns >= schedule["horizon"]

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


# ----------------------------------------------------------------------------- the trainer


def follow_schedule(trainer, spec: dict[str, Any], state: dict[str, Any], rollout: ChooseRollout | None) -> int:
    """Before a generation batch: the iteration (``global_step // mini_batches``) and its horizon
    under ours' stages, handed to whatever plays the episodes; recorded once per iteration in
    ``state["horizons"]`` as ``[iteration, horizon]``. Returns the horizon."""
    it = trainer.state.global_step // spec["mini_batches"]
    h = horizon_at(spec["stages"], it)
    state["horizon"], state["iteration"] = h, it
    if spec["mode"] == "env":
        trainer.max_tool_calling_iterations = h  # the tool loop reads it each time it runs
    if rollout is not None:
        rollout.horizon, rollout.iteration = h, it
    if not state["horizons"] or state["horizons"][-1][0] != it:
        state["horizons"].append([it, h])
    return h


def bench_trainer_class(spec: dict[str, Any], state: dict[str, Any], rollout: ChooseRollout | None):
    """``GRPOTrainer`` with the schedule followed and the rollout timed (``_generate``) and TRL's
    own generation in eval mode without autograd (``_generate_single_turn``)."""
    from trl import GRPOTrainer

    class BenchGRPOTrainer(GRPOTrainer):
        def _generate(self, prompts: list):
            follow_schedule(self, spec, state, rollout)
            t0 = time.perf_counter()
            try:
                return super()._generate(prompts)
            finally:
                state["rollout_s"] += time.perf_counter() - t0

        def _generate_single_turn(self, *args, **kwargs):
            with generation_mode(self.accelerator.unwrap_model(self.model)):
                return super()._generate_single_turn(*args, **kwargs)

    return BenchGRPOTrainer


def grpo_config(spec: dict[str, Any], out: str):
    """The pipeline's update settings in TRL's terms: ``tasks x group`` episodes per generation,
    ``mini_batches`` optimizer steps per generation, micro-batches of one sequence, no KL, the
    same clip range and lr, gradient checkpointing off, bf16 where ours trains in bf16."""
    from trl import GRPOConfig

    per_gen = spec["tasks_per_iteration"] * spec["group_size"]
    return GRPOConfig(
        output_dir=out, use_cpu=True, bf16=spec["bf16"], seed=spec["seed"], report_to=[], save_strategy="steps",
        save_steps=spec["save_every"] * spec["mini_batches"], save_total_limit=2, gradient_checkpointing=False,
        logging_steps=1, disable_dropout=True, per_device_train_batch_size=1,
        gradient_accumulation_steps=per_gen // spec["mini_batches"], generation_batch_size=per_gen,
        num_generations=spec["group_size"], max_steps=spec["iterations"] * spec["mini_batches"],
        learning_rate=spec["learning_rate"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=1.0, beta=0.0, epsilon=spec["clip_low"], epsilon_high=spec["clip_high"], loss_type="dapo",
        temperature=spec["temperature"], top_k=0, max_completion_length=spec["max_context_tokens"],
        max_tool_calling_iterations=spec["stages"][0]["horizon"],
        generation_kwargs={"max_new_tokens": TOOL_REPLY_TOKENS})


def build_trainer(spec: dict[str, Any], model, tok, state: dict[str, Any]):
    """The arm's ``GRPOTrainer`` on the quickstart's training tasks."""
    from datasets import Dataset

    cfg = grpo_config(spec, spec["state"])
    if spec["mode"] == "env":
        cls = bench_trainer_class(spec, state, None)
        env = tool_env_class(spec["env_kwargs"], state)
        rows = [{"prompt": [{"role": "system", "content": tool_system_prompt(spec)}, {"role": "user", "content": ""}],
                 "task_id": t} for t in spec["train_tasks"]]
        return cls(model=model, args=cfg, train_dataset=Dataset.from_list(rows), processing_class=tok,
                   environment_factory=env)
    rollout = ChooseRollout(spec)
    cls = bench_trainer_class(spec, state, rollout)

    def env_reward(completions: list, env_reward: list[float], log_metric, env_success: list[float] | None = None,
                   **_: Any) -> list[float]:
        """The episodes' own reward (the pipeline's: clipped sum of step rewards); logs the success rate."""
        if env_success:
            log_metric("env/success", sum(env_success) / len(env_success))
        return list(env_reward)

    rows = [{"prompt": [{"role": "user", "content": str(t)}]} for t in spec["train_tasks"]]
    return cls(model=model, reward_funcs=[env_reward], args=cfg, train_dataset=Dataset.from_list(rows),
               processing_class=tok, rollout_func=rollout)


def points_callback(spec: dict[str, Any], save_tok, state: dict[str, Any]):
    """Per optimizer step: its wall seconds (``step_s``). After each iteration in ``eval_at``: the
    policy saved as an HF folder ``heldout/iter-<n>`` under the state folder (with ``save_tok``,
    the base model's own tokenizer) and a point with the training seconds so far. ``state``'s
    clock: ``t0`` and ``excluded`` (folder and checkpoint saves): training time is ``now - t0 -
    excluded``. At each resume checkpoint the progress goes into ``progress.json`` beside it."""
    from transformers import TrainerCallback

    per_gen = spec["tasks_per_iteration"] * spec["group_size"]
    root = Path(spec["state"])

    class Points(TrainerCallback):
        def on_step_begin(self, args, state_, control, **kwargs):
            state["step_t0"] = time.perf_counter()

        def on_step_end(self, args, state_, control, model=None, **kwargs):
            now = time.perf_counter()
            state["step_s"] += now - state.get("step_t0", now)
            state["step_end"] = now  # a checkpoint save, if any, runs after this
            if state_.global_step % spec["mini_batches"]:
                return
            it = state_.global_step // spec["mini_batches"]
            if it not in spec["eval_at"]:
                return
            folder = root / "heldout" / f"iter-{it}"
            if folder.exists():
                shutil.rmtree(folder)
            model.save_pretrained(folder)
            save_tok.save_pretrained(folder)
            state["points"].append({
                "label": f"iter-{it}", "iterations": it, "episodes": it * per_gen,
                "optimizer_steps": state_.global_step, "train_s": now - state["t0"] - state["excluded"],
                "rollout_s": state["rollout_s"], "update_s": state["step_s"] - state["rollout_s"],
                "folder": str(folder)})
            state["excluded"] += time.perf_counter() - now
            state["step_end"] = time.perf_counter()
            print(f"iteration {it} (horizon {state['horizon']}): saved for the held-out evaluation "
                  f"({state['points'][-1]['train_s']:.0f} s training)", flush=True)

        def on_save(self, args, state_, control, **kwargs):
            now = time.perf_counter()
            state["excluded"] += now - state.get("step_end", now)
            write_progress(root, state_.global_step, state, now - state["t0"] - state["excluded"])
            print(f"checkpoint at iteration {state_.global_step // spec['mini_batches']}", flush=True)

    return Points()


#: what a resume restores besides the Trainer's own checkpoint
PROGRESS_KEYS = ("points", "rollout_s", "step_s", "horizons")


def write_progress(state_dir: Path, step: int, state: dict[str, Any], train_s: float) -> None:
    """The curve, the timers and the training seconds as of optimizer step ``step`` (the
    checkpoint just saved)."""
    tmp = state_dir / "progress.json.tmp"
    tmp.write_text(json.dumps({"step": step, "train_s": train_s, **{k: state[k] for k in PROGRESS_KEYS}}, indent=1))
    tmp.replace(state_dir / "progress.json")


def resume_point(spec: dict[str, Any]) -> tuple[str | None, dict[str, Any] | None]:
    """The arm's latest checkpoint and the progress saved with it, or ``(None, None)`` for a
    fresh start. A state folder written for other settings is refused (delete it, or pass
    ``--tag``)."""
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


def findings(spec: dict[str, Any], template_ok: bool, history: list[dict]) -> list[str]:
    """What limited TRL on this task, measured."""
    found = []
    if spec["mode"] == "env":
        if not template_ok:
            found.append("SmolLM2-135M-Instruct's chat template cannot render tool calls (TRL's "
                         "supports_tool_calling is False: GRPOTrainer(environment_factory=...) raises 'The provided "
                         "chat template does not support tool calling'); the arm uses TRL's Qwen2.5 ChatML template")
        calls = [h["tools/call_frequency"] for h in history if "tools/call_frequency" in h]
        if calls:
            found.append(f"tool calls per rollout during training: mean {sum(calls) / len(calls):.3f}, max "
                         f"{max(calls):.3f} (a rollout without a well-formed <tool_call> ends after its first reply "
                         "with reward 0)")
    rewards = [h["reward"] for h in history if "reward" in h]
    if rewards and max(rewards) == 0.0:
        found.append("every training rollout of this run scored 0: every GRPO group tied, all advantages 0, "
                     "so no update changed the policy")
    return found


def child(spec_file: str) -> None:
    """In bench/.venv-trl: TRL training with an HF folder at each held-out point; the result
    JSON (points without successes: the parent scores the folders) at ``spec["result"]``."""
    import torch

    spec = json.loads(Path(spec_file).read_text())
    torch.set_num_threads(spec["threads"])
    torch.manual_seed(spec["seed"])
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.chat_template_utils import add_response_schema, qwen2_5_chat_template, supports_tool_calling

    tok = AutoTokenizer.from_pretrained(spec["model"])
    save_tok = AutoTokenizer.from_pretrained(spec["model"])  # the evaluator's: SmolLM2's own template
    template_ok = supports_tool_calling(tok)
    if spec["mode"] == "env" and not template_ok:
        tok.chat_template = qwen2_5_chat_template
        add_response_schema(tok)
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    freeze_below(model, spec["train_layers"])
    ckpt, progress = resume_point(spec)
    state: dict[str, Any] = {"points": [], "rollout_s": 0.0, "step_s": 0.0, "horizons": [], "excluded": 0.0,
                             "horizon": spec["stages"][0]["horizon"], "iteration": 0}
    train_s = 0.0
    if progress is not None:  # the curve and timers up to the checkpoint; the clock goes on from there
        state.update({k: progress[k] for k in PROGRESS_KEYS})
        train_s = progress["train_s"]
        print(f"resuming from {ckpt} (iteration {progress['step'] // spec['mini_batches']}, {train_s:.0f} s "
              "training)", flush=True)
    state["t0"] = time.perf_counter() - train_s
    trainer = build_trainer(spec, model, tok, state)
    settings = {"gradient_checkpointing": bool(trainer.args.gradient_checkpointing),
                "model_gradient_checkpointing": bool(getattr(model, "is_gradient_checkpointing", False)),
                "bf16": bool(trainer.args.bf16), "weights_dtype": str(next(model.parameters()).dtype),
                "generation": "eval mode, torch.no_grad (training mode restored after)",
                "engine_dtype": spec["engine_dtype"] if spec["mode"] == "choose" else None,
                "steps_per_generation": trainer.args.steps_per_generation,
                "gradient_accumulation_steps": trainer.args.gradient_accumulation_steps}
    if settings["gradient_checkpointing"] or settings["model_gradient_checkpointing"]:
        raise SystemExit(f"gradient checkpointing is on ({settings}); this bench runs TRL with it off")
    trainer.add_callback(points_callback(spec, save_tok, state))
    trainer.train(resume_from_checkpoint=ckpt)
    history = [{k: v for k, v in h.items() if isinstance(v, (int, float))} for h in trainer.state.log_history]
    Path(spec["result"]).write_text(json.dumps({
        "points": state["points"], "excluded_s": state["excluded"], "resumed_from_step": progress and progress["step"],
        "optimizer_steps": trainer.state.global_step, "horizons": state["horizons"], "settings": settings,
        "findings": findings(spec, template_ok, history), "log_history": history,
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__}},
        indent=1))


if __name__ == "__main__":
    child(sys.argv[1])
