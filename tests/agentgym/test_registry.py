"""Model registry: champion decisions, versions and aliases, and model references -> local folders."""

import math
from pathlib import Path

import pytest

from agentgym.registry.champion import CHAMPION, ModelRegistry, decide, materialize, parse_models_uri
from agentgym.tracking.tracker import Tracker


def test_decide_rule():
    first = decide(0.1, None, margin=0.5)
    assert first.promote and first.label == "promoted" and "no champion" in first.reason
    assert decide(0.5, 0.5).promote  # ties promote with margin 0 (challenger >= champion + 0)
    assert not decide(0.5, 0.5, margin=0.01).promote
    assert decide(0.56, 0.5, margin=0.05).promote and not decide(0.54, 0.5, margin=0.05).promote
    assert decide(0.4, 0.5, margin=-0.2).promote  # a negative margin tolerates a small regression
    assert not decide(math.nan, 0.5).promote  # nothing scored: keep the champion
    assert decide(0.0, math.nan).promote  # the champion scored nothing


def test_parse_models_uri():
    assert parse_models_uri("models:/agentgym-policy@champion") == ("agentgym-policy", None, "champion")
    assert parse_models_uri("models:/agentgym-policy/3") == ("agentgym-policy", "3", None)
    with pytest.raises(ValueError):
        parse_models_uri("models:/just-a-name")


@pytest.fixture()
def logged(tmp_path, tiny_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    from mlflow.tracking import MlflowClient

    MlflowClient(uri).create_experiment("registry-test", artifact_location=(tmp_path / "artifacts").as_uri())
    tracker = Tracker(uri, "registry-test")
    run = tracker.client.create_run(tracker.experiment_id).info.run_id
    ckpt = tracker.log_checkpoint(run, tiny_path, step=4)
    return uri, run, ckpt, tmp_path


def test_register_alias_and_materialize(logged, tiny_path, model_cache):
    uri, run, ckpt, tmp = logged
    reg = ModelRegistry(uri)
    assert reg.champion("policy") is None  # no model yet
    v1 = reg.register("policy", ckpt, run_id=run, tags={"agentgym.score": 0.25})
    assert reg.champion("policy") is None  # registered, not yet champion
    reg.set_alias("policy", v1.version)
    v2 = reg.register("policy", ckpt, run_id=run)
    champ = reg.champion("policy")
    assert str(champ.version) == str(v1.version) and champ.tags["agentgym.score"] == "0.25"
    reg.set_alias("policy", v2.version, CHAMPION)
    assert str(reg.champion("policy").version) == str(v2.version)
    assert [str(v.version) for v in reg.versions("policy")] == ["1", "2"]

    cache = tmp / "cache"
    for ref in (ckpt, "models:/policy@champion", "models:/policy/1", f"file://{ckpt.removeprefix('file://')}"):
        path = materialize(ref, uri, cache)
        assert (path / "config.json").is_file() and (path / "model.safetensors").is_file(), ref
        assert (path / "agentgym_checkpoint.json").is_file()
    assert materialize(str(tiny_path), uri, cache) == Path(tiny_path).resolve()
    assert materialize("tiny", uri, model_cache) == Path(tiny_path)
    with pytest.raises(ValueError, match=r"models:/policy@nope: no such registered model version.*eval champion --name policy"):
        materialize("models:/policy@nope", uri, cache)
    with pytest.raises(ValueError, match="no such registered model version"):
        materialize("models:/nobody/1", uri, cache)
    with pytest.raises(ValueError, match="cannot resolve model"):
        materialize("no-such-model", uri, cache)


def test_materialize_downloads_a_runs_uri_once(logged):
    uri, run, _, tmp = logged
    ref = f"runs:/{run}/checkpoints/step-000004"
    a = materialize(ref, uri, tmp / "cache")
    assert (a / "config.json").is_file() and str(a).startswith(str(tmp / "cache"))
    (a / "marker").write_text("x")
    assert materialize(ref, uri, tmp / "cache") == a and (a / "marker").exists()  # cached
