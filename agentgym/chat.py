"""Multi-turn conversations as token ids, built incrementally from *any* HF chat template.

The rollout never decodes a reply and re-encodes it (that drifts: BPE merges across the
reply/template boundary differ). Instead the conversation is a growing list of ids:

    start(system, obs0)  -> prompt ids (mask 0), ending in the assistant generation prompt
    <sampled reply ids>  -> appended as-is (mask 1)
    glue(obs, ended)     -> ids that close the assistant turn, add the next user turn and open
                            the next assistant turn (mask 0)

The glue is derived from the tokenizer's own template by rendering a probe conversation with
and without the extra turn and taking the difference, so ChatML, Llama-3 style, SmolLM2's or
any other template works without hard-coding (AgentGym-RL hard-codes Qwen's).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import cast

from transformers import PreTrainedTokenizerBase

_PROBE_USER = "\u2063probe-user\u2063"
_PROBE_REPLY = "\u2063probe-reply\u2063"
# a user turn and its reply: rendered closed, it shows what the template puts around turns
_PROBE = ({"role": "user", "content": _PROBE_USER}, {"role": "assistant", "content": _PROBE_REPLY})


class ChatTemplateError(ValueError):
    """The tokenizer's chat template cannot be extended turn by turn."""


@dataclass
class ChatFormatter:
    tokenizer: PreTrainedTokenizerBase
    response_prefix: str = ""

    def __post_init__(self) -> None:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ChatTemplateError(
                "the tokenizer has no chat_template; set tokenizer.chat_template or use an "
                "instruct model folder that ships one"
            )

    # -- template probing -------------------------------------------------------------
    def _render(self, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        # tokenize=False: the rendered text (transformers types every return mode together)
        return cast(str, self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        ))

    def _encode(self, text: str) -> list[int]:
        # apply_chat_template itself tokenizes with add_special_tokens=False: do the same.
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    @staticmethod
    def _base(system: str | None) -> list[dict[str, str]]:
        return [{"role": "system", "content": system}] if system else []

    @cached_property
    def assistant_suffix(self) -> str:
        """Text the template puts after an assistant message's content (e.g. '<|im_end|>\\n')."""
        text = self._closed_probe
        if _PROBE_REPLY not in text:
            raise ChatTemplateError("chat template drops assistant content; cannot build turns")
        return text[text.index(_PROBE_REPLY) + len(_PROBE_REPLY):]

    @cached_property
    def end_of_turn_ids(self) -> list[int]:
        """Token ids whose sampling ends a reply: the template's closing special token and EOS."""
        ids: list[int] = []
        special = set(self.tokenizer.all_special_tokens) | set(
            getattr(self.tokenizer, "added_tokens_encoder", {}) or {}
        )
        for tok in sorted(special, key=len, reverse=True):
            if tok and self.assistant_suffix.startswith(tok):
                ids.append(cast(int, self.tokenizer.convert_tokens_to_ids(tok)))  # one token: one id
                break
        if self.tokenizer.eos_token_id is not None and self.tokenizer.eos_token_id not in ids:
            ids.append(self.tokenizer.eos_token_id)
        return ids

    # -- building conversations ---------------------------------------------------------
    def start(self, system: str | None, observation: str) -> list[int]:
        """Prompt ids for the first turn, ending where the model's reply begins."""
        text = self._render(self._base(system) + [{"role": "user", "content": observation}], True)
        return self._encode(text + self.response_prefix)

    def glue(self, observation: str, reply_ended_turn: bool) -> list[int]:
        """Ids between a finished reply and the next reply.

        ``reply_ended_turn``: the sampled reply already ends with the template's end-of-turn
        token, so only the rest of the assistant suffix is added (a reply cut by a stop
        string or the token budget gets the whole suffix).
        """
        closed = self._closed_probe
        extended = self._render([*_PROBE, {"role": "user", "content": observation}], True)
        if not extended.startswith(closed):
            raise ChatTemplateError(
                "chat template re-renders earlier turns when a turn is added; incremental "
                "multi-turn tokenization is impossible with it"
            )
        return self._suffix_ids[reply_ended_turn] + self._encode(extended[len(closed):] + self.response_prefix)

    @cached_property
    def _closed_probe(self) -> str:
        """The probe conversation (a user turn and a reply) rendered closed: the part of every
        ``glue`` rendering that comes before the new observation, and where ``assistant_suffix``
        is read (rendered once, not per turn)."""
        return self._render(list(_PROBE), False)

    @cached_property
    def _suffix_ids(self) -> dict[bool, list[int]]:
        """The ids that close an assistant turn, by ``reply_ended_turn`` (the whole assistant
        suffix, or what follows the end-of-turn token the reply already ends with): encoded
        once, not per episode per turn (the rollout glues every live episode every turn)."""
        suffix = ended = self.assistant_suffix
        eot = cast(str, self.tokenizer.convert_ids_to_tokens(self.end_of_turn_ids[0]))  # one id: one token
        if suffix.startswith(eot):
            ended = suffix[len(eot):]
        return {False: self._encode(suffix), True: self._encode(ended)}

    def action_reply_ids(self, action: str, stop: list[str]) -> list[int]:
        """The token ids of the reply that says ``action``, as the policy is trained to write it.

        * with a ``response_prefix`` (e.g. ``"Action:"``, forced by the rollout): `` <action>``
          followed by the first stop string (``"\\n"``) when the rollout stops on one -- what the
          engine returns when it stops there -- else by the end-of-turn token;
        * without one: AgentGym's ReAct lines ``Thought:\\n...\\n\\nAction:\\n<action>`` and the
          end-of-turn token.

        Expert demonstrations are written this way, and action-constrained decoding scores
        exactly these ids for each valid action.
        """
        tok = self.tokenizer
        if self.response_prefix:
            sep = "" if self.response_prefix.endswith((" ", "\n")) else " "
            text = sep + action
            if stop:
                return list(tok(text + stop[0], add_special_tokens=False)["input_ids"])
            return list(tok(text, add_special_tokens=False)["input_ids"]) + self.end_of_turn_ids[:1]
        text = f"Thought:\nI will {action}.\n\nAction:\n{action}"
        return list(tok(text, add_special_tokens=False)["input_ids"]) + self.end_of_turn_ids[:1]

    def ends_turn(self, token_ids: list[int]) -> bool:
        return bool(token_ids) and token_ids[-1] in self.end_of_turn_ids

    def reply_text(self, token_ids: list[int]) -> str:
        """The reply as the environment sees it: forced prefix + decoded sampled tokens."""
        ids = token_ids[:-1] if self.ends_turn(token_ids) else token_ids
        # one sequence of ids decodes to one str
        return self.response_prefix + cast(str, self.tokenizer.decode(ids, skip_special_tokens=True))
