"""SFT epoch checkpoints (``Tracker.log_sft_epoch_checkpoint``, what ``tasks/sft.py`` logs after
each epoch and resumes from) under the faults of the RL checkpoints: a real ``SIGKILL`` at each
point of the save, and a real full disk (tmpfs) under the artifact store. Resume -- the tag
``tasks/sft.py`` follows (``sft_epoch_checkpoint``), ``materialize``, ``from_pretrained`` -- finds
the last complete epoch with its exact weights, never the partial one; a re-run saves the
interrupted epoch cleanly (the file set and bytes of its export, nothing torn left behind)."""

from __future__ import annotations

import errno
import filecmp
import signal
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import ckpt_child
from agentgym.registry.champion import materialize
from agentgym.tracking.tracker import TAG_SFT_EPOCH
import checkpoints
from checkpoints import same_weights, variant, weights
from diskfull import fill, tmpfs

pytestmark = pytest.mark.timeout(600)  # a hang guard (shared machines run it far slower)



def run_child(ctx, *args) -> int:
    return checkpoints.run_child(ctx, ckpt_child.log_sft_epochs, *args, timeout=120)


def resumed(db_dir: Path) -> tuple[int, Path]:
    """What a resumed SFT stage finds (as ``tasks/sft.py``): the epoch and its local folder."""
    tracker, run = ckpt_child.sft_run(db_dir)
    uri, epoch = tracker.sft_epoch_checkpoint(run)
    assert uri.endswith(f"/sft/epoch-{epoch:02d}"), uri
    return epoch, Path(materialize(uri, tracker.uri, db_dir / "cache"))


def assert_loads_as(folder: Path, expected: Path) -> None:
    assert same_weights(weights(folder), weights(expected))
    state = AutoModelForCausalLM.from_pretrained(folder).state_dict()  # a model, not only files
    saved = weights(expected)
    assert set(saved) <= set(state) and all(torch.equal(state[k], v) for k, v in saved.items())


def artifact_folder(db_dir: Path, epoch: int) -> Path:
    return next((db_dir / "mlartifacts").rglob(f"sft/epoch-{epoch:02d}"))


@pytest.mark.parametrize("kill_at", ckpt_child.SFT_KILL_POINTS)
def test_a_kill_during_an_sft_epoch_checkpoint_resumes_from_the_last_complete_epoch(fork, mlflow_dir, tiny_path, kill_at):
    db = mlflow_dir
    folders = [str(variant(tiny_path, db / f"epoch-{e}", e + 1)) for e in (0, 1, 2)]
    code = run_child(fork, str(db), folders, 0, kill_at)
    assert code == -signal.SIGKILL, f"child exit code {code}"

    epoch, folder = resumed(db)
    assert epoch == 1, (kill_at, epoch)  # epochs 0 and 1 complete, 2 killed
    assert_loads_as(folder, Path(folders[1]))

    # the resumed stage trains epoch 2 again and saves it over what the killed attempt left
    assert run_child(fork, str(db), [folders[2]], 2, None) == 0
    epoch, folder = resumed(db)
    assert epoch == 2
    assert_loads_as(folder, Path(folders[2]))
    saved = artifact_folder(db, 2)
    cmp = filecmp.dircmp(folders[2], saved)
    assert not cmp.left_only and not cmp.right_only and not cmp.diff_files, (cmp.right_only, cmp.diff_files)
    assert filecmp.cmpfiles(folders[2], saved, [p.name for p in Path(folders[2]).iterdir()], shallow=False)[1:] == ([], [])


def test_a_full_disk_during_an_sft_epoch_checkpoint_keeps_the_previous_epoch(mlflow_dir, tiny_path):
    db = mlflow_dir
    one, two = variant(tiny_path, db / "epoch-0", 1), variant(tiny_path, db / "epoch-1", 2)
    with tmpfs("4m") as disk:
        from agentgym.tracking.tracker import Tracker

        tracker = Tracker(f"sqlite:///{db}/mlflow.db", "reliability", artifact_location=(disk / "artifacts").as_uri())
        parent = tracker.pipeline_run("ckpt", {"run_id": "ckpt"})
        run = tracker.sft_run(parent, "ckpt", {"epochs": 4})
        tracker.log_sft_epoch_checkpoint(run, one, 0)
        filler = fill(disk)

        with pytest.raises(OSError) as exc:
            tracker.log_sft_epoch_checkpoint(run, two, 1)
        msg = str(exc.value)
        assert exc.value.errno == errno.ENOSPC, msg
        assert msg.startswith("[Errno 28] No space left on device: SFT epoch 1 checkpoint"), msg
        assert str(disk / "artifacts") in msg and "tracking.artifact_location" in msg, msg
        assert tracker.client.get_run(run).data.tags[TAG_SFT_EPOCH] == "0"  # not published

        uri, epoch = tracker.sft_epoch_checkpoint(run)
        assert epoch == 0
        assert_loads_as(Path(materialize(uri, tracker.uri, db / "cache")), one)
        sft = next(disk.rglob("sft"))
        assert sorted(p.name for p in sft.iterdir()) == ["epoch-00"]  # the partial epoch-01 removed

        filler.unlink()  # space again: the same save goes through
        tracker.log_sft_epoch_checkpoint(run, two, 1)
        uri, epoch = tracker.sft_epoch_checkpoint(run)
        assert epoch == 1
        assert_loads_as(Path(materialize(uri, tracker.uri, db / "cache")), two)
