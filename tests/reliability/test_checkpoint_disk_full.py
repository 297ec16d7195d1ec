"""Disk full while a checkpoint is saved, on a real tmpfs the kernel fills: in the MLflow artifact
store (the upload) and where the trainer writes its HF export and DeepSpeed state. The save fails
with ENOSPC naming the path; resume still finds the previous checkpoint, whole and loadable; no
partial checkpoint folder is left; with space again the same save succeeds."""

from __future__ import annotations

import errno

import pytest
from transformers import AutoTokenizer

from agentgym.config import AlgorithmConfig, TrainerConfig
from agentgym.registry.champion import materialize
from agentgym.training.policy_trainer import PolicyTrainer
from checkpoints import same_weights, stage_run, variant, weights
from diskfull import fill, tmpfs

pytestmark = pytest.mark.timeout(300)  # a hang guard


def test_a_full_artifact_store_keeps_the_previous_checkpoint(mlflow_dir, tiny_path):
    tmp_path = mlflow_dir
    with tmpfs("4m") as disk:
        tracker, stage = stage_run(tmp_path, artifact_location=(disk / "artifacts").as_uri())
        one, two = variant(tiny_path, tmp_path / "one", 1), variant(tiny_path, tmp_path / "two", 2)
        tracker.log_checkpoint(stage, one, 1)
        filler = fill(disk)

        with pytest.raises(OSError) as exc:
            tracker.log_checkpoint(stage, two, 2)
        msg = str(exc.value)
        assert exc.value.errno == errno.ENOSPC, msg
        assert msg.startswith("[Errno 28] No space left on device: checkpoint step 2"), msg
        assert str(disk / "artifacts") in msg and "tracking.artifact_location" in msg, msg

        ref = tracker.latest_checkpoint("ckpt")  # what resume follows
        assert ref.global_step == 1 and ref.meta["global_step"] == 1
        loaded = materialize(ref.artifact_uri, tracker.uri, tmp_path / "cache")
        assert same_weights(weights(loaded), weights(one))
        ckpts = next(disk.rglob("checkpoints"))
        assert sorted(p.name for p in ckpts.iterdir()) == ["step-000001"]  # no partial step 2

        filler.unlink()  # space again: the same save goes through
        tracker.log_checkpoint(stage, two, 2)
        ref = tracker.latest_checkpoint("ckpt")
        assert ref.global_step == 2 and ref.meta["global_step"] == 2
        assert same_weights(weights(materialize(ref.artifact_uri, tracker.uri, tmp_path / "cache")), weights(two))


def test_a_full_disk_under_the_trainer_export_names_it(tmp_path, tiny_path):
    """Without naming, safetensors says "Error while serializing: I/O error: No space left on
    device (os error 28)" (no path, not an OSError) and torch.save, under DeepSpeed's checkpoint,
    "[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"."""
    tok = AutoTokenizer.from_pretrained(tiny_path)
    tr = PolicyTrainer(tiny_path, tok, TrainerConfig(learning_rate=1e-3, bf16=False), AlgorithmConfig(), seed=0)
    with tmpfs("2m") as disk:
        filler = fill(disk)
        for what, save in (("HF export", lambda d: tr.save_hf(d, tok)),
                           ("trainer checkpoint", lambda d: tr.save_checkpoint(d, {"global_step": 1}))):
            with pytest.raises(OSError) as exc:
                save(disk / "ckpt")
            msg = str(exc.value)
            assert exc.value.errno == errno.ENOSPC and what in msg and str(disk / "ckpt") in msg, msg
            assert "No space left on device" in msg and "TMPDIR" in msg, msg
        filler.unlink()
        tr.save_hf(disk / "ok", tok)  # with space again
        assert same_weights(weights(disk / "ok"), weights(tiny_path))
