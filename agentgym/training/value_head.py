"""The critic's value head: a zero-initialised linear layer, and where an export keeps it."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch


CRITIC_DIR = "critic"  # the critic's subfolder in exports and trainer checkpoints
VALUE_HEAD_FILE = "value_head.safetensors"
log = logging.getLogger(__name__)


def new_value_head(hidden_size: int) -> torch.nn.Linear:
    """Zero-initialised: every value starts at 0 (rewards are in [0, 1]), deterministically."""
    head = torch.nn.Linear(hidden_size, 1)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.zero_()
    return head


def read_critic_folder(model_path: str | Path, mode: str) -> Path | None:
    """The ``critic/`` folder an export wrote beside the policy, if it holds a ``mode`` critic."""
    folder = Path(model_path) / CRITIC_DIR
    meta_file = folder / "critic.json"
    if not meta_file.is_file():
        return None
    saved = json.loads(meta_file.read_text()).get("model")
    if saved != mode:
        log.warning("%s holds a %r critic but algorithm.critic.model is %r: starting a fresh critic",
                    folder, saved, mode)
        return None
    return folder


def load_value_head(head: torch.nn.Linear, folder: Path) -> None:
    from safetensors.torch import load_file

    state = load_file(str(folder / VALUE_HEAD_FILE))
    head.load_state_dict({k: v.to(head.weight.dtype) for k, v in state.items()})
