"""Render the column dictionary (docs/datasets.md) from the tables' Arrow schemas.

The schemas in ``agentgym.store.schema`` are the single source of truth (each column's
description is its field metadata): a test fails when the committed dictionary and the schemas
disagree; ``python -m agentgym.store.column_docs > docs/datasets.md`` regenerates it.
"""

from __future__ import annotations

import pyarrow as pa

from agentgym.store.schema import (
    ADDED_COLUMNS, PARTITION_KEYS, SCHEMAS, TABLE_DESCRIPTIONS, description, is_token_column,
)

REGENERATE = "python -m agentgym.store.column_docs > docs/datasets.md"

#: How turns written before ``turns.success`` / ``turns.horizon`` existed get them from their
#: episode (a pandas expression over ``turns`` and ``episodes`` frames; the test evaluates it).
JOIN = ('turns.drop(columns=["success", "horizon"]).merge(episodes[["stage", "iteration", '
        '"episode_id", "success", "horizon"]], on=["stage", "iteration", "episode_id"])')

INTRO = """\
# Datasets: the trajectory tables

Generated from `agentgym/store/schema.py` by `{regenerate}`; do not edit by hand.

Every run writes its trajectories as Parquet tables under `store.root` (the quickstart:
`trajectories/`), one folder per table, one Hive partition per iteration:
`{{store.root}}/{{run_id}}/{{table}}/stage={{s}}/iteration={{i}}/part-*.parquet`. An iteration
appears only once it is committed (`_commits/{{table}}/{{s}}-{{i}}.json` lists its files and
their sha256); a re-run never duplicates it.

## Reading them with pandas

```python
import pandas as pd
from agentgym.store.schema import dataset_columns, dataset_schema

run = "trajectories/<run_id>"
episodes = pd.read_parquet(f"{{run}}/episodes", schema=dataset_schema("episodes"),
                           columns=dataset_columns("episodes"))  # no token columns
turns = pd.read_parquet(f"{{run}}/turns", schema=dataset_schema("turns"),
                        filters=[("stage", "=", 1)])
```

- `schema=dataset_schema(table)` gives `stage` and `iteration` as integers. Without it pandas
  reads these partition keys (they are in the folder names only) as `category`: pyarrow
  discovers Hive keys as dictionaries, so `stage + 1` raises and `value_counts()` (or a
  `groupby(..., observed=False)`) lists stages the rows do not have.
  It also reads columns added to the schema later (marked *added* below) as null in older
  files, where pyarrow would otherwise drop them for the whole folder. Outside this project's
  environment, `partitioning=pyarrow.dataset.partitioning(flavor="hive")` gives the integers.
- `columns=dataset_columns(table)` leaves out the **token** columns (per-token arrays and token
  offsets: what the trainer reads, most of the bytes, one array per row);
  `dataset_columns(table, tokens=True)` lists them all.
- `turns` carries its episode's `success` and `horizon`. Turns written before those columns
  existed read them as null; their episode has them (episode ids are unique per iteration):
  `{join}`.
- The store's own reader gives the same columns and types, reads only committed files and
  checks their sha256: `TrajectoryStore("trajectories", "<run_id>").read_table("episodes",
  stage=1, columns=[...])` (`agentgym.store.trajectory_store`).

In the tables below, *null* marks a column that may hold nulls; *partition key* a column
stored in the folder names; *token* a token column; *added* a column added after the first
datasets were written (older files read as the default named, through the store's reader).
Files written since these descriptions exist also carry each one in their Arrow field metadata:
`pyarrow.parquet.read_schema(path).field("reward").metadata[b"description"]`.
"""


def _type(t: pa.DataType) -> str:
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return f"list<{_type(t.value_type)}>"
    return str(t)


def _marks(table: str, field: pa.Field) -> str:
    marks = []
    if field.name in PARTITION_KEYS:
        marks.append("partition key")
    if field.nullable:
        marks.append("null")
    if is_token_column(field):
        marks.append("token")
    added = ADDED_COLUMNS.get(table, {})
    if field.name in added:
        default = added[field.name]
        marks.append("added: older files read as " + ("null" if default is None else f"`{default!r}`"))
    return ", ".join(marks)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def datasets_markdown() -> str:
    out = [INTRO.format(regenerate=REGENERATE, join=JOIN)]
    for table, schema in SCHEMAS.items():
        out.append(f"## `{table}`\n")
        out.append(TABLE_DESCRIPTIONS[table] + "\n")
        out.append("| column | type | notes | description |\n|---|---|---|---|")
        for f in schema:
            out.append(f"| `{f.name}` | `{_type(f.type)}` | {_marks(table, f)} | {_cell(description(f))} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(datasets_markdown(), end="")
