"""Prefect-side glue between the two UIs: the current flow run's URL and name, and the MLflow
run as a Prefect link artifact (the MLflow side, tags and descriptions, is in ``agentgym``).
"""

from __future__ import annotations

from typing import Any

from prefect.artifacts import create_link_artifact
from prefect.client.orchestration import get_client
from prefect.context import FlowRunContext
from prefect.runtime import flow_run
from prefect.settings import PREFECT_API_URL, PREFECT_UI_URL

from agentgym.config import PipelineConfig, parse_config, with_overrides
from agentgym.tracking.artifact_keys import artifact_key

TAG_FLOW_RUN_ID = "agentgym.prefect_flow_run_id"
TAG_FLOW_RUN_URL = "agentgym.prefect_flow_run_url"
PENDING = "run-id-pending"  # the name until the flow body has made up a new run id


def flow_run_url() -> str | None:
    """The current flow run's page in the Prefect UI (None outside a flow run). Without a
    configured UI URL (the temporary local server) it is derived from the API's address."""
    fr_id = flow_run.id
    if fr_id is None:
        return None
    ui = PREFECT_UI_URL.value()
    if not ui:
        api = PREFECT_API_URL.value()
        if not api:
            with get_client(sync_client=True) as client:
                api = str(client.api_url)
        ui = api.rstrip("/").removesuffix("/api")
    return f"{ui.rstrip('/')}/runs/flow-run/{fr_id}"


def prefect_tags() -> dict[str, Any]:
    """MLflow tags that point back at the current Prefect flow run."""
    return {TAG_FLOW_RUN_ID: flow_run.id, TAG_FLOW_RUN_URL: flow_run_url()}


def pipeline_run_name() -> str:
    """``flow_run_name`` of scaling-inter-rl: the pipeline run id (``config.run_id`` after the
    ``overrides``); a run without one is renamed by ``name_flow_run`` once its id is made up."""
    params = flow_run.parameters
    config = params.get("config")
    try:
        if isinstance(config, dict):
            config = parse_config(config)
        if isinstance(config, PipelineConfig):
            run_id = with_overrides(config, params.get("overrides")).run_id
            return run_id or PENDING
    except Exception:  # a bad config fails in the flow body, with its message; not here
        pass
    return PENDING


def name_flow_run(name: str) -> None:
    """Rename the current flow run (the top-level one: its pipeline run id)."""
    ctx = FlowRunContext.get()
    if ctx is None or ctx.flow_run is None or ctx.flow_run.name == name:
        return
    with get_client(sync_client=True) as client:
        client.set_flow_run_name(ctx.flow_run.id, name)
    ctx.flow_run.name = name


def link_mlflow_run(run_id: str, url: str, what: str = "pipeline run") -> None:
    """The MLflow run as a link artifact of the current flow run (key ``mlflow-<run_id>``)."""
    create_link_artifact(link=url, link_text=f"MLflow {what} {run_id}", key=artifact_key("mlflow", run_id),
                         description=f"MLflow {what} of ScalingInter-RL run `{run_id}`: metrics per "
                                     "iteration, stage child runs, checkpoints, the logged model.")
