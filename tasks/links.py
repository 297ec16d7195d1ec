"""Prefect-side glue between the two UIs: the current flow run's URL, name and pipeline run id, and
the MLflow run as a Prefect link artifact (the MLflow side, tags and descriptions, is in ``agentgym``).

A flow run on a temporary Prefect server (Prefect's ephemeral one, or the one ``agentgym`` starts
for a command, ``TEMPORARY_SERVER_ENV``) gets no URL: the server, and its pages, end with the
command. Its flow run id is still recorded. A configured server (``PREFECT_API_URL``, e.g.
``deployments/local.sh``'s) is linked through ``PREFECT_UI_URL``, derived from the API URL by
Prefect unless set.
"""

from __future__ import annotations

import os
import uuid
from datetime import datetime, timezone
from typing import Any

from prefect.artifacts import create_link_artifact
from prefect.context import FlowRunContext
from prefect.client.orchestration import get_client
from prefect.runtime import flow_run
from prefect.settings import PREFECT_API_URL, PREFECT_UI_URL

from agentgym.config import PipelineConfig, parse_config, with_overrides
from agentgym.tracking.artifact_keys import artifact_key
from agentgym.tracking.prefect_db import TEMPORARY_SERVER_ENV

__all__ = ["TAG_FLOW_RUN_ID", "TAG_FLOW_RUN_URL", "TEMPORARY_SERVER_ENV", "flow_run_url", "link_mlflow_run",
           "name_flow_run", "new_run_id", "pipeline_run_id", "pipeline_run_name", "prefect_tags", "prefect_ui_url"]

TAG_FLOW_RUN_ID = "agentgym.prefect_flow_run_id"
TAG_FLOW_RUN_URL = "agentgym.prefect_flow_run_url"

# flow run id -> the pipeline run id its flow-run-name callable made up (same process: the engine
# calls the name callable in the flow's process just before the body)
_made_up: dict[str, str] = {}


def new_run_id() -> str:
    return datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]


def prefect_ui_url() -> str | None:
    """The Prefect UI of the configured server this process talks to; None on a temporary server."""
    api = PREFECT_API_URL.value()
    if not api or api == os.environ.get(TEMPORARY_SERVER_ENV):
        return None
    ui = PREFECT_UI_URL.value() or api.rstrip("/").removesuffix("/api")
    return ui.rstrip("/")


def flow_run_url() -> str | None:
    """The current flow run's page in the Prefect UI (None outside a flow run, or on a temporary
    server, whose pages are gone once the command ends)."""
    fr_id = flow_run.id
    ui = prefect_ui_url()
    return f"{ui}/runs/flow-run/{fr_id}" if fr_id and ui else None


def prefect_tags() -> dict[str, Any]:
    """MLflow tags that point back at the current Prefect flow run: its id, and its URL where
    the server outlives the run."""
    url = flow_run_url()
    return {TAG_FLOW_RUN_ID: flow_run.id, **({TAG_FLOW_RUN_URL: url} if url else {})}


def pipeline_run_name() -> str:
    """``flow_run_name`` of scaling-inter-rl: the pipeline run id, ``config.run_id`` after the
    ``overrides``; for a run without one, the id is made up here, before the flow run begins (so
    its logs name it), and the flow body takes it (:func:`pipeline_run_id`)."""
    params = flow_run.parameters
    config = params.get("config")
    try:
        if isinstance(config, dict):
            config = parse_config(config)
        if isinstance(config, PipelineConfig):
            run_id = with_overrides(config, params.get("overrides")).run_id
            if run_id:
                return run_id
    except Exception:  # a bad config fails in the flow body, with its message; not here
        pass
    made = new_run_id()
    if flow_run.id:
        _made_up[flow_run.id] = made
    return made


def pipeline_run_id(config: PipelineConfig) -> str:
    """The pipeline run id of the current flow run: ``config.run_id``, else the one
    :func:`pipeline_run_name` made up for this flow run, else a new one."""
    if config.run_id:
        return config.run_id
    fr_id = flow_run.id
    return (_made_up.get(fr_id) if fr_id else None) or new_run_id()


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
