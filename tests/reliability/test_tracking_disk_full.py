"""Disk full, on a real tmpfs the kernel fills, under the MLflow tracking database (SQLite) and
under the model cache.

* Tracking DB: the pipeline's metric and tag writes fail with ENOSPC naming the DB and
  ``tracking.tracking_uri`` (MLflow alone raised an SQLAlchemy "database or disk is full" with
  the SQL and its parameters); the DB stays readable and holds exactly what was logged before
  (SQLite rolled the failed write back); with space, the resumed run logs the failed step once.
* Model cache: building a model folder (``agentgym models prepare`` / ``tiny_model_path``) and
  downloading a checkpoint (``materialize``) on a full disk fail with ENOSPC naming the folder
  and ``model.cache_dir`` (safetensors alone: "Error while serializing: I/O error"); no folder,
  partial or staging, is left that a later call could take for a complete one; with space the
  same call succeeds.
"""

from __future__ import annotations

import errno
import sqlite3

import pytest

from agentgym.models.folders import tiny_model_path
from agentgym.registry.champion import materialize
from agentgym.tracking.tracker import TAG_DONE, Tracker
from checkpoints import same_weights, weights
from diskfull import fill, tmpfs

pytestmark = pytest.mark.timeout(300)  # a hang guard


def test_a_full_tracking_database_fails_clearly_and_stays_readable(_mlflow_template, tmp_path):
    with tmpfs("8m") as disk:
        db = disk / "mlflow.db"
        db.write_bytes(_mlflow_template.read_bytes())
        uri = f"sqlite:///{db}"
        tracker = Tracker(uri, "reliability", artifact_location=(tmp_path / "artifacts").as_uri())
        parent = tracker.pipeline_run("full-db", {"run_id": "full-db"})
        stage = tracker.stage_run(parent, "full-db", 0, horizon=1, iterations=3)
        metrics = {f"m{i}": float(i) for i in range(40)} | {"reward_mean": 0.5}
        for step in (0, 1):  # what the pipeline logs per iteration (stage and pipeline runs)
            tracker.log_metrics_once([stage, parent], metrics, step=step)
        filler = fill(disk)

        for write in (lambda: tracker.log_metrics_once([stage, parent], metrics, step=2),
                      lambda: tracker.finish_stage(stage)):
            with pytest.raises(OSError) as exc:
                write()
            msg = str(exc.value)
            assert exc.value.errno == errno.ENOSPC, msg
            assert msg.startswith(f"[Errno 28] No space left on device: the MLflow tracking database {db}"), msg
            assert "tracking.tracking_uri" in msg and "INSERT" not in msg, msg

        # readable, by MLflow and by SQLite itself, and holding exactly steps 0 and 1
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        assert con.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        con.close()
        fresh = Tracker(uri, "reliability")
        assert fresh.logged_steps(stage) == {0, 1} == fresh.logged_steps(parent)
        assert len(fresh.client.get_metric_history(stage, "m3")) == 2
        assert TAG_DONE not in fresh.client.get_run(stage).data.tags
        assert sorted(p.name for p in disk.iterdir()) == ["filler.bin", "mlflow.db"]  # no journal left

        filler.unlink()  # space again: the resumed run logs step 2 once and finishes the stage
        again = Tracker(uri, "reliability")
        again.log_metrics_once([stage, parent], metrics, step=2)
        again.log_metrics_once([stage, parent], metrics, step=2)  # a retry does not double it
        again.finish_stage(stage)
        assert [m.step for m in again.client.get_metric_history(stage, "m3")] == [0, 1, 2]
        assert again.stage_finished("full-db", 0)


def test_a_full_model_cache_fails_clearly_and_leaves_nothing(tmp_path, mlflow_dir, tiny_path):
    with tmpfs("400k") as disk:  # smaller than the tiny model's folder, so building it fills the disk
        cache = disk / "models"
        with pytest.raises(OSError) as exc:
            tiny_model_path(cache)
        msg = str(exc.value)
        assert exc.value.errno == errno.ENOSPC, msg
        assert msg.startswith("[Errno 28] No space left on device: model folder tiny-chatml-v1"), msg
        assert str(cache) in msg and "model.cache_dir" in msg, msg
        assert list(cache.iterdir()) == []  # no staging folder, no final folder

        # a checkpoint download into the same full cache (what resume does first)
        tracker = Tracker(f"sqlite:///{mlflow_dir}/mlflow.db", "reliability")
        run = tracker.pipeline_run("cache", {"run_id": "cache"})
        tracker.client.log_artifacts(run, str(tiny_path), "checkpoints/step-000001")
        uri = f"runs:/{run}/checkpoints/step-000001"  # downloaded (a local file:// one is used in place)
        with pytest.raises(OSError) as exc:
            materialize(uri, tracker.uri, cache)
        msg = str(exc.value)
        assert exc.value.errno == errno.ENOSPC and uri in msg and "model.cache_dir" in msg, msg
        assert list((cache / "checkpoints").iterdir()) == []  # no .dl-* folder, no final folder

    with tmpfs("4m") as disk:  # with space, the same calls succeed
        built = tiny_model_path(disk / "models")
        assert same_weights(weights(built), weights(tiny_path))
        assert same_weights(weights(materialize(uri, tracker.uri, disk / "models")), weights(tiny_path))
