"""Forward passes the trainer differentiates: token log-probs (and entropy, accuracy) of a policy
and values of a critic, computed from one pass over the transformer."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedModel

from agentgym import algorithms as A

from agentgym.training.action_logprob import RowChoices, candidate_plan
from agentgym.training.batch import TrainBatch

if TYPE_CHECKING:
    from peft import PeftModel

    # the policy: a transformers causal LM, or with LoRA peft's model around one
    Policy = PreTrainedModel | PeftModel


def values_from_hidden(value_head: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """Values (B, T) float32: ``V[:, t] = head(hidden[:, t - 1])``, the value of the prefix the
    token at ``t`` was sampled from (aligned with ``token_logprobs``); 0 at position 0."""
    v = value_head(hidden[:, :-1]).squeeze(-1).float()
    out = torch.zeros(hidden.shape[:2], dtype=v.dtype, device=v.device)
    out[:, 1:] = v
    return out


def token_logprobs(
    model: Policy, batch: TrainBatch, temperature: float, with_entropy: bool, action_temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (B, T) of each token given its prefix, 0 at position 0 and masked positions.

    Only the hidden states of policy tokens go through the LM head (the vocabulary projection
    dominates memory for long multi-turn conversations).
    """
    lp, ent, _, _ = policy_forward(model, batch, temperature, with_entropy, action_temperature=action_temperature)
    return lp, ent


def policy_forward(
    model: Policy, batch: TrainBatch, temperature: float, with_entropy: bool,
    value_head: torch.nn.Module | None = None, with_accuracy: bool = False, entropy_grad: bool = True,
    action_temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``token_logprobs`` plus, given a value head, the values (B, T) from the same hidden states,
    and with ``with_accuracy`` a (B, T) float tensor, 1 where the token is the policy's argmax
    (0 at masked positions): the token accuracy of supervised fine-tuning. ``entropy_grad``
    False: the entropy is a metric only (no graph kept for it).

    A batch with ``choices`` (``rollout.action_logprob: renormalised``) gets the log-probs of its
    constrained replies renormalised over their candidates, in the same forward: the candidates
    are appended to each row as a token tree (``agentgym.training.action_logprob``), at the
    choice temperature ``action_temperature`` (``rollout.action_temperature``). Entropy,
    values and accuracy stay those of the conversation's tokens."""
    core = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    head = model.get_output_embeddings()
    plan = None
    if batch.choices is not None and any(batch.choices):
        plan = candidate_plan(batch.input_ids, batch.attention_mask, batch.loss_mask, batch.choices)
        dtype = core.get_input_embeddings().weight.dtype
        hidden_all = core(input_ids=plan.input_ids, attention_mask=plan.attention_mask(dtype, batch.input_ids.device),
                          position_ids=plan.position_ids).last_hidden_state
        hidden = hidden_all[:, : plan.width]
    else:
        hidden = core(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
    values = values_from_hidden(value_head, hidden) if value_head is not None else None
    target_mask = batch.loss_mask[:, 1:].bool()  # token t+1 is predicted from position t
    h = hidden[:, :-1][target_mask]
    logits = head(h).float() / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    targets = batch.input_ids[:, 1:][target_mask]
    lp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
    out = torch.zeros(batch.input_ids.shape, dtype=lp.dtype, device=lp.device)
    out[:, 1:][target_mask] = lp
    if plan is not None:  # the candidates' tree nodes (and any position past a chosen reply)
        extra = torch.cat([hidden_all[plan.node_rows, plan.node_cols], hidden[plan.extra_rows, plan.extra_cols]])
        out = plan.renormalise(out, logp_all, torch.log_softmax(head(extra).float() / temperature, dim=-1),
                               action_temperature)
    ent = None
    if with_entropy:
        # from the log-probs at hand: one pass over the vocabulary instead of softmax + logsumexp
        # (the LM head is most of a small model's compute; bench/README.md measures the difference)
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            ent_tok = A.entropy_from_logprobs(logp_all)
        ent = torch.zeros_like(out)
        ent[:, 1:][target_mask] = ent_tok
    correct = None
    if with_accuracy:
        correct = torch.zeros_like(out)
        correct[:, 1:][target_mask] = (logits.argmax(-1) == targets).to(out.dtype)
    return out, ent, values, correct


class LogprobModel(torch.nn.Module):
    """What the DeepSpeed engine wraps: the policy, with ``token_logprobs`` as its forward.

    The forward must run through ``engine(...)``: DeepSpeed does per-micro-batch bookkeeping
    there (ZeRO-3 counts micro-steps to accumulate rather than overwrite gradient partitions,
    and hooks the outputs to start each backward). Calling the policy's submodules directly
    silently dropped accumulated gradients under ZeRO-3."""

    def __init__(self, policy: Policy, value_head: torch.nn.Module | None = None):
        super().__init__()
        self.policy = policy
        if value_head is not None:  # critic.model=shared: a value head on the policy's trunk
            self.value_head = value_head

    def forward(self, input_ids, attention_mask, loss_mask, temperature: float, with_entropy: bool,
                with_values: bool = False, with_accuracy: bool = False, entropy_grad: bool = True,
                choices: list[RowChoices] | None = None, action_temperature: float = 1.0):
        batch = TrainBatch(input_ids, attention_mask, loss_mask, loss_mask, loss_mask, choices=choices)
        lp, ent, values, correct = policy_forward(self.policy, batch, temperature, with_entropy,
                                                   self.value_head if with_values else None, with_accuracy,
                                                   entropy_grad, action_temperature)
        out = (lp, ent, values) if with_values else (lp, ent)
        return out + (correct,) if with_accuracy else out


class ValueModel(torch.nn.Module):
    """critic.model=separate: a transformer (the base model without its LM head) plus a linear
    value head; what the critic's DeepSpeed engine wraps (forward: values (B, T))."""

    def __init__(self, trunk: torch.nn.Module, value_head: torch.nn.Module):
        super().__init__()
        self.trunk = trunk
        self.value_head = value_head

    def forward(self, input_ids, attention_mask):
        hidden = self.trunk(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return values_from_hidden(self.value_head, hidden)
