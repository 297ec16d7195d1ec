"""The trajectory tables as people read them: pandas dtypes, the token columns left out, turns
with their episode's success and horizon, and the column dictionary (docs/datasets.md) against
the schemas."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from agentgym.store.column_docs import JOIN, REGENERATE, datasets_markdown
from agentgym.store.manifest import combined_digest
from agentgym.store.schema import (
    ADDED_COLUMNS, PARTITION_KEYS, SCHEMAS, dataset_columns, description, is_token_column,
)
from agentgym.store.trajectory_store import TrajectoryStore
from agentgym.types import Episode, Turn

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "datasets.md"
RUN = "run-ds"


def episode(stage: int, i: int, *, horizon: int, success: bool, n_turns: int) -> Episode:
    ep = Episode(episode_id=f"s{stage}-g{i // 2}-babyai-{i}-e{i % 2}", group_id=f"s{stage}-g{i // 2}",
                 env="babyai", task_id=i, seed=i, horizon=horizon)
    ep.append([1, 2, 3], sampled=False)
    for t in range(n_turns):
        ep.append([10 + t, 11], sampled=True, logprobs=[-0.5, -0.25])
        ep.append([4, 5], sampled=False)
        ep.turns.append(Turn(turn=t, observation=f"obs {t}", action_text="go", parsed_action="go",
                             reward=1.0 if success and t == n_turns - 1 else 0.0,
                             terminated=success and t == n_turns - 1, truncated=False,
                             format_error=False, gen_tokens=2, env_latency_ms=0.1))
    ep.reward, ep.success, ep.terminated = float(success), success, success
    ep.truncated = not success
    return ep


def write_run(root: Path) -> tuple[TrajectoryStore, list[Episode]]:
    """A run's store as the pipeline leaves it: stages 0, 1, 3 (the partitions of stage 2 are
    absent on purpose), horizons growing by stage, written by the project's own writers."""
    store = TrajectoryStore(str(root), RUN)
    everything = []
    step = 0
    for stage in (0, 1, 3):
        for it in (0, 1):
            eps = [episode(stage * 10 + it, i, horizon=2 + stage, success=(i + stage) % 3 == 0,
                           n_turns=1 + (i % (2 + stage))) for i in range(5)]
            with store.episode_writer(stage=stage, iteration=it, global_step=step, policy_version=step,
                                      chunk_episodes=2) as w:
                w.extend(eps)
                w.commit()
            everything += [(stage, it, e) for e in eps]
            step += 1
    return store, everything


def python_blocks(markdown: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", markdown, flags=re.S)


def run_documented_read(doc: Path, store: TrajectoryStore) -> dict:
    """Execute the pandas snippet a doc gives (the one reading the store), on ``store``."""
    (code,) = [b for b in python_blocks(doc.read_text()) if "trajectories/<run_id>" in b]
    base = str(Path(store.path("episodes")).parent)
    scope: dict = {}
    exec(code.replace("trajectories/<run_id>", base), scope)  # noqa: S102 - our own docs
    return scope


# ---------------------------------------------------------------------------- dtypes
@pytest.mark.parametrize("doc", ["README.md", "docs/datasets.md"])
def test_the_documented_pandas_read_gives_integer_stage_and_iteration(tmp_path, doc):
    store, _ = write_run(tmp_path / "store")
    scope = run_documented_read(ROOT / doc, store)
    episodes, turns = scope["episodes"], scope["turns"]
    for df in (episodes, turns):
        for key in PARTITION_KEYS:
            assert pd.api.types.is_integer_dtype(df[key].dtype), (doc, key, df[key].dtype)
    assert sorted(episodes["stage"].unique()) == [0, 1, 3] and len(episodes) == 30
    assert sorted((episodes["stage"] + 1).unique()) == [1, 2, 4]  # arithmetic works
    # the documented filter keeps stage 1 only, and nothing counts the stages it left out
    assert set(turns["stage"]) == {1}
    assert turns["stage"].value_counts().index.tolist() == [1]
    assert turns.groupby("stage", observed=False).size().index.tolist() == [1]
    assert episodes.groupby(["stage", "iteration"]).size().tolist() == [5] * 6


def test_plain_pandas_gives_categories_which_is_why_the_docs_pass_a_schema(tmp_path):
    """What the docs explain: pyarrow reads Hive partition keys as dictionaries. If a pyarrow
    release changes that, this fails and the paragraph in docs/datasets.md can go."""
    store, _ = write_run(tmp_path / "store")
    plain = pd.read_parquet(store.path("episodes"), filters=[("stage", "=", 1)])
    assert isinstance(plain["stage"].dtype, pd.CategoricalDtype)
    assert plain["stage"].value_counts().index.tolist() != [1]  # empty stages listed
    ints = pd.read_parquet(store.path("episodes"), filters=[("stage", "=", 1)],
                           partitioning=ds.partitioning(flavor="hive"))
    assert ints["stage"].dtype == np.int32  # the pyarrow-only way the doc names


def test_the_documented_read_leaves_out_the_token_columns_and_keeps_the_rest(tmp_path):
    store, _ = write_run(tmp_path / "store")
    episodes = run_documented_read(ROOT / "README.md", store)["episodes"]
    tokens = {"input_ids", "loss_mask", "old_logprobs", "context_starts", "action_starts", "action_candidates"}
    assert list(episodes.columns) == [c for c in SCHEMAS["episodes"].names if c not in tokens]
    assert not [c for c in episodes.columns if episodes[c].dtype == object]  # no arrays per row
    assert set(dataset_columns("episodes", tokens=True)) - set(dataset_columns("episodes")) == tokens
    assert dataset_columns("turns") == SCHEMAS["turns"].names  # turns have no token column
    assert dataset_columns("train_batch") == ["run_id", "stage", "iteration", "episode_id"]
    # the trainer's reads keep them
    assert store.read_episodes(1, 0)[0].input_ids
    assert "input_ids" in store.read_table("episodes", stage=0, iteration=0).columns


# ---------------------------------------------------------------------------- turns
def test_every_turn_carries_its_episodes_success_and_horizon(tmp_path):
    store, written = write_run(tmp_path / "store")
    want = {(s, it, e.episode_id): (e.success, e.horizon, e.num_turns) for s, it, e in written}
    assert len({v[:2] for v in want.values()}) >= 4  # both outcomes, several horizons
    for turns in (store.read_table("turns"),
                  pd.read_parquet(store.path("turns"), schema=store.dataset_schema("turns"))):
        assert turns["success"].dtype == bool and pd.api.types.is_integer_dtype(turns["horizon"])
        assert len(turns) == sum(n for _, _, n in want.values())
        for (s, it, eid), rows in turns.groupby(["stage", "iteration", "episode_id"]):
            success, horizon, _ = want[(s, it, eid)]
            assert rows["success"].tolist() == [success] * len(rows), eid
            assert rows["horizon"].tolist() == [horizon] * len(rows), eid
    # the same values the episodes table holds, row for row after a join
    episodes = store.read_table("episodes")
    turns = store.read_table("turns")
    joined = turns.merge(episodes[["stage", "iteration", "episode_id", "success", "horizon"]],
                         on=["stage", "iteration", "episode_id"], suffixes=("", "_episode"))
    assert len(joined) == len(turns)
    assert (joined["success"] == joined["success_episode"]).all()
    assert (joined["horizon"] == joined["horizon_episode"]).all()


def _drop_from_turns_shards(store_root: Path, columns: list[str]) -> None:
    """Rewrite every committed turns shard as a writer from before ``columns`` existed left it,
    re-hashed in its manifests (turns' own and the copy embedded in episodes')."""
    base = store_root / RUN
    for commit in sorted((base / "_commits" / "episodes").glob("*.json")):
        ep_m = json.loads(commit.read_text())
        own = base / "_commits" / "turns" / commit.name
        turns_m = ep_m["extra"]["turns"]
        for rel in turns_m["files"]:
            f = base / rel
            pq.write_table(pq.read_table(f).drop_columns(columns), f)
            turns_m["sha256"][rel] = hashlib.sha256(f.read_bytes()).hexdigest()
        turns_m["digest"] = combined_digest(turns_m["sha256"])
        commit.write_text(json.dumps(ep_m))
        own.write_text(json.dumps(turns_m))


def test_turns_written_before_success_and_horizon_read_as_null_and_the_documented_join_fills_them(tmp_path):
    store, written = write_run(tmp_path / "store")
    _drop_from_turns_shards(tmp_path / "store", ["success", "horizon"])
    assert "success" not in pq.read_schema(next((tmp_path / "store").rglob("turns/**/part-*"))).names

    old = store.read_table("turns")
    assert old["success"].isna().all() and old["horizon"].isna().all() and len(old) > 0
    raw = pd.read_parquet(store.path("turns"), schema=store.dataset_schema("turns"))
    assert raw["success"].isna().all() and len(raw) == len(old)
    assert [e.turns for e in store.read_episodes(0, 0)] == \
        [e.turns for s, it, e in written if (s, it) == (0, 0)]  # the trainer's read is unchanged

    turns = raw
    episodes = pd.read_parquet(store.path("episodes"), schema=store.dataset_schema("episodes"))
    filled = eval(JOIN)  # noqa: S307 - the expression docs/datasets.md prints
    assert JOIN in DOC.read_text()
    assert len(filled) == len(turns) and filled.columns.tolist()[-2:] == ["success", "horizon"]
    want = {(s, it, e.episode_id): (e.success, e.horizon) for s, it, e in written}
    got = {(r.stage, r.iteration, r.episode_id): (r.success, r.horizon) for r in filled.itertuples()}
    assert got == want


# ---------------------------------------------------------------------------- the column dictionary
def test_the_column_dictionary_is_current():
    assert DOC.read_text() == datasets_markdown(), f"run: {REGENERATE}"


def _doc_tables(text: str) -> dict[str, list[list[str]]]:
    """Each ``## `table` `` section's rows, as cells, read back from the markdown."""
    out: dict[str, list[list[str]]] = {}
    current = None
    for line in text.splitlines():
        m = re.match(r"## `(\w+)`$", line)
        if m:
            current = out.setdefault(m.group(1), [])
        elif current is not None and line.startswith("| `"):
            current.append([c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]])
    return out


def test_the_column_dictionary_lists_exactly_the_schemas_columns():
    """Read back from docs/datasets.md, independently of the generator: every table, every
    column in schema order with its Arrow type, nullability, token mark and description."""
    tables = _doc_tables(DOC.read_text())
    assert list(tables) == list(SCHEMAS)
    for table, schema in SCHEMAS.items():
        rows = tables[table]
        assert [r[0] for r in rows] == [f"`{f.name}`" for f in schema], table
        for row, f in zip(rows, schema):
            name, typ, notes, text = row
            assert typ == f"`{str(f.type).replace('item: ', '')}`", (table, f.name)
            marks = [m.split(":")[0].strip() for m in notes.split(",") if m.strip()]
            assert ("null" in marks) == f.nullable, (table, f.name, notes)
            assert ("token" in marks) == is_token_column(f), (table, f.name, notes)
            assert ("partition key" in marks) == (f.name in PARTITION_KEYS), (table, f.name)
            assert ("added" in marks) == (f.name in ADDED_COLUMNS.get(table, {})), (table, f.name)
            assert text.replace("\\|", "|") == description(f), (table, f.name)


def test_every_column_has_a_description_and_token_columns_are_arrays():
    for table, schema in SCHEMAS.items():
        for f in schema:
            assert len(description(f)) >= 15, f"{table}.{f.name} has no description"
            if is_token_column(f):
                assert pa.types.is_list(f.type), f"{table}.{f.name}"
        assert [f.name for f in schema if pa.types.is_list(f.type) and not is_token_column(f)] == [], table


def test_new_files_carry_the_descriptions(tmp_path):
    store, _ = write_run(tmp_path / "store")
    f = next((tmp_path / "store" / RUN / "turns").rglob("part-*.parquet"))
    field = pq.read_schema(f).field("success")
    assert field.metadata[b"description"].decode() == description(SCHEMAS["turns"].field("success"))
