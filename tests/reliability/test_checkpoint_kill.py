"""SIGKILL during a checkpoint save, at every point of the save (``ckpt_child.KILL_POINTS``):
resume -- ``Tracker.latest_checkpoint`` and the loader ``restore_policy`` uses (``materialize``,
then ``from_pretrained``) -- picks the last complete checkpoint, never the partial one, and the
weights it loads are that checkpoint's; a re-run then saves the interrupted checkpoint cleanly.

The children are forked from a fork server that imported MLflow, torch and transformers once,
so a kill costs the fork and the save, not a fresh interpreter's imports each time."""

from __future__ import annotations

import re
import signal

import pytest
import torch
from transformers import AutoModelForCausalLM

import ckpt_child
from agentgym.registry.champion import materialize
from agentgym.tracking.tracker import TAG_CKPT, TAG_CKPT_STEP, Tracker
import checkpoints
from checkpoints import same_weights, variant, weights

pytestmark = pytest.mark.timeout(600)  # a hang guard (shared machines run it far slower)



def run_child(ctx, *args) -> int:
    return checkpoints.run_child(ctx, ckpt_child.log_checkpoints, *args, timeout=120)


def resumed(tracker: Tracker, tmp_path):
    """What a resumed run finds: the latest checkpoint's ref and its local folder."""
    ref = tracker.latest_checkpoint("ckpt")
    return ref, materialize(ref.artifact_uri, tracker.uri, tmp_path / "cache")


@pytest.mark.parametrize("kill_at", ckpt_child.KILL_POINTS)
def test_a_kill_during_a_checkpoint_save_resumes_from_the_last_complete_one(fork, mlflow_dir, tiny_path, kill_at):
    tmp_path = mlflow_dir
    folders = [str(variant(tiny_path, tmp_path / f"export-{s}", s)) for s in (1, 2, 3)]
    code = run_child(fork, str(tmp_path), folders, 1, kill_at)
    killed = code == -signal.SIGKILL
    # every kill point is reached; "between_tags" no longer exists once both tags go in one write
    assert killed or (kill_at == "between_tags" and code == 0), f"child exit code {code}"

    tracker = Tracker(f"sqlite:///{tmp_path}/mlflow.db", "reliability")
    ref, folder = resumed(tracker, tmp_path)
    expected = 2 if killed else 3
    assert ref.global_step == expected, (kill_at, ref)
    # the folder, its own record of the step and the tag agree: never the new folder paired
    # with the old step (which would resume at step 2 with step 3's weights)
    assert re.search(r"checkpoints/step-(\d+)$", ref.artifact_uri).group(1) == f"{expected:06d}", ref
    assert ref.meta["global_step"] == expected, ref.meta
    assert same_weights(weights(folder), weights(folders[expected - 1]))
    model = AutoModelForCausalLM.from_pretrained(folder)  # loadable as a model, not only present
    state = model.state_dict()
    saved = weights(folders[expected - 1])
    assert set(saved) <= set(state) and all(torch.equal(state[k], v) for k, v in saved.items())

    # the resumed run saves step 3 again, into the folder the killed attempt left half written
    assert run_child(fork, str(tmp_path), [folders[2]], 3, None) == 0
    ref, folder = resumed(tracker, tmp_path)
    assert ref.global_step == 3 and ref.meta["global_step"] == 3
    assert same_weights(weights(folder), weights(folders[2]))
    run = tracker.client.get_run(ref.stage_run_id)
    assert run.data.tags[TAG_CKPT] == "checkpoints/step-000003" and run.data.tags[TAG_CKPT_STEP] == "3"
