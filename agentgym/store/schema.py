"""The trajectory tables' Arrow schemas, their evolution rule (columns are only added), and
reading a Parquet shard against them (lossless casts, or ``SchemaMismatch`` naming the fix)."""

from __future__ import annotations

import logging
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq


log = logging.getLogger(__name__)


SCHEMA_VERSION = 1
PARTITION_KEYS = ("stage", "iteration")


#: Field metadata keys: what a column means (docs/datasets.md is generated from it), and the mark
#: of a token column (per-token arrays and token offsets: what the trainer reads, not people).
DESCRIPTION = "description"
TOKEN_COLUMN = "agentgym.token_column"


def _f(name: str, typ: pa.DataType, description: str, *, nullable: bool = False,
       token: bool = False) -> pa.Field:
    meta = {DESCRIPTION: " ".join(description.split())}
    if token:
        meta[TOKEN_COLUMN] = "true"
    return pa.field(name, typ, nullable=nullable, metadata=meta)


def _run_id() -> pa.Field:
    return _f("run_id", pa.string(), "The pipeline run id (the store folder `{store.root}/{run_id}`; "
              "MLflow tag `agentgym.run_id`). SFT demonstrations: their dataset id `demos-<hash>`.")


def _stage() -> pa.Field:
    return _f("stage", pa.int32(), "ScalingInter-RL stage, 0-based (`schedule.stages[stage]`). A "
              "partition key: stored in the folder name `stage=N` only, read as int32 with "
              "`schema=dataset_schema(table)`.")


def _iteration() -> pa.Field:
    return _f("iteration", pa.int32(), "Iteration within the stage, 0-based. A partition key like "
              "`stage` (folder `iteration=N`). SFT demonstrations: 0 training part, 1 held-out part.")


def _episode_id(what: str) -> pa.Field:
    return _f("episode_id", pa.string(), what)


def _action_columns(table: str) -> list[pa.Field]:
    """The constrained replies' candidates (``rollout.action_logprob: renormalised``)."""
    if table != "episodes":
        return [_f("action_starts", pa.list_(pa.int32()), "As `episodes.action_starts`.", nullable=True,
                   token=True),
                _f("action_candidates", pa.list_(pa.list_(pa.list_(pa.int32()))), "As "
                   "`episodes.action_candidates`.", nullable=True, token=True)]
    return [
        _f("action_starts", pa.list_(pa.int32()), "Offset in `input_ids` of each reply drawn among "
           "the turn's valid actions (`rollout.constrain_actions`), recorded under "
           "`rollout.action_logprob: renormalised`, whose `old_logprobs` there are renormalised over "
           "the candidates; null: not recorded (the default rule, free replies only, older files).",
           nullable=True, token=True),
        _f("action_candidates", pa.list_(pa.list_(pa.list_(pa.int32()))), "The candidates' reply "
           "token ids of each `action_starts` reply (the reply is one of them): what the trainer "
           "scores to recompute the normaliser; null with `action_starts`.", nullable=True, token=True),
    ]


EPISODES_SCHEMA = pa.schema(
    [
        _run_id(),
        _stage(),
        _iteration(),
        _f("global_step", pa.int32(), "Iterations before this one over all stages (0-based): the "
           "step of the run's MLflow metrics. 0 for demonstrations."),
        _episode_id("The episode, unique within an iteration. A rollout's is `s{global_step}-"
                    "g{group}-{env}-{task_id}-e{sample}` (`-d{draw}` before `-e` for a "
                    "dynamic-sampling redraw), e.g. `s23-g3-babyai-124-e0`: global step 23, group "
                    "3, BabyAI task 124, the group's first sample; a demonstration's "
                    "`demo-{k}-{env}-{task_id}-s{seed}`."),
        _f("group_id", pa.string(), "The group of episodes sampled for one task together "
           "(`rollout.group_size`), whose rewards GRPO/RLOO compare: the episode id up to `-e`."),
        _f("env", pa.string(), "Environment name (`envs[].name`, e.g. `babyai`, `textcraft`)."),
        _f("task_id", pa.int64(), "Task index within the environment (`envs[].tasks`)."),
        _f("seed", pa.int64(), "Seed the environment was reset with, with the task."),
        _f("horizon", pa.int32(), "Most turns the episode could take (the stage's horizon)."),
        _f("num_turns", pa.int32(), "Turns played: the episode's rows in `turns`."),
        _f("terminated", pa.bool_(), "The environment ended the episode (goal reached or a final "
           "state)."),
        _f("truncated", pa.bool_(), "The episode was cut before the environment ended it: the "
           "horizon reached, the adapter's own limit, or no room in the context for another turn."),
        _f("reward", pa.float64(), "Outcome reward in [0, 1] (the turns' rewards add up to it); NaN "
           "for an infra error (unscored, so `mean()` skips it)."),
        _f("success", pa.bool_(), "The environment reported success (`info[\"success\"]`)."),
        _f("infra_error", pa.bool_(), "The episode failed for the infrastructure (an environment "
           "that raised or went away), not the policy; left out of training."),
        _f("error", pa.string(), "The infra error's message; null otherwise.", nullable=True),
        _f("policy_version", pa.int64(), "Updates the sampling policy had received (0: the "
           "initial model; older than the update count under `rollout.async_steps`); -1 for "
           "demonstrations."),
        _f("created_at", pa.timestamp("us", tz="UTC"), "When the iteration's writer started (one "
           "value per iteration), UTC."),
        _f("input_ids", pa.list_(pa.int32()), "The whole conversation's token ids (system prompt, "
           "observations, replies).", token=True),
        _f("loss_mask", pa.list_(pa.int8()), "1 for each token the policy sampled (its replies), 0 "
           "otherwise; one per `input_ids` token.", token=True),
        _f("old_logprobs", pa.list_(pa.float32()), "The sampler's log-probability of each sampled "
           "token, 0 where `loss_mask` is 0; one per `input_ids` token.", token=True),
        _f("context_starts", pa.list_(pa.int32()), "Offsets in `input_ids` where a new context "
           "segment begins (`rollout.context_policy` window/summary); empty: one conversation.",
           token=True),
        *_action_columns("episodes"),
    ]
)

TURNS_SCHEMA = pa.schema(
    [
        _run_id(),
        _stage(),
        _iteration(),
        _episode_id("The episode this turn belongs to (`episodes.episode_id`)."),
        _f("env", pa.string(), "Environment name, as in `episodes`."),
        _f("task_id", pa.int64(), "Task index within the environment, as in `episodes`."),
        _f("turn", pa.int32(), "Turn index within the episode, 0-based."),
        _f("observation", pa.string(), "What the agent saw before replying."),
        _f("action_text", pa.string(), "The policy's reply, as text."),
        _f("parsed_action", pa.string(), "The action the adapter read from the reply; null when "
           "it read none.", nullable=True),
        _f("reward", pa.float64(), "This turn's reward: its increment of the episode's reward (an "
           "episode's turns add up to `episodes.reward`)."),
        _f("terminated", pa.bool_(), "The environment ended the episode at this turn."),
        _f("truncated", pa.bool_(), "The episode was cut at this turn (horizon, adapter limit, "
           "context full)."),
        _f("format_error", pa.bool_(), "The reply did not follow the action format."),
        _f("gen_tokens", pa.int32(), "Tokens the policy sampled for the reply."),
        _f("env_latency_ms", pa.float64(), "Wall time of the environment's step, in milliseconds."),
        _f("invalid_action", pa.bool_(), "A well-formed reply naming no available action."),
        _f("state_key", pa.string(), "The environment state the reply acted in (the adapter's "
           "`info[\"state_key\"]`, else `obs:` and a digest of the observation); GiGPO's step "
           "groups compare turns with equal keys."),
        _f("success", pa.bool_(), "The episode's success (`episodes.success`), on each of its "
           "turns.", nullable=True),
        _f("horizon", pa.int32(), "The episode's horizon (`episodes.horizon`), on each of its "
           "turns.", nullable=True),
    ]
)

# Additive schema evolution: columns added after datasets were first written, with the value a
# file written before them reads as (the rest of the schema is unchanged, so old commits stay
# readable without a rewrite). None: unknown, null (``turns.success``/``horizon``: an older
# file's episodes hold them, docs/datasets.md gives the join).
ADDED_COLUMNS: dict[str, dict[str, Any]] = {
    "turns": {"invalid_action": False, "state_key": "", "success": None, "horizon": None},
    "episodes": {"context_starts": [], "action_starts": None, "action_candidates": None},
    "train_batch": {"context_starts": [], "action_starts": None, "action_candidates": None},
}

ADVANTAGES_SCHEMA = pa.schema(
    [
        _run_id(),
        _stage(),
        _iteration(),
        _episode_id("The episode scored (`episodes.episode_id`; infra errors have no row)."),
        _f("estimator", pa.string(), "The advantage estimator (`algorithm.estimator`: grpo, rloo, "
           "reinforce_pp, gae)."),
        _f("advantages", pa.list_(pa.float32()), "Advantage of each token of the episode's "
           "`input_ids` (0 where `loss_mask` is 0).", token=True),
        _f("returns", pa.list_(pa.float32()), "Return of each token, 0 where `loss_mask` is 0: "
           "the episode's score (grpo, rloo), its discounted return (reinforce_pp), the critic's "
           "target (gae).", token=True),
    ]
)

# What an update trains on, exactly: one row per episode kept for the update (infra errors and
# skipped tied groups left out), in batch order. Written when a resident group of ranks trains,
# so that every rank reads the batch from the store instead of the driver's socket; empty
# ``returns`` / ``old_values`` lists mean "not given" (no critic; values computed by the trainer).
TRAIN_BATCH_SCHEMA = pa.schema(
    [
        _run_id(),
        _stage(),
        _iteration(),
        _episode_id("The episode trained on (`episodes.episode_id`), in batch order."),
        _f("input_ids", pa.list_(pa.int32()), "As `episodes.input_ids`.", token=True),
        _f("loss_mask", pa.list_(pa.int8()), "As `episodes.loss_mask`.", token=True),
        _f("old_logprobs", pa.list_(pa.float32()), "As `episodes.old_logprobs`.", token=True),
        _f("advantages", pa.list_(pa.float32()), "As `advantages.advantages`.", token=True),
        _f("returns", pa.list_(pa.float32()), "As `advantages.returns`; empty: not given.",
           token=True),
        _f("old_values", pa.list_(pa.float32()), "The critic's value of each token before the "
           "update (gae); empty: no critic.", token=True),
        _f("context_starts", pa.list_(pa.int32()), "As `episodes.context_starts`.", token=True),
        *_action_columns("train_batch"),
    ]
)

# The turns table's text columns: what ``read_episodes(turn_text=False)`` leaves out.
TURN_TEXT = ("observation", "action_text", "parsed_action")

SCHEMAS: dict[str, pa.Schema] = {
    "episodes": EPISODES_SCHEMA,
    "turns": TURNS_SCHEMA,
    "advantages": ADVANTAGES_SCHEMA,
    "train_batch": TRAIN_BATCH_SCHEMA,
}
TABLES = tuple(SCHEMAS)

#: What one row of each table is (docs/datasets.md).
TABLE_DESCRIPTIONS: dict[str, str] = {
    "episodes": "One row per episode played (rollouts, and SFT demonstrations under their own "
                "dataset id), committed with its turns.",
    "turns": "One row per turn of each episode: what the agent saw, what it replied, what it got.",
    "advantages": "One row per scored episode of an iteration: the advantage step's per-token "
                  "credit.",
    "train_batch": "The exact rows an update trained on (infra errors and tied groups without "
                   "signal left out), in batch order; every rank of a trainer group reads it.",
}


def description(field: pa.Field) -> str:
    """What a column means (its field metadata)."""
    return (field.metadata or {}).get(DESCRIPTION.encode(), b"").decode()


def is_token_column(field: pa.Field) -> bool:
    """A per-token array or token offsets: what the trainer reads, heavy and opaque for people."""
    return (field.metadata or {}).get(TOKEN_COLUMN.encode()) == b"true"


def dataset_schema(table: str) -> pa.Schema:
    """The schema to give pandas/pyarrow when reading a table folder:
    ``pd.read_parquet(path, schema=dataset_schema("turns"))``.

    Why: pandas reads the Hive partition keys ``stage`` / ``iteration`` as categoricals (pyarrow's
    ``pq.read_table`` discovers them with ``infer_dictionary=True``; nothing in the files can
    change that), and pyarrow takes a folder's schema from its first file, so a column added after
    that file was written (``ADDED_COLUMNS``) is silently dropped for every row. With this schema
    ``stage`` / ``iteration`` come back as int32 and every column is read, as null where a file
    lacks it."""
    return SCHEMAS[check_table(table)]


def dataset_columns(table: str, tokens: bool = False) -> list[str]:
    """``table``'s columns in schema order, without the token columns unless ``tokens``:
    ``pd.read_parquet(path, schema=..., columns=dataset_columns("episodes"))`` leaves out the
    token arrays (most of the bytes, one Python object per row) that only the trainer reads."""
    return [f.name for f in dataset_schema(table) if tokens or not is_token_column(f)]


def physical_schema(table: str) -> pa.Schema:
    """The schema of the Parquet files: the logical schema minus the partition keys."""
    schema = SCHEMAS[check_table(table)]
    for key in PARTITION_KEYS:
        schema = schema.remove(schema.get_field_index(key))
    return schema.with_metadata(
        {"agentgym.table": table, "agentgym.schema_version": str(SCHEMA_VERSION)}
    )


def check_table(table: str) -> str:
    if table not in SCHEMAS:
        raise ValueError(f"unknown table {table!r}; expected one of {list(SCHEMAS)}")
    return table


class StoreError(RuntimeError):
    """The store's contents are not what a manifest promised (corrupt manifest, missing file,
    digest or row-count mismatch)."""


class SchemaMismatch(StoreError):
    """A committed shard holds a column whose type differs from the table's schema and cannot
    be converted without loss (the schema only evolves by adding columns)."""


def read_parquet(data: bytes, columns: list[str], table: str, source: str = "<bytes>") -> pa.Table:
    """``columns`` of one Parquet file (``source`` names it in errors), typed as ``table``'s
    schema says.

    Schema evolution has two rules. Columns added to the schema after the file was written
    (``ADDED_COLUMNS``) read as their default. A column whose type in the file differs from
    the schema is converted when no value can change (``lossless``: a wider integer or float,
    string <-> large_string, ...); any other difference raises ``SchemaMismatch``, naming the
    column, the file, both types and the fix: a reader must never reinterpret values silently.
    """
    pf = pq.ParquetFile(pa.BufferReader(data))
    found = pf.schema_arrow
    schema = SCHEMAS[table]
    added = ADDED_COLUMNS.get(table, {})
    for c in columns:
        if c not in found.names and c not in added:
            raise pa.ArrowInvalid(f"column {c!r} is missing from the file")
    present = [c for c in columns if c in found.names]
    casts = {c: check_column_type(table, c, found.field(c).type, schema.field(c).type, source)
             for c in present}
    t = pf.read(columns=present)
    for c, cast in casts.items():
        if cast:
            i = t.schema.get_field_index(c)
            t = t.set_column(i, schema.field(c), t.column(i).cast(schema.field(c).type))
    for c in columns:
        if c not in found.names:
            f = schema.field(c)
            t = t.append_column(f, pa.repeat(pa.scalar(added[c], f.type), t.num_rows))
    return t.select(columns)


def check_column_type(table: str, column: str, found: pa.DataType, expected: pa.DataType,
                       source: str) -> bool:
    """Whether ``column`` needs a cast to ``expected``; raises ``SchemaMismatch`` when the
    file's type cannot be converted without loss."""
    if found == expected:
        return False
    if lossless(found, expected):
        return True
    raise SchemaMismatch(
        f"incompatible column type in {source}: {table}.{column} should be {expected}, the file "
        f"has {found} (no lossless conversion). The store's schema only evolves by adding "
        f"columns (agentgym.store.trajectory_store.ADDED_COLUMNS), so this file was written by another schema "
        f"or tool. To fix: rewrite the file with {column} converted to {expected} (e.g. "
        f"pq.write_table(t.set_column(i, field, t[{column!r}].cast(...)), path)) and put its new "
        f"sha256 in the commit manifest under _commits/{table}/; or read it with the code version "
        f"that wrote it; a column whose meaning changed needs a new name, not a new type."
    )


def lossless(found: pa.DataType, expected: pa.DataType) -> bool:
    """Whether every value of type ``found`` converts to ``expected`` unchanged (widening only:
    no parse from text, no narrowing that would depend on the values)."""
    if found == expected:
        return True
    t = pa.types
    if t.is_dictionary(found):  # e.g. a pandas categorical: its values decide
        return lossless(found.value_type, expected)
    if t.is_integer(found) and t.is_integer(expected):
        if t.is_signed_integer(expected):
            return found.bit_width < expected.bit_width or (
                t.is_signed_integer(found) and found.bit_width == expected.bit_width)
        return t.is_unsigned_integer(found) and found.bit_width <= expected.bit_width
    if t.is_floating(found) and t.is_floating(expected):
        return found.bit_width <= expected.bit_width
    for group in ((t.is_string, t.is_large_string), (t.is_binary, t.is_large_binary)):
        if any(f(found) for f in group) and any(f(expected) for f in group):
            return True
    is_list = lambda x: t.is_list(x) or t.is_large_list(x)  # noqa: E731
    if is_list(found) and is_list(expected):
        return lossless(found.value_type, expected.value_type)
    if t.is_timestamp(found) and t.is_timestamp(expected):
        order = ["s", "ms", "us", "ns"]  # a coarser unit converts exactly to a finer one
        return found.tz == expected.tz and order.index(found.unit) <= order.index(expected.unit)
    return False


def as_list(v: Any) -> list:
    """A sequence (list, tuple, numpy array, tensor) as a plain list."""
    return v.tolist() if hasattr(v, "tolist") else list(v)
