"""SIGKILL during a checkpoint upload to a real S3 server (SeaweedFS, ``tests/seaweed.py``): the
killed upload leaves objects under the untagged ``checkpoints/step-000003`` prefix (at
``mid_upload`` a torn ``model.safetensors`` among them); resume -- ``latest_checkpoint``, then
``materialize`` downloading from S3, then ``from_pretrained`` -- ignores that prefix and loads
step 2's exact weights; a re-run uploads step 3 over the partial prefix and resume then loads it."""

from __future__ import annotations

import signal

import pytest
import torch
from transformers import AutoModelForCausalLM

import ckpt_child
from agentgym.registry.champion import materialize
from agentgym.tracking.tracker import Tracker
import checkpoints
from checkpoints import same_weights, variant, weights

pytestmark = pytest.mark.timeout(600)  # a hang guard (shared machines run it far slower)



def run_child(ctx, *args) -> int:
    return checkpoints.run_child(ctx, ckpt_child.log_s3_checkpoints, *args, timeout=180)


def objects(s3, prefix: str) -> dict[str, int]:
    import s3fs

    fs = s3fs.S3FileSystem(**s3["storage_options"])
    return {p.rsplit("/", 1)[1]: fs.size(p) for p in fs.find(f"{s3['location'][len('s3://'):]}") if prefix in p}


@pytest.mark.parametrize("kill_at", ckpt_child.S3_KILL_POINTS)
def test_a_kill_during_an_s3_checkpoint_upload_resumes_from_the_last_complete_one(fork, s3, mlflow_dir, tiny_path, kill_at):
    tmp_path = mlflow_dir
    folders = [str(variant(tiny_path, tmp_path / f"export-{s}", s)) for s in (1, 2, 3)]
    code = run_child(fork, s3["env"], s3["location"], str(tmp_path), folders, 1, kill_at)
    assert code == -signal.SIGKILL, f"child exit code {code}"
    partial = objects(s3, "/checkpoints/step-000003/")
    assert "model.safetensors" in partial, partial  # the killed upload left objects behind
    if kill_at == "mid_upload":  # ... a torn one among them
        assert partial["model.safetensors"] < (tmp_path / "export-3" / "model.safetensors").stat().st_size

    tracker = Tracker(f"sqlite:///{tmp_path}/mlflow.db", "reliability")
    ref = tracker.latest_checkpoint("ckpt")
    assert ref.global_step == 2 and ref.meta["global_step"] == 2, ref
    assert ref.artifact_uri.startswith(s3["location"]) and ref.artifact_uri.endswith("/checkpoints/step-000002")
    folder = materialize(ref.artifact_uri, tracker.uri, tmp_path / "cache")  # downloaded from S3
    assert same_weights(weights(folder), weights(folders[1]))
    state = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    assert all(torch.equal(state[k], v) for k, v in weights(folders[1]).items())

    # the resumed run uploads step 3 again, over the partial prefix
    assert run_child(fork, s3["env"], s3["location"], str(tmp_path), [folders[2]], 3, None) == 0
    ref = tracker.latest_checkpoint("ckpt")
    assert ref.global_step == 3 and ref.artifact_uri.endswith("/checkpoints/step-000003")
    assert same_weights(weights(materialize(ref.artifact_uri, tracker.uri, tmp_path / "cache")), weights(folders[2]))
