"""Update throughput: our DeepSpeed GRPO update vs a plain PyTorch AdamW loop and vs TRL's GRPOTrainer.

    nice -n 19 .venv/bin/python bench/update_throughput.py                  # tiny model, ~3 min (+ TRL venv once)
    nice -n 19 .venv/bin/python bench/update_throughput.py --model smollm2 --rows 8 --prompt 128 --completion 128
    nice -n 19 .venv/bin/python bench/update_throughput.py --no-trl         # ours vs plain PyTorch only

Issue #10 item 4, targets: ours >= 0.9 x plain PyTorch, ours >= 1.0 x TRL. One GRPO step
(``ppo_epochs`` 1, one mini-batch, micro-batches of ``--micro`` rows accumulated into one
optimizer step) on the same fixed batch: ``--rows`` sequences of ``--prompt`` prompt tokens
(loss mask 0) + ``--completion`` completion tokens (loss mask 1), random ids, group-normalised
advantages +-1, old log-probs = the current policy's (ratio 1 at the first step), fp32, AdamW
(lr 1e-6, no weight decay), gradient clipping at 1.0, clip 0.2 below / 0.2 above, no KL term,
token-mean loss over the mini-batch. Throughput = trained (completion) tokens / step seconds,
best of ``--reps`` steps after one warm-up step; all three sides run one after another in
this process (TRL in a child process), so load changes hit them alike.

* ours  -- ``PolicyTrainer.train_on_batch`` (DeepSpeed engine, ZeRO stage ``--zero``, fp32);
  it also computes the entropy of every trained token (a reported metric) and runs the LM head
  on policy tokens only;
* plain -- the loop anyone would write: ``model(ids, mask).logits``, ``log_softmax``, the
  clipped ratio objective (``agentgym.algorithms.policy_loss``, the same function),
  ``backward`` per micro-batch, ``clip_grad_norm_``, ``AdamW.step``;
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
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRL_VENV = HERE / ".venv-trl"
# the main venv's versions: the comparison is about the update code, not the libraries
TRL_PINS = ["trl==1.16.0", "torch==2.13.0", "transformers==5.24.0", "accelerate==1.15.0"]
# where pip finds the CPU build of torch: this machine's pip config already points at a local
# wheel folder holding it (so no extra index); elsewhere pass --torch-index
# https://download.pytorch.org/whl/cpu, or pip pulls the multi-GB CUDA build


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="tiny or smollm2 (or an HF folder)")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--completion", type=int, default=128)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--zero", type=int, default=2, choices=[0, 1, 2, 3])
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: on a shared 2-core machine a "
                    "second OpenMP thread spin-waits on a busy core, many times slower; see bench/README.md)")
    ap.add_argument("--no-trl", action="store_true", help="skip TRL (no venv created)")
    ap.add_argument("--torch-index", default="", help="extra pip index for the CPU torch when creating "
                    "bench/.venv-trl, e.g. https://download.pytorch.org/whl/cpu (default: pip's own config)")
    ap.add_argument("--quick", action="store_true", help="4 rows x (32 + 32), 1 rep, no TRL (smoke)")
    ap.add_argument("--trl-child", metavar="BATCH_FILE", help=argparse.SUPPRESS)
    ap.add_argument("--tag", default="", help="the record's name: bench/results/update_throughput-<tag>.json "
                    "(default: the UTC time; --quick: smoke)")
    args = ap.parse_args()
    if args.quick:
        args.rows, args.prompt, args.completion, args.micro, args.reps, args.no_trl = 4, 32, 32, 2, 1, True
    return args


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
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=ids).logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    old = torch.zeros(rows, prompt + completion)
    old[:, 1:] = lp
    old[:, :prompt] = 0.0
    adv = torch.tensor([1.0 if i % 2 else -1.0 for i in range(rows)])
    return {"input_ids": ids, "prompt": prompt, "completion": completion, "old_logprobs": old, "advantages": adv}


def ours(path: Path, batch: dict, args) -> list[float]:
    import torch
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
    tb = TrainBatch.from_rows(rows, tok.pad_token_id or 0)
    cfg = TrainerConfig(learning_rate=1e-6, zero_stage=args.zero, bf16=False, micro_batch_size=args.micro,
                        grad_clip=1.0)
    algo = AlgorithmConfig(estimator="grpo", ppo_epochs=1, mini_batches=1, clip_low=0.2, clip_high=0.2,
                           kl_coef=0.0, entropy_coef=0.0, loss_agg="token-mean")
    tr = PolicyTrainer(path, tok, cfg, algo, temperature=1.0, seed=0)
    times = []
    for rep in range(args.reps + 1):
        t0 = time.perf_counter()
        tr.train_on_batch(tb, seed=rep)
        times.append(time.perf_counter() - t0)
    tr.close()
    del tr
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return times[1:]


def plain(path: Path, batch: dict, args) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM

    from agentgym import algorithms as A

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0)
    ids, p = batch["input_ids"], batch["prompt"]
    mask = torch.zeros_like(ids, dtype=torch.float32)
    mask[:, p:] = 1.0
    adv = batch["advantages"][:, None] * mask
    old = batch["old_logprobs"]
    total = mask[:, 1:].sum()
    times = []
    for _ in range(args.reps + 1):
        t0 = time.perf_counter()
        for a in range(0, len(ids), args.micro):
            sl = slice(a, a + args.micro)
            logits = model(input_ids=ids[sl], attention_mask=torch.ones_like(ids[sl])).logits
            lp = torch.zeros(ids[sl].shape)
            lp[:, 1:] = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[sl][:, 1:, None])[..., 0]
            loss, _ = A.policy_loss(lp, old[sl], adv[sl], mask[sl], clip_low=0.2, clip_high=0.2,
                                    loss_agg="token-mean", norm_length=ids.shape[1])
            (loss * (mask[sl][:, 1:].sum() / total)).backward()  # token mean over the mini-batch
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return times[1:]


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


def trl_child(batch_file: str, args) -> None:
    """In bench/.venv-trl: one GRPO step per rep with TRL's GRPOTrainer on the given batch."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(args.threads)
    batch = torch.load(batch_file)
    path = batch["path"]
    ids, p = batch["input_ids"], batch["prompt"]
    rows = len(ids)

    class FixedBatchGRPO(GRPOTrainer):
        """``_prepare_inputs`` (generate, score, advantages) replaced: the micro-batch is given."""

        def _prepare_inputs(self, inputs):
            return inputs

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with tempfile.TemporaryDirectory() as out:
        cfg = GRPOConfig(output_dir=out, per_device_train_batch_size=args.micro,
                         gradient_accumulation_steps=rows // args.micro, num_generations=2,
                         learning_rate=1e-6, weight_decay=0.0, max_grad_norm=1.0, beta=0.0, epsilon=0.2,
                         epsilon_high=0.2, loss_type="dapo", temperature=1.0, use_cpu=True, bf16=False,
                         report_to=[], logging_strategy="no", save_strategy="no", num_iterations=1,
                         max_completion_length=batch["completion"], disable_dropout=True)
        data = Dataset.from_list([{"prompt": "x"}] * rows)
        trainer = FixedBatchGRPO(model=model, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
                                 args=cfg, train_dataset=data, processing_class=tok)
        trainer.create_optimizer_and_scheduler(num_training_steps=args.reps + 1)
        # set by Trainer's own loop, which is not run: the "dapo" loss divides by it
        trainer.current_gradient_accumulation_steps = rows // args.micro
        opt = trainer.optimizer
        model = trainer.model
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
        times = []
        for _ in range(args.reps + 1):
            t0 = time.perf_counter()
            for mb in micro:
                trainer.training_step(model, dict(mb), num_items_in_batch=mb["num_items_in_batch"])
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            trainer.lr_scheduler.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t0)
    import trl

    print(json.dumps({"times": times[1:], "trl": trl.__version__, "torch": torch.__version__}))


def main() -> int:
    args = _parse()
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
    batch = make_batch(path, args.rows, args.prompt, args.completion)
    tokens = args.rows * args.completion
    res: dict[str, list[float]] = {}
    res["ours"] = ours(path, batch, args)
    print(f"ours  {[round(t, 3) for t in res['ours']]}", file=sys.stderr, flush=True)
    res["plain"] = plain(path, batch, args)
    print(f"plain {[round(t, 3) for t in res['plain']]}", file=sys.stderr, flush=True)
    trl_info = None
    if not args.no_trl:
        py = ensure_trl_venv(args.torch_index)
        with tempfile.TemporaryDirectory() as d:
            f = Path(d) / "batch.pt"
            torch.save({**batch, "path": str(path)}, f)
            cmd = [str(py), __file__, "--trl-child", str(f), "--rows", str(args.rows), "--micro", str(args.micro),
                   "--reps", str(args.reps), "--threads", str(args.threads)]
            out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ""})
        if out.returncode:
            print(out.stderr[-4000:], file=sys.stderr)
            raise SystemExit(f"the TRL child failed (exit {out.returncode}); see above")
        trl_info = json.loads(out.stdout.strip().splitlines()[-1])
        res["trl"] = trl_info["times"]
        print(f"trl   {[round(t, 3) for t in res['trl']]}", file=sys.stderr, flush=True)
    best = {k: min(v) for k, v in res.items()}
    ours_tps = tokens / best["ours"]
    rows = [Row("ours vs plain PyTorch", ours_tps, tokens / best["plain"], target=(">=", 0.9), unit="tok/s")]
    if "trl" in best:
        rows.append(Row("ours vs TRL GRPOTrainer", ours_tps, tokens / best["trl"], target=(">=", 1.0), unit="tok/s"))
    benchlib.print_table(rows, f"update_throughput: {args.model}, {args.rows} rows x ({args.prompt} + "
                               f"{args.completion}) tokens, micro-batch {args.micro}, fp32, {args.threads} thread(s), "
                               f"ZeRO-{args.zero}, best of {args.reps}")
    repeats = [{"side": side, "rep": i, "s": t, "tok_s": tokens / t} for side, ts in res.items() for i, t in enumerate(ts)]
    benchlib.write_results(run, rows, repeats, {"best_s": best, "trained_tokens": tokens, "trl": trl_info})
    return 0


if __name__ == "__main__":
    sys.exit(main())
