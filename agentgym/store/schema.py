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


def _f(name: str, typ: pa.DataType, nullable: bool = False) -> pa.Field:
    return pa.field(name, typ, nullable=nullable)


EPISODES_SCHEMA = pa.schema(
    [
        _f("run_id", pa.string()),
        _f("stage", pa.int32()),
        _f("iteration", pa.int32()),
        _f("global_step", pa.int32()),
        _f("episode_id", pa.string()),
        _f("group_id", pa.string()),
        _f("env", pa.string()),
        _f("task_id", pa.int64()),
        _f("seed", pa.int64()),
        _f("horizon", pa.int32()),
        _f("num_turns", pa.int32()),
        _f("terminated", pa.bool_()),
        _f("truncated", pa.bool_()),
        _f("reward", pa.float64()),
        _f("success", pa.bool_()),
        _f("infra_error", pa.bool_()),
        _f("error", pa.string(), nullable=True),
        _f("policy_version", pa.int64()),
        _f("created_at", pa.timestamp("us", tz="UTC")),
        _f("input_ids", pa.list_(pa.int32())),
        _f("loss_mask", pa.list_(pa.int8())),
        _f("old_logprobs", pa.list_(pa.float32())),
        _f("context_starts", pa.list_(pa.int32())),
    ]
)

TURNS_SCHEMA = pa.schema(
    [
        _f("run_id", pa.string()),
        _f("stage", pa.int32()),
        _f("iteration", pa.int32()),
        _f("episode_id", pa.string()),
        _f("env", pa.string()),
        _f("task_id", pa.int64()),
        _f("turn", pa.int32()),
        _f("observation", pa.string()),
        _f("action_text", pa.string()),
        _f("parsed_action", pa.string(), nullable=True),
        _f("reward", pa.float64()),
        _f("terminated", pa.bool_()),
        _f("truncated", pa.bool_()),
        _f("format_error", pa.bool_()),
        _f("gen_tokens", pa.int32()),
        _f("env_latency_ms", pa.float64()),
        _f("invalid_action", pa.bool_()),
        _f("state_key", pa.string()),
    ]
)

# Additive schema evolution: columns added after datasets were first written, with the value a
# file written before them reads as (the rest of the schema is unchanged, so old commits stay
# readable without a rewrite).
ADDED_COLUMNS: dict[str, dict[str, Any]] = {
    "turns": {"invalid_action": False, "state_key": ""},
    "episodes": {"context_starts": []},
    "train_batch": {"context_starts": []},
}

ADVANTAGES_SCHEMA = pa.schema(
    [
        _f("run_id", pa.string()),
        _f("stage", pa.int32()),
        _f("iteration", pa.int32()),
        _f("episode_id", pa.string()),
        _f("estimator", pa.string()),
        _f("advantages", pa.list_(pa.float32())),
        _f("returns", pa.list_(pa.float32())),
    ]
)

# What an update trains on, exactly: one row per episode kept for the update (infra errors and
# skipped tied groups left out), in batch order. Written when a resident group of ranks trains,
# so that every rank reads the batch from the store instead of the driver's socket; empty
# ``returns`` / ``old_values`` lists mean "not given" (no critic; values computed by the trainer).
TRAIN_BATCH_SCHEMA = pa.schema(
    [
        _f("run_id", pa.string()),
        _f("stage", pa.int32()),
        _f("iteration", pa.int32()),
        _f("episode_id", pa.string()),
        _f("input_ids", pa.list_(pa.int32())),
        _f("loss_mask", pa.list_(pa.int8())),
        _f("old_logprobs", pa.list_(pa.float32())),
        _f("advantages", pa.list_(pa.float32())),
        _f("returns", pa.list_(pa.float32())),
        _f("old_values", pa.list_(pa.float32())),
        _f("context_starts", pa.list_(pa.int32())),
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
