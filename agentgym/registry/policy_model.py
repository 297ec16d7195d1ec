"""The final policy as an MLflow model, and its registration.

``log_policy_model`` saves a checkpoint's Hugging Face folder as an MLflow pyfunc model
(``agentgym/registry/policy_pyfunc.py``, a model from code: ``prompt`` in, greedy reply out), logs it as
an MLflow 3 *logged model* of the pipeline run (the run's "Logged models" in the UI, output of
the run) and, given a name, registers it as a new version of that registered model. Both steps
are idempotent per MLflow run, so a resumed pipeline that finished before does not log or
register the same policy twice. Pure MLflow (no Prefect).
"""

from __future__ import annotations

import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlflow.entities import LoggedModelOutput
from mlflow.exceptions import MlflowException
from mlflow.models import ModelSignature
from mlflow.tracking import MlflowClient
from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema

from agentgym.tracking.db_full import GuardedClient
from agentgym.tracking.tracker import NOTE

# an MlflowClient, or the Tracker's guarded one (the same calls, a full database reported clearly)
Client = MlflowClient | GuardedClient
MODEL_NAME = "policy"
PYFUNC_CODE = Path(__file__).with_name("policy_pyfunc.py")
SIGNATURE = ModelSignature(
    inputs=Schema([ColSpec("string", "prompt"), ColSpec("string", "system", required=False)]),
    outputs=Schema([ColSpec("string")]),
    params=ParamSchema([ParamSpec("max_new_tokens", "long", 64)]),
)


@dataclass
class LoggedPolicy:
    model_id: str
    model_uri: str  # models:/<model_id>
    version: str | None = None  # registered model version, when registered
    registered_model_name: str | None = None


def _logged(client: Client, experiment_id: str, mlflow_run_id: str) -> str | None:
    found = client.search_logged_models(
        experiment_ids=[experiment_id], filter_string=f"source_run_id = '{mlflow_run_id}' AND name = '{MODEL_NAME}'")
    ready = [m for m in found if str(m.status).endswith("READY")]  # the store's filter on status finds none
    return ready[0].model_id if ready else None


def log_policy_model(client: Client, experiment_id: str, mlflow_run_id: str, hf_folder: str | Path,
                     step: int, registered_model_name: str | None = None,
                     tags: dict[str, Any] | None = None, description: str | None = None,
                     params: dict[str, Any] | None = None) -> LoggedPolicy:
    """Log ``hf_folder`` as the pyfunc ``policy`` of run ``mlflow_run_id`` (once) and register it
    as a version of ``registered_model_name`` (once per run) when given. ``description`` is the
    model's description in the MLflow UI (and the registered version's); ``params`` its parameters
    (what trained it), shown on the model's page."""
    import mlflow.pyfunc

    tags = {k: str(v) for k, v in (tags or {}).items()}
    model_id = _logged(client, experiment_id, mlflow_run_id)
    if model_id is None:
        lm = client.create_logged_model(
            experiment_id, name=MODEL_NAME, source_run_id=mlflow_run_id, model_type="agent-policy",
            tags={**tags, **({NOTE: description} if description else {})},
            params={k: str(v)[:6000] for k, v in (params or {}).items()})
        try:
            with tempfile.TemporaryDirectory(prefix="agentgym-model-") as tmp:
                with warnings.catch_warnings():  # advice to add type hints / an input example
                    warnings.simplefilter("ignore", UserWarning)
                    mlflow.pyfunc.save_model(
                        f"{tmp}/model", python_model=str(PYFUNC_CODE), artifacts={"policy": str(hf_folder)},
                        signature=SIGNATURE, pip_requirements=["mlflow", "torch", "transformers"])
                client.log_model_artifacts(lm.model_id, f"{tmp}/model")
        except BaseException:
            client.finalize_logged_model(lm.model_id, "FAILED")
            raise
        client.finalize_logged_model(lm.model_id, "READY")
        client.log_outputs(mlflow_run_id, [LoggedModelOutput(lm.model_id, step)])
        model_id = lm.model_id
    out = LoggedPolicy(model_id, f"models:/{model_id}")
    if registered_model_name:
        out.registered_model_name = registered_model_name
        out.version = _register(client, registered_model_name, model_id, mlflow_run_id, tags, description)
    return out


def _register(client: Client, name: str, model_id: str, mlflow_run_id: str, tags: dict[str, str],
              description: str | None) -> str:
    try:
        client.get_registered_model(name)
    except MlflowException:
        try:
            client.create_registered_model(name, description="AgentGym-RL policies (agentgym train)")
        except MlflowException:  # created concurrently
            pass
    # the storage location, not models:/<id>: the registry's SQL store would resolve that id with
    # the process's global tracking URI instead of this client's
    source = client.get_logged_model(model_id).artifact_location
    for mv in client.search_model_versions(f"name = '{name}' and run_id = '{mlflow_run_id}'"):
        if mv.source == source:
            return str(mv.version)
    mv = client.create_model_version(name, source=source, run_id=mlflow_run_id, model_id=model_id,
                                     tags=tags, description=description)
    return str(mv.version)
