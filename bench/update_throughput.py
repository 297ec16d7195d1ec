"""Update throughput: our DeepSpeed GRPO update vs a plain PyTorch AdamW loop and vs TRL's GRPOTrainer.

    nice -n 19 .venv/bin/python bench/update_throughput.py --quick          # smoke: tiny model, no TRL, ~1 min
    .venv/bin/python bench/update_throughput.py --model smollm2 --layers top8 --checkpointing off \\
        --rows 8 --repeats 5 --threads 2 --tag smollm2-top8     # the SmolLM2 runs: bench/README.md, section 4
    .venv/bin/python bench/update_throughput.py --no-trl    # tiny model, ours vs plain PyTorch only

Issue #10 item 4 and issue 44 item 2, targets: ours >= 0.9 x plain PyTorch, ours >= 1.0 x TRL.

**The step.** One GRPO step (``ppo_epochs`` 1, one mini-batch, micro-batches of ``--micro``
rows accumulated into one optimizer step) on the same fixed batch: ``--rows`` sequences of
``--prompt`` prompt tokens (loss mask 0) + ``--completion`` completion tokens (loss mask 1),
random ids, group-normalised advantages +-1, old log-probs = the initial policy's (ratio 1 at
the first step), fp32, AdamW (lr 1e-6, no weight decay), gradient clipping at 1.0, clip 0.2
below / 0.2 above, no KL term, token-mean loss over the mini-batch. Throughput = trained
(completion) tokens / step seconds.

**Set equally on all three sides, and recorded.**

* ``--checkpointing on|off`` (default off): gradient (activation) checkpointing. Ours:
  ``TrainerConfig.gradient_checkpointing``; plain: ``model.gradient_checkpointing_enable()`` /
  ``gradient_checkpointing_disable()``; TRL: ``GRPOConfig(gradient_checkpointing=...)`` (its
  default is on). Each side's model is then asked (``is_gradient_checkpointing``) and the
  bench stops if any differs from the flag; the answers are in the record.
* ``--layers all|topN`` (default all; ``top8`` = configs/quickstart.yaml's
  ``trainer.train_layers: 8``): train every weight, or only the top N decoder layers and the
  final norm (embeddings, tied LM head and lower layers frozen). Ours:
  ``TrainerConfig.train_layers``; plain: ``agentgym.training.policy_trainer.freeze_below``; TRL:
  the same rule written out in its child (TRL's Trainer builds its optimizer over the weights
  that require grad). Each side's trainable parameter count is recorded and the bench stops
  if they differ. With checkpointing on, transformers makes the embeddings' output require
  grad (``enable_input_require_grads``), so the backward then runs through the frozen layers
  too, on all three sides alike.
* ``--threads``: torch threads, in this process and in TRL's child.

**Repeats, alternated.** The three sides are built once and kept alive: ours and plain in this
process, TRL in a persistent child process in its own venv, driven over a pipe (the parent
writes ``step``, the child runs one step and answers its seconds; ``exit`` ends it). Each side
first makes one warm-up step (not counted). Then repeat ``i`` (``--repeats``, default 5) runs
one timed step of each side, one after another, in the order ``ours, plain, trl`` rotated by
``i`` (repeat 0: ours first; 1: plain first; 2: TRL first; ...), so no side always runs first
or right after another's allocations. Only one side computes at any time: the others wait
(this process in its own code, the child blocked reading its pipe). Every step keeps training
the same model on the same batch (lr 1e-6: the work per step does not change). Reported per
side: the median step time and tok/s and their min-max over the repeats; per pair, the ratio
ours / baseline of each repeat (its two steps ran back to back) as median and min-max.

* ours  -- ``PolicyTrainer.train_on_batch`` (DeepSpeed engine, ZeRO stage ``--zero``, fp32);
  it also computes the entropy of every trained token (a reported metric) and runs the LM head
  on policy tokens only;
* plain -- the loop anyone would write: ``model(ids, mask).logits``, ``log_softmax``, the
  clipped ratio objective (``agentgym.algorithms.policy_loss``, the same function),
  ``backward`` per micro-batch, ``clip_grad_norm_``, ``AdamW.step``; ``use_cache`` off as ours;
* TRL   -- ``trl.GRPOTrainer`` 1.16 in ``bench/.venv-trl`` (created on first use: ``python -m
  venv`` + pip, CPU torch (``--torch-index``), the main venv's torch / transformers / accelerate versions
  pinned). It cannot be given a batch without generating, so the bench drives its public
  ``training_step`` with the batch already in the dict its own generation step produces
  (``prompt_ids``, ``prompt_mask``, ``completion_ids``, ``completion_mask``, ``advantages``,
  ``old_per_token_logps``, ``num_items_in_batch``...): a subclass replaces ``_prepare_inputs`` (the
  generate-and-score step) with "return the prepared micro-batch", then per micro-batch
  ``training_step`` (forward, loss, accelerate's backward), then ``clip_grad_norm_`` +
  ``optimizer.step`` as its training loop does. Equal: model, batch, tokens trained, loss
  (``loss_type="dapo"``: token mean over the whole mini-batch, like our token-mean), clip
  range, optimizer, lr, grad clip, fp32, no KL (``beta=0``), both compute the entropy of every
  trained token. Different: TRL computes the logits of completion tokens only
  (``logits_to_keep``, as ours runs the LM head on policy tokens only); its Trainer adds its own
  bookkeeping (accelerate); no DeepSpeed.

The record, ``bench/results/update_throughput-<tag>.json`` (``results_io``): the config
(checkpointing, layers, threads, sizes), every repeat of every side (its order and position in
the repeat), the warm-up steps, each side's checked checkpointing state and trainable
parameters, the medians, spreads and ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

HERE = Path(__file__).resolve().parent
TRL_VENV = HERE / ".venv-trl"
# the main venv's versions: the comparison is about the update code, not the libraries
TRL_PINS = ["trl==1.16.0", "torch==2.13.0", "transformers==5.24.0", "accelerate==1.15.0"]
# where pip finds the CPU build of torch: this machine's pip config already points at a local
# wheel folder holding it (so no extra index); elsewhere pass --torch-index
# https://download.pytorch.org/whl/cpu, or pip pulls the multi-GB CUDA build

SIDES = ("ours", "plain", "trl")
#: a line of the TRL child's pipe protocol starts with this (its libraries may print to stdout too)
PROTO = "@@update_throughput "
#: what ``init_single_process_dist`` leaves in this process's environment, kept from TRL's child
_DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _layers(text: str) -> str:
    if text != "all" and not re.fullmatch(r"top[1-9][0-9]*", text):
        raise argparse.ArgumentTypeError(f"--layers takes all or topN (e.g. top8), not {text!r}")
    return text


def train_layers(layers: str) -> int | None:
    """``all`` -> None (every weight trains); ``topN`` -> N."""
    return None if layers == "all" else int(layers[3:])


def _parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="tiny or smollm2 (or an HF folder)")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--completion", type=int, default=128)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5, help="timed steps per side, alternated (after one "
                    "warm-up step each)")
    ap.add_argument("--checkpointing", choices=["on", "off"], default="off",
                    help="gradient checkpointing, set explicitly on all three sides (default off)")
    ap.add_argument("--layers", type=_layers, default="all", help="all, or topN: train only the top N decoder "
                    "layers and the final norm, on all three sides (top8: configs/quickstart.yaml's "
                    "trainer.train_layers)")
    ap.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3],
                    help="DeepSpeed ZeRO stage of ours (0: what trainer.zero_stage auto runs for one rank)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: on a shared 2-core machine a "
                    "second OpenMP thread spin-waits on a busy core, many times slower; 2 on an idle "
                    "machine; see bench/README.md)")
    ap.add_argument("--no-trl", action="store_true", help="skip TRL (no venv created)")
    ap.add_argument("--torch-index", default="", help="extra pip index for the CPU torch when creating "
                    "bench/.venv-trl, e.g. https://download.pytorch.org/whl/cpu (default: pip's own config)")
    ap.add_argument("--quick", action="store_true", help="smoke: 4 rows x (32 + 32), micro-batch 2, 2 repeats, "
                    "no TRL unless --with-trl")
    ap.add_argument("--with-trl", action="store_true", help="with --quick: include TRL")
    ap.add_argument("--trl-child", metavar="BATCH_FILE", help=argparse.SUPPRESS)
    ap.add_argument("--tag", default="", help="the record's name: bench/results/update_throughput-<tag>.json "
                    "(default: the UTC time; --quick: smoke)")
    args = ap.parse_args(argv)
    if args.quick:
        args.rows, args.prompt, args.completion, args.micro, args.repeats = 4, 32, 32, 2, 2
        args.no_trl = args.no_trl or not args.with_trl
    if args.repeats < 1 or args.rows < 1 or args.micro < 1 or args.rows % args.micro:
        ap.error("--repeats and --rows >= 1, and --rows a multiple of --micro")
    return args


# -- what the bench reports -----------------------------------------------------------------------

def summarize(values: Sequence[float]) -> dict[str, float]:
    """Median and spread (min, max) of ``values``; ``n`` of them."""
    if not values:
        raise ValueError("summarize: no values")
    return {"median": float(statistics.median(values)), "min": float(min(values)), "max": float(max(values)),
            "n": len(values)}


def order_for(repeat: int, sides: Sequence[str]) -> list[str]:
    """Repeat ``repeat``'s order: ``sides`` rotated left by ``repeat`` (each side leads in turn)."""
    k = repeat % len(sides)
    return list(sides[k:]) + list(sides[:k])


def report(repeats: list[dict[str, Any]], tokens: int) -> dict[str, Any]:
    """Per side the median / min / max of step seconds and tok/s; per baseline the ratio ours /
    baseline (of tok/s, = baseline seconds / ours) of each repeat, as median / min / max."""
    sides = [s for s in SIDES if any(r["side"] == s for r in repeats)]
    secs = {s: {r["rep"]: r["s"] for r in repeats if r["side"] == s} for s in sides}
    out: dict[str, Any] = {"trained_tokens": tokens, "sides": {}, "ratios": {}}
    for s in sides:
        ts = [secs[s][k] for k in sorted(secs[s])]
        out["sides"][s] = {"s": summarize(ts), "tok_s": summarize([tokens / t for t in ts])}
    for base in sides:
        if base == "ours":
            continue
        common = sorted(set(secs["ours"]) & set(secs[base]))
        per = [secs[base][k] / secs["ours"][k] for k in common]
        out["ratios"][f"ours/{base}"] = {**summarize(per), "per_repeat": per}
    return out


# -- the batch and the sides ------------------------------------------------------------------------

def _model_path(name: str) -> Path:
    from agentgym.models.folders import resolve_model, tiny_model_path

    return tiny_model_path() if name == "tiny" else resolve_model(name)


def make_batch(path: Path, rows: int, prompt: int, completion: int) -> dict:
    """Random prompt + completion ids; old log-probs from the model itself (ratio 1)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    ids = torch.randint(10, vocab, (rows, prompt + completion), generator=g)
    old = torch.zeros(rows, prompt + completion)
    with torch.no_grad():
        for a in range(0, rows, 4):  # a few rows at a time: SmolLM2's logits are 49k wide
            lp = torch.log_softmax(model(input_ids=ids[a:a + 4]).logits.float(), -1)
            old[a:a + 4, 1:] = lp[:, :-1].gather(-1, ids[a:a + 4, 1:, None])[..., 0]
    old[:, :prompt] = 0.0
    adv = torch.tensor([1.0 if i % 2 else -1.0 for i in range(rows)])
    return {"input_ids": ids, "prompt": prompt, "completion": completion, "old_logprobs": old, "advantages": adv}


def _trainable(params) -> int:
    return sum(getattr(p, "ds_numel", p.numel()) for p in params if p.requires_grad)


class Ours:
    """``PolicyTrainer`` on the batch; ``step()`` is one ``train_on_batch``."""

    def __init__(self, path: Path, batch: dict, args):
        from transformers import AutoTokenizer

        from agentgym.config import AlgorithmConfig, TrainerConfig
        from agentgym.training.batch import TrainBatch
        from agentgym.training.policy_trainer import PolicyTrainer

        tok = AutoTokenizer.from_pretrained(path)
        p = batch["prompt"]
        rows = []
        for i, ids in enumerate(batch["input_ids"].tolist()):
            mask = [0] * p + [1] * (len(ids) - p)
            rows.append({"input_ids": ids, "loss_mask": mask, "old_logprobs": batch["old_logprobs"][i].tolist(),
                         "advantages": [float(batch["advantages"][i]) * m for m in mask]})
        self.batch = TrainBatch.from_rows(rows, tok.pad_token_id or 0)
        cfg = TrainerConfig(learning_rate=1e-6, zero_stage=args.zero, bf16=False, micro_batch_size=args.micro,
                            grad_clip=1.0, gradient_checkpointing=args.checkpointing == "on",
                            train_layers=train_layers(args.layers))
        algo = AlgorithmConfig(estimator="grpo", ppo_epochs=1, mini_batches=1, clip_low=0.2, clip_high=0.2,
                               kl_coef=0.0, entropy_coef=0.0, loss_agg="token-mean")
        self.tr = PolicyTrainer(path, tok, cfg, algo, temperature=1.0, seed=0)
        self.steps = 0
        policy = self.tr.engine.module.policy
        self.info = {"checkpointing": bool(policy.is_gradient_checkpointing),
                     "trainable_params": _trainable(policy.parameters())}

    def step(self) -> float:
        t0 = time.perf_counter()
        self.tr.train_on_batch(self.batch, seed=self.steps)
        self.steps += 1
        return time.perf_counter() - t0

    def close(self) -> None:
        self.tr.close()


class Plain:
    """The AdamW loop anyone would write, on the same batch."""

    def __init__(self, path: Path, batch: dict, args):
        import torch
        from transformers import AutoModelForCausalLM

        from agentgym.training.policy_trainer import freeze_below

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        if args.checkpointing == "on":
            model.gradient_checkpointing_enable()
        else:
            model.gradient_checkpointing_disable()
        model.config.use_cache = False
        if train_layers(args.layers) is not None:
            freeze_below(model, train_layers(args.layers))
        model.train()
        self.model, self.micro = model, args.micro
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=1e-6, weight_decay=0.0)
        self.ids, p = batch["input_ids"], batch["prompt"]
        self.mask = torch.zeros_like(self.ids, dtype=torch.float32)
        self.mask[:, p:] = 1.0
        self.adv = batch["advantages"][:, None] * self.mask
        self.old = batch["old_logprobs"]
        self.total = self.mask[:, 1:].sum()
        self.info = {"checkpointing": bool(model.is_gradient_checkpointing), "trainable_params": _trainable(self.params)}

    def step(self) -> float:
        import torch

        from agentgym import algorithms as A

        ids, mask = self.ids, self.mask
        t0 = time.perf_counter()
        for a in range(0, len(ids), self.micro):
            sl = slice(a, a + self.micro)
            logits = self.model(input_ids=ids[sl], attention_mask=torch.ones_like(ids[sl])).logits
            lp = torch.zeros(ids[sl].shape)
            lp[:, 1:] = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[sl][:, 1:, None])[..., 0]
            loss, _ = A.policy_loss(lp, self.old[sl], self.adv[sl], mask[sl], clip_low=0.2, clip_high=0.2,
                                    loss_agg="token-mean", norm_length=ids.shape[1])
            (loss * (mask[sl][:, 1:].sum() / self.total)).backward()  # token mean over the mini-batch
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    def close(self) -> None:
        pass


def ensure_trl_venv(torch_index: str = "") -> Path:
    """``bench/.venv-trl`` with TRL and the CPU torch (created once; git-ignored)."""
    py = TRL_VENV / "bin" / "python"
    if py.exists() and subprocess.run([str(py), "-c", "import trl"], capture_output=True).returncode == 0:
        return py
    base = os.path.realpath(sys.executable)
    print(f"creating {TRL_VENV} (python -m venv + pip install {' '.join(TRL_PINS)}) ...", file=sys.stderr, flush=True)
    subprocess.run([base, "-m", "venv", str(TRL_VENV)], check=True)
    index = ["--extra-index-url", torch_index] if torch_index else []
    subprocess.run([str(py), "-m", "pip", "install", "-q", *index, *TRL_PINS], check=True)
    return py


class Trl:
    """TRL's side in its persistent child (``--trl-child``), driven over its stdin / stdout."""

    def __init__(self, py: Path, path: Path, batch: dict, args):
        import torch

        self.dir = tempfile.TemporaryDirectory()
        f = Path(self.dir.name) / "batch.pt"
        torch.save({**batch, "path": str(path)}, f)
        self.log = open(Path(self.dir.name) / "child.log", "w+")
        cmd = [str(py), __file__, "--trl-child", str(f), "--rows", str(args.rows), "--micro", str(args.micro),
               "--threads", str(args.threads), "--checkpointing", args.checkpointing, "--layers", args.layers]
        # not DeepSpeed's one-process group (RANK, WORLD_SIZE...): accelerate would read it as a launched run
        env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV}
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     bufsize=1, env={**env, "PYTHONPATH": ""})
        self.info = self._read()  # {"checkpointing", "trainable_params", "trl", "torch", ...} once built

    def _read(self) -> dict:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(PROTO):
                return json.loads(line[len(PROTO):])
        self.log.seek(0)
        tail = self.log.read()[-4000:]
        raise SystemExit(f"the TRL child ended (exit {self.proc.wait()}) before answering:\n{tail}")

    def step(self) -> float:
        assert self.proc.stdin is not None
        self.proc.stdin.write("step\n")
        self.proc.stdin.flush()
        return float(self._read()["s"])

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write("exit\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=120)
        self.log.close()
        self.dir.cleanup()


def trl_optimizer_step(trainer, model, opt, micro: list[dict]) -> None:
    """One optimizer step of TRL's training loop on prepared micro-batches: ``training_step`` per
    micro-batch (forward, loss, accelerate's backward), then clipping at 1.0, the step, the
    scheduler and zeroed gradients (also used by bench/gpu_throughput.py's TRL child)."""
    import torch

    for mb in micro:
        trainer.training_step(model, dict(mb), num_items_in_batch=mb["num_items_in_batch"])
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    trainer.lr_scheduler.step()
    opt.zero_grad(set_to_none=True)


def trl_child(batch_file: str, args) -> None:
    """In bench/.venv-trl: TRL's GRPOTrainer built once on the given batch, then one GRPO step
    per ``step`` line on stdin, its seconds answered on stdout; ``exit`` (or end of input) ends it."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    def say(obj: dict) -> None:
        print(PROTO + json.dumps(obj), flush=True)

    torch.set_num_threads(args.threads)
    batch = torch.load(batch_file)
    path = batch["path"]
    ids, p = batch["input_ids"], batch["prompt"]
    rows = len(ids)
    top = train_layers(args.layers)
    on = args.checkpointing == "on"

    class FixedBatchGRPO(GRPOTrainer):
        """``_prepare_inputs`` (generate, score, advantages) replaced: the micro-batch is given."""

        def _prepare_inputs(self, inputs):
            return inputs

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.config.use_cache = False
    if top is not None:  # agentgym.training.policy_trainer.freeze_below, written out (no agentgym here)
        layers = model.get_decoder().layers
        model.requires_grad_(False)
        for layer in layers[len(layers) - top:]:
            layer.requires_grad_(True)
        model.get_decoder().norm.requires_grad_(True)
    out = tempfile.TemporaryDirectory()  # TRL's output_dir: nothing is saved there
    cfg = GRPOConfig(output_dir=out.name, per_device_train_batch_size=args.micro,
                     gradient_accumulation_steps=rows // args.micro, num_generations=2,
                     learning_rate=1e-6, weight_decay=0.0, max_grad_norm=1.0, beta=0.0, epsilon=0.2,
                     epsilon_high=0.2, loss_type="dapo", temperature=1.0, use_cpu=True, bf16=False,
                     report_to=[], logging_strategy="no", save_strategy="no", num_iterations=1,
                     max_completion_length=batch["completion"], disable_dropout=True,
                     gradient_checkpointing=on)
    data = Dataset.from_list([{"prompt": "x"}] * rows)
    trainer = FixedBatchGRPO(model=model, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
                             args=cfg, train_dataset=data, processing_class=tok)
    model = trainer.model
    if on and not model.is_gradient_checkpointing:
        # Trainer's own loop (train(), not run here) turns it on with the config's kwargs
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=cfg.gradient_checkpointing_kwargs)
    elif not on and model.is_gradient_checkpointing:
        model.gradient_checkpointing_disable()
    trainer.create_optimizer_and_scheduler(num_training_steps=10**6)
    # set by Trainer's own loop, which is not run: the "dapo" loss divides by it
    trainer.current_gradient_accumulation_steps = rows // args.micro
    opt = trainer.optimizer
    params = [q for group in opt.param_groups for q in group["params"]]
    model.train()
    micro = []
    for a in range(0, rows, args.micro):
        sl = slice(a, a + args.micro)
        micro.append({
            "prompt_ids": ids[sl, :p], "prompt_mask": torch.ones_like(ids[sl, :p]),
            "completion_ids": ids[sl, p:], "completion_mask": torch.ones_like(ids[sl, p:]),
            "advantages": batch["advantages"][sl],
            "old_per_token_logps": batch["old_logprobs"][sl, p:],
            "num_items_in_batch": torch.tensor(float(rows * batch["completion"])),
        })
    import trl

    say({"checkpointing": bool(model.is_gradient_checkpointing), "trainable_params": _trainable(params),
         "optimizer_params": sum(q.numel() for q in params), "trl": trl.__version__, "torch": torch.__version__})
    for line in sys.stdin:
        if line.strip() != "step":
            break
        t0 = time.perf_counter()
        trl_optimizer_step(trainer, model, opt, micro)
        say({"s": time.perf_counter() - t0})
    out.cleanup()


# -- the run ------------------------------------------------------------------------------------------

def run_alternated(sides: dict[str, Any], repeats: int) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """One warm-up step per side, then ``repeats`` rounds of one timed step per side in
    ``order_for(i)``. Returns the warm-up seconds and every repeat's entry."""
    names = [s for s in SIDES if s in sides]
    warm = {}
    for name in names:
        warm[name] = sides[name].step()
        print(f"warm-up {name:5s} {warm[name]:.3f} s", file=sys.stderr, flush=True)
    out = []
    for i in range(repeats):
        order = order_for(i, names)
        for pos, name in enumerate(order):
            s = sides[name].step()
            out.append({"rep": i, "side": name, "position": pos, "order": order, "s": s})
        print(f"repeat {i}: " + ", ".join(f"{e['side']} {e['s']:.3f} s" for e in out[-len(order):]),
              file=sys.stderr, flush=True)
    return warm, out


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    if args.trl_child:
        trl_child(args.trl_child, args)
        return 0
    import torch

    import benchlib
    from benchlib import Row

    torch.set_num_threads(args.threads)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    run = benchlib.start("update_throughput", args)
    path = _model_path(args.model)
    from transformers import AutoConfig

    n_layers = AutoConfig.from_pretrained(path).num_hidden_layers
    top = train_layers(args.layers)
    if top is not None and top > n_layers:
        raise SystemExit(f"--layers {args.layers}: {args.model} has {n_layers} decoder layers")
    batch = make_batch(path, args.rows, args.prompt, args.completion)
    tokens = args.rows * args.completion
    sides: dict[str, Any] = {}
    try:
        sides["ours"] = Ours(path, batch, args)
        sides["plain"] = Plain(path, batch, args)
        if not args.no_trl:
            sides["trl"] = Trl(ensure_trl_venv(args.torch_index), path, batch, args)
        info = {name: side.info for name, side in sides.items()}
        print(f"sides: {json.dumps(info)}", file=sys.stderr, flush=True)
        for name, i in info.items():
            if i["checkpointing"] != (args.checkpointing == "on"):
                raise SystemExit(f"{name}: gradient checkpointing is {i['checkpointing']}, asked "
                                 f"--checkpointing {args.checkpointing}")
        counts = {name: i["trainable_params"] for name, i in info.items()}
        if len(set(counts.values())) != 1:
            raise SystemExit(f"the sides train different numbers of weights: {counts}")
        warm, repeats = run_alternated(sides, args.repeats)
    finally:
        for side in sides.values():
            side.close()
    for e in repeats:
        e["tok_s"] = tokens / e["s"]
    summary = report(repeats, tokens)
    med = {s: v["tok_s"]["median"] for s, v in summary["sides"].items()}
    rows = [Row("ours vs plain PyTorch", med["ours"], med["plain"], ratio=summary["ratios"]["ours/plain"]["median"],
                target=(">=", 0.9), unit="tok/s")]
    if "trl" in med:
        rows.append(Row("ours vs TRL GRPOTrainer", med["ours"], med["trl"],
                        ratio=summary["ratios"]["ours/trl"]["median"], target=(">=", 1.0), unit="tok/s"))
    benchlib.print_table(rows, f"update_throughput: {args.model} ({n_layers} layers, train {args.layers}), "
                               f"{args.rows} rows x ({args.prompt} + {args.completion}) tokens, micro-batch "
                               f"{args.micro}, fp32, {args.threads} thread(s), ZeRO-{args.zero}, checkpointing "
                               f"{args.checkpointing}; medians of {args.repeats} alternated repeats")
    for name, r in summary["ratios"].items():
        print(f"{name}: median {r['median']:.3f}, min-max {r['min']:.3f}-{r['max']:.3f} over {r['n']} repeats")
    for name, v in summary["sides"].items():
        t = v["tok_s"]
        print(f"{name:5s} tok/s: median {t['median']:.4g}, min-max {t['min']:.4g}-{t['max']:.4g}")
    summary.update({"warmup_s": warm, "sides_checked": info, "layers_in_model": n_layers,
                    "train_layers": top, "checkpointing": args.checkpointing == "on"})
    benchlib.write_results(run, rows, repeats, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
