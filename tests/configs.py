"""The tiny-model configs the tests share (tests/ is on sys.path): one pipeline config base, each
test's differences deep-merged over it, and the trainer settings the trainer tests start from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agentgym.config import AlgorithmConfig, PipelineConfig, TrainerConfig, parse_config


class _Default:
    def __repr__(self) -> str:
        return "DEFAULT"


#: an override value that removes the key from the base: the library's default applies
DEFAULT: Any = _Default()


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """A new dict: ``over`` merged into ``base``. Dicts merge key by key, any other value (lists
    included) replaces the base's, and a :data:`DEFAULT` value removes the key."""
    out = dict(base)
    for key, value in over.items():
        if value is DEFAULT:
            out.pop(key, None)
        elif isinstance(value, dict):
            below = out.get(key)
            out[key] = deep_merge(below if isinstance(below, dict) else {}, value)
        else:
            out[key] = value
    return out


def keyword_env(**fields: Any) -> dict[str, Any]:
    """The base's environment, a new dict: keyword tasks 0-2 with a dense single-turn reward (the
    share of "aeiou"'s characters in the reply); ``fields`` replace its own."""
    return {"name": "keyword", "tasks": [0, 1, 2], "kwargs": {"target": "aeiou", "mode": "char_share"}, **fields}


def tiny_config(model_cache: str | None, *, store_root: str | Path | None = None,
                tracking_dir: str | Path | None = None, **overrides: Any) -> dict[str, Any]:
    """A raw pipeline config that trains in seconds: the tiny model in float32 (built into
    ``model_cache``; None: the library's cache), fp32 training at lr 1e-3, :func:`keyword_env`,
    2 tasks x 2 samples of at most 6 tokens, one stage of one single-turn iteration.
    ``store_root``: the trajectory store's root; ``tracking_dir``: MLflow in
    ``<tracking_dir>/mlflow.db``. ``overrides`` (top-level fields) are deep-merged over it
    (:func:`deep_merge`; :data:`DEFAULT` removes a key)."""
    base: dict[str, Any] = {
        "seed": 0,
        "model": {"name_or_path": "tiny", "dtype": "float32"},
        "envs": [keyword_env()],
        "rollout": {"tasks_per_iteration": 2, "group_size": 2, "max_new_tokens": 6},
        "trainer": {"learning_rate": 1e-3, "bf16": False},
        "schedule": {"stages": [{"horizon": 1, "iterations": 1}]},
    }
    if model_cache is not None:
        base["model"]["cache_dir"] = model_cache
    if store_root is not None:
        base["store"] = {"root": str(store_root)}
    if tracking_dir is not None:
        base["tracking"] = {"tracking_uri": f"sqlite:///{tracking_dir}/mlflow.db"}
    return deep_merge(base, overrides)


def parse_tiny_config(model_cache: str | None, **kw: Any) -> PipelineConfig:
    """:func:`tiny_config`, validated."""
    return parse_config(tiny_config(model_cache, **kw))


def tiny_trainer(**kw: Any) -> TrainerConfig:
    """fp32 training at lr 1e-3 (a tiny model moves visibly in a few steps); ``kw`` overrides."""
    return TrainerConfig(**{"learning_rate": 1e-3, "bf16": False, **kw})


def rank_group_configs(**kw: Any) -> tuple[TrainerConfig, AlgorithmConfig]:
    """A two-rank ZeRO-2 group of micro-batches of 2 (:func:`tiny_trainer`; ``kw`` overrides),
    and two mini-batches in one PPO epoch: the distributed tests' trainer and algorithm."""
    trainer = tiny_trainer(**{"zero_stage": 2, "micro_batch_size": 2, "world_size": 2, **kw})
    return trainer, AlgorithmConfig(mini_batches=2, ppo_epochs=1)
