"""What ``rollout.action_logprob: renormalised`` costs an update: the same batch of constrained
BabyAI episodes trained with the policy's own log-probs and with the renormalised ones (the
candidates scored as a token tree in the same forward, ``agentgym/training/action_logprob.py``).

    .venv/bin/python bench/action_logprob_cost.py --model smollm2 --repeats 5
    .venv/bin/python bench/action_logprob_cost.py --model tiny --repeats 5
    .venv/bin/python bench/action_logprob_cost.py --smoke          # the tiny model, one repeat

The episodes are played once (the quickstart's reply format: ``Action:`` forced, stop at the
newline, every reply drawn among the valid actions, ``observation_style: compact``); then one
PPO update (1 epoch, 1 mini-batch, micro-batches of 1 as the quickstart) with each rule,
alternated, ``--repeats`` times each. Reported: the median seconds per update of each rule and
their ratio, and the tokens behind it: the conversations' tokens, the tree nodes the renormalised
rule adds to the forward and backward, and the rows that go through the LM head (sampled tokens;
plus the tree nodes). Writes ``bench/results/action_logprob_cost-<tag>.json`` (``results_io``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import results_io  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    p.add_argument("--episodes", type=int, default=8)
    p.add_argument("--horizon", type=int, default=5)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--train-layers", type=int, default=None,
                   help="trainer.train_layers (default: 8 for smollm2, as the quickstart; all for tiny)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--smoke", action="store_true", help="the tiny model, 2 episodes, 1 repeat (git-ignored record)")
    results_io.add_tag_argument(p)
    args = p.parse_args()
    if args.smoke:
        args.model, args.episodes, args.repeats, args.horizon = "tiny", 2, 1, 3
    if args.train_layers is None and args.model == "smollm2":
        args.train_layers = 8
    run = results_io.Run("action_logprob_cost", args)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentgym.batch import EpisodeBatch
    from agentgym.chat import ChatFormatter
    from agentgym.config import AlgorithmConfig, TrainerConfig
    from agentgym.models.folders import resolve_model
    from agentgym.rollout.engines.hf import HFEngine
    from agentgym.rollout.loop import EpisodeSpec, RolloutSettings, run_episodes
    from agentgym.training.action_logprob import candidate_plan
    from agentgym.training.batch import TrainBatch
    from agentgym.training.policy_trainer import PolicyTrainer
    from env_adapters import make_env

    torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(path)
    engine = HFEngine(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), tok)
    fmt = ChatFormatter(tok, response_prefix="Action:")
    specs = [EpisodeSpec("babyai", t, 0, f"g{t}", f"e{t}", {"observation_style": "compact"})
             for t in range(args.episodes)]
    settings = RolloutSettings(horizon=args.horizon, max_new_tokens=12, seed=0, stop=["\n"],
                               system_prompt="You are in a grid world. Reach the goal. Each turn, reply with "
                               "one of the available actions.", constrain_actions=True,
                               action_logprob="renormalised")
    eps = run_episodes(engine, fmt, specs, settings, make_env)
    engine.close()
    adv = [[(1.0 if i % 2 else -1.0) * m for m in e.loss_mask] for i, e in enumerate(eps)]
    renorm = EpisodeBatch.from_episodes(eps).with_columns(advantages=adv).padded(tok.pad_token_id or 0)
    plain = TrainBatch(**renorm.tensors())  # the same rows without their candidates: the policy rule
    assert renorm.choices is not None
    nodes = 0
    for i in range(len(renorm)):  # micro-batches of one row: the tree each forward adds
        row = renorm.select([i]).trimmed()
        plan = candidate_plan(row.input_ids, row.attention_mask, row.loss_mask, row.choices or [])
        nodes += plan.input_ids.shape[1] - row.input_ids.shape[1]
    tokens = int(renorm.attention_mask.sum())
    sampled = int(renorm.loss_mask.sum())
    turns = sum(len(c) for c in renorm.choices)
    cands = sum(len(cs) for row in renorm.choices for _, cs in row)

    trainer = PolicyTrainer(path, tok, TrainerConfig(learning_rate=1e-6, micro_batch_size=1, bf16=False,
                                                     train_layers=args.train_layers),
                            AlgorithmConfig(), seed=0)
    trainer.train_on_batch(plain)  # warm-up of both paths (allocator, first-call costs)
    trainer.train_on_batch(renorm)
    repeats = []
    for k in range(args.repeats):
        order = [("policy", plain), ("renormalised", renorm)]
        if k % 2:
            order.reverse()
        for rule, batch in order:
            t0 = time.perf_counter()
            m = trainer.train_on_batch(batch)
            repeats.append({"repeat": k, "rule": rule, "update_s": time.perf_counter() - t0,
                            "ratio_mean": m.get("ratio_mean"), "loss": m.get("loss")})
            print(f"repeat {k} {rule:>12}: {repeats[-1]['update_s']:.3f} s", flush=True)
    med = {rule: statistics.median(r["update_s"] for r in repeats if r["rule"] == rule)
           for rule in ("policy", "renormalised")}
    results = {"median_update_s": med, "renormalised_over_policy": med["renormalised"] / med["policy"],
               "episodes": len(eps), "turns": turns, "candidates": cands, "tokens": tokens,
               "sampled_tokens": sampled, "tree_nodes": nodes,
               "forward_tokens_ratio": (tokens + nodes) / tokens,
               "lm_head_rows_ratio": (sampled + nodes) / max(sampled, 1)}
    print(f"{args.model}: {len(eps)} episodes, {turns} constrained turns, {cands} candidates; {tokens} tokens "
          f"(+{nodes} tree nodes, x{results['forward_tokens_ratio']:.2f} forward tokens, "
          f"x{results['lm_head_rows_ratio']:.2f} LM-head rows)")
    print(f"update: policy {med['policy']:.3f} s, renormalised {med['renormalised']:.3f} s "
          f"(x{results['renormalised_over_policy']:.2f}, medians of {args.repeats})")
    print(f"record: {run.write(repeats, results)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
