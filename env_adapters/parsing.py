"""The ReAct ``Action:`` line, as the BabyAI, TextCraft, SciWorld and TextWorldExpress adapters
read it from a model reply.

:func:`parse_action` does the part they share: a reply that is not text or is longer than
``max_chars`` is refused; end-of-sequence tokens (``</s>``, ``<|im_end|>``, ``<|endoftext|>``,
``<|eot_id|>``) count as line breaks; the action is the first non-empty line after the *last*
``Action:`` marker (any case, spaces allowed before the colon); a reply without the marker is
taken whole only when it is a single non-empty line (AgentGym sends such a reply as is). Each
adapter then applies its own ``normalise`` to that line; an empty result is refused.
"""

from __future__ import annotations

import re
from collections.abc import Callable

EOS_TOKENS = ("</s>", "<|im_end|>", "<|endoftext|>", "<|eot_id|>")
_MARKER = re.compile(r"action\s*:", flags=re.IGNORECASE)


def parse_action(reply: str, max_chars: int,
                 normalise: Callable[[str], str]) -> tuple[str | None, str]:
    """``(normalise(action line), "")``, or ``(None, why)`` for a reply with no usable action."""
    if not isinstance(reply, str):
        return None, "the reply is not text"
    if len(reply) > max_chars:
        return None, f"the reply is longer than {max_chars} characters"
    text = reply
    for eos in EOS_TOKENS:
        text = text.replace(eos, "\n")
    markers = list(_MARKER.finditer(text))
    if markers:
        tail = text[markers[-1].end():]
    elif len([ln for ln in text.splitlines() if ln.strip()]) == 1:
        tail = text
    else:
        return None, 'no "Action:" line'
    line = next((ln for ln in tail.splitlines() if ln.strip()), "")
    action = normalise(line)
    if not action:
        return None, 'nothing after "Action:"'
    return action, ""


def simulator_command(line: str) -> str:
    """SciWorld's and TextWorldExpress's normalisation: lower case, ``[a-z0-9 -]`` only (drops a
    trailing period, quotes, markdown), single spaces, no dash or space at either end."""
    return " ".join(re.sub(r"[^a-z0-9\- ]+", " ", line.lower()).split()).strip(" -")
