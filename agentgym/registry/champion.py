"""Model registry: the policy checkpoints that graduate, and the ``champion`` alias.

Pure ``MlflowClient`` (no Prefect). A registered model version's ``source`` is a checkpoint's
artifact URI (an HF folder logged by :meth:`agentgym.tracking.tracker.Tracker.log_checkpoint`; the retrain
flow) or the storage location of the pyfunc model that ``agentgym.registry.policy_model`` logs from one
(``tracking.registered_model_name``; the HF folder sits inside it); the alias ``champion`` names the version that serves and that the
next retraining starts from.

``materialize(ref)`` turns any model reference into a local HF folder:

* ``tiny`` / ``smollm2`` (built or prepared locally), or a local folder with ``config.json``;
* ``models:/<name>@<alias>`` or ``models:/<name>/<version>`` (resolved with *this* tracking
  URI, which ``mlflow.artifacts.download_artifacts`` would not do);
* any MLflow artifact URI (``runs:/...``, ``file://...``, ``mlflow-artifacts:/...``, ``s3://...``,
  or the plain path a local artifact store reports).

Downloads are cached under ``<cache_dir>/checkpoints/<sha256 of the URI>`` (published by an
atomic rename), so evaluating the same checkpoint twice downloads it once. Versions are immutable,
which makes the cache safe; an alias is resolved to its version first, so a moved alias is seen.
"""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException

from agentgym.infra.diskspace import disk_errors
from agentgym.models.folders import resolve_model
from agentgym.tracking.db_full import guarded
from agentgym.tracking.open_client import open_client

CHAMPION = "champion"
TAG_DECISION = "agentgym.decision"
TAG_SCORE = "agentgym.score"
TAG_CHAMPION_SCORE = "agentgym.champion_score"


def _is_hf_folder(p: Path) -> bool:
    return p.is_dir() and (p / "config.json").is_file()


def parse_models_uri(uri: str) -> tuple[str, str | None, str | None]:
    """``models:/name@alias`` -> (name, None, alias); ``models:/name/3`` -> (name, "3", None)."""
    if not uri.startswith("models:/"):
        raise ValueError(f"{uri!r} is not a models:/ URI")
    body = uri[len("models:/"):].strip("/")
    if "@" in body:
        name, alias = body.rsplit("@", 1)
        return name, None, alias
    if "/" in body:
        name, version = body.rsplit("/", 1)
        return name, version, None
    raise ValueError(f"{uri!r}: use models:/<name>@<alias> or models:/<name>/<version>")


def _find_hf_folder(root: Path) -> Path:
    if _is_hf_folder(root):
        return root
    found = sorted(p.parent for p in root.rglob("config.json"))
    if not found:
        raise ValueError(f"{root} holds no Hugging Face model folder (no config.json)")
    return found[0]


def materialize(ref: str, tracking_uri: str, cache_dir: str | os.PathLike = "~/.cache/agentgym/models") -> Path:
    """A local HF folder for the model reference ``ref`` (see the module docstring)."""
    ref = str(ref)
    local = Path(os.path.expanduser(ref.removeprefix("file://")))
    if "://" not in ref.removeprefix("file://") and not ref.startswith(("models:/", "runs:/")):
        if _is_hf_folder(local):
            return local.resolve()
        if not local.exists():
            return resolve_model(ref, cache_dir)  # a model name, or its helpful error
    uri = ref
    client = open_client(tracking_uri, registry_uri=tracking_uri)
    if ref.startswith("models:/"):
        name, version, alias = parse_models_uri(ref)
        try:
            if alias is not None:
                mv = client.get_model_version_by_alias(name, alias)
            else:
                assert version is not None  # parse_models_uri returns an alias or a version
                mv = client.get_model_version(name, version)
        except MlflowException as e:
            raise ValueError(
                f"{ref}: no such registered model version in {tracking_uri} ({e.error_code}); list "
                f"what is there with `agentgym eval champion --name {name}` or the MLflow UI") from None
        if not mv.source:
            raise ValueError(f"{ref}: the registered model version in {tracking_uri} has no source")
        uri = mv.source
        if Path(uri.removeprefix("file://")).is_dir():  # a checkpoint, or a logged model holding one
            return _find_hf_folder(Path(uri.removeprefix("file://")).resolve())
    root = Path(os.path.expanduser(str(cache_dir))) / "checkpoints"
    final = root / hashlib.sha256(uri.encode()).hexdigest()[:24]
    if final.is_dir():
        return _find_hf_folder(final)
    root.mkdir(parents=True, exist_ok=True)
    import mlflow.artifacts

    tmp = Path(tempfile.mkdtemp(prefix=f".dl-{uuid.uuid4().hex[:6]}-", dir=root))
    try:
        # MLflow's runs:/ download swallows the ENOSPC and says "Failed to download artifacts from
        # path ..., please ensure that the path is correct": any error with the cache disk full
        # is taken for what it is (checked before the partial download is removed)
        with disk_errors(f"the download of {uri}", root, "free space there, or point model.cache_dir at a "
                         "disk with room; nothing partial was kept", opaque=(Exception,)):
            mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(tmp), tracking_uri=tracking_uri)
        try:
            tmp.rename(final)
        except OSError:  # another process published it first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _find_hf_folder(final)


@dataclass
class Decision:
    """Whether the challenger replaces the champion."""

    promote: bool
    challenger_score: float
    champion_score: float | None
    margin: float
    reason: str

    @property
    def label(self) -> str:
        return "promoted" if self.promote else "kept"


def decide(challenger_score: float, champion_score: float | None, margin: float = 0.0) -> Decision:
    """Promote iff there is no champion, or ``challenger >= champion + margin``.

    A challenger whose score is not a number (nothing was scored) never replaces a champion; a
    champion whose score is not a number (e.g. its evaluation found no scorable episode) loses
    to any scored challenger.
    """
    if champion_score is None:
        return Decision(True, challenger_score, None, margin, "no champion yet: the first model becomes champion")
    if not math.isfinite(challenger_score):
        return Decision(False, challenger_score, champion_score, margin, "the challenger's score is not a number")
    if not math.isfinite(champion_score):
        return Decision(True, challenger_score, champion_score, margin, "the champion's score is not a number")
    promote = challenger_score >= champion_score + margin
    rel = ">=" if promote else "<"
    return Decision(promote, challenger_score, champion_score, margin,
                    f"challenger {challenger_score:.4f} {rel} champion {champion_score:.4f} + margin {margin:g}")


class ModelRegistry:
    """Registered-model operations used by the retraining flow (all through ``MlflowClient``)."""

    def __init__(self, tracking_uri: str, registry_uri: str | None = None):
        self.uri = tracking_uri
        self.client = guarded(open_client(tracking_uri, registry_uri=registry_uri or tracking_uri),
                              registry_uri or tracking_uri)  # a full SQLite DB: ENOSPC naming it

    def ensure_model(self, name: str, description: str | None = None) -> None:
        try:
            self.client.get_registered_model(name)
        except MlflowException:
            try:
                self.client.create_registered_model(name, description=description)
            except MlflowException:  # created concurrently
                self.client.get_registered_model(name)

    def version_by_alias(self, name: str, alias: str = CHAMPION) -> ModelVersion | None:
        try:
            return self.client.get_model_version_by_alias(name, alias)
        except MlflowException:  # no such model, or no such alias
            return None

    def champion(self, name: str) -> ModelVersion | None:
        return self.version_by_alias(name, CHAMPION)

    def register(self, name: str, source: str, run_id: str | None = None,
                 tags: dict[str, Any] | None = None, description: str | None = None) -> ModelVersion:
        """A new version of ``name`` whose source is the checkpoint URI ``source``."""
        self.ensure_model(name)
        return self.client.create_model_version(
            name, source=source, run_id=run_id, description=description,
            tags={k: str(v) for k, v in (tags or {}).items()},
        )

    def set_alias(self, name: str, version: str | int, alias: str = CHAMPION) -> None:
        self.client.set_registered_model_alias(name, alias, str(version))

    def tag_version(self, name: str, version: str | int, tags: dict[str, Any]) -> None:
        for k, v in tags.items():
            self.client.set_model_version_tag(name, str(version), k, str(v))

    def versions(self, name: str) -> list[ModelVersion]:
        found = self.client.search_model_versions(f"name = '{name}'")
        return sorted(found, key=lambda mv: int(mv.version))
