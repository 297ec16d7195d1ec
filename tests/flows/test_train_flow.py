"""The whole pipeline as a real Prefect flow on a temporary local server, with real MLflow."""

import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from mlflow.tracking import MlflowClient
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentgym.config import parse_config
from configs import keyword_env, parse_tiny_config  # tests/ is on sys.path

TURN_COLUMNS = {"episode_id", "turn", "observation", "action_text", "parsed_action", "reward",
                "terminated", "truncated", "format_error", "gen_tokens", "env_latency_ms"}
EPISODE_COLUMNS = {"run_id", "stage", "iteration", "episode_id", "group_id", "env", "task_id", "seed",
                   "horizon", "num_turns", "terminated", "truncated", "reward", "success", "infra_error",
                   "policy_version", "created_at", "input_ids", "loss_mask", "old_logprobs"}


@pytest.fixture(scope="module")
def run(tmp_path_factory, model_cache):
    from flows.train import scaling_inter_rl

    tmp = tmp_path_factory.mktemp("flow")
    cfg = parse_tiny_config(
        model_cache, store_root=tmp / "store", tracking_dir=tmp, run_id="flow-test", seed=1,
        # a dense single-turn reward (so updates move weights) mixed with a multi-turn task
        envs=[keyword_env(eval_tasks=[7, 8]), {"name": "keyword", "tasks": [3, 4, 5], "kwargs": {"target": "yes"}}],
        rollout={"tasks_per_iteration": 4},
        # a warmup + cosine schedule over the run's 8 optimizer steps, so the lr test can see it move
        trainer={"lr_schedule": "cosine", "lr_warmup_steps": 3, "lr_decay_steps": 7, "lr_min_ratio": 0.1},
        algorithm={"skip_tied_groups": False, "mini_batches": 2},  # updates on a zero-reward task too
        schedule={"stages": [{"horizon": 1, "iterations": 2}, {"horizon": 3, "iterations": 2}]},
        tracking={"experiment": "flow-test", "eval_every": 2, "eval_k": 2, "registered_model_name": "flow-test-policy"})
    state = scaling_inter_rl(cfg, return_state=True)
    return cfg, state.result(), state.state_details.flow_run_id, tmp


def test_turns_table_with_pandas(run):
    cfg, result, _, _ = run
    turns = pd.read_parquet(f"{result['store']}/turns")
    episodes = pd.read_parquet(f"{result['store']}/episodes")
    assert TURN_COLUMNS <= set(turns.columns) and EPISODE_COLUMNS <= set(episodes.columns)
    assert len(episodes) == 4 * 4 * 2  # 4 iterations x 4 tasks x 2 samples
    # one row per turn
    assert turns.groupby("episode_id").size().sort_index().tolist() == \
        episodes.set_index("episode_id")["num_turns"].sort_index().tolist()
    stage1 = pd.read_parquet(f"{result['store']}/episodes", filters=[("stage", "=", 1)])
    assert (stage1["horizon"] == 3).all() and stage1["num_turns"].max() <= 3
    assert (episodes.loc[episodes["stage"].astype(int) == 0, "num_turns"] == 1).all()


def test_tokens_reproduce_replies(run, model_cache):
    from agentgym.chat import ChatFormatter
    from agentgym.models.folders import tiny_model_path

    cfg, result, _, _ = run
    tok = AutoTokenizer.from_pretrained(tiny_model_path(model_cache))
    fmt = ChatFormatter(tok)
    episodes = pd.read_parquet(f"{result['store']}/episodes")
    turns = pd.read_parquet(f"{result['store']}/turns")
    for ep in episodes.itertuples():
        ids, mask, lps = np.asarray(ep.input_ids), np.asarray(ep.loss_mask), np.asarray(ep.old_logprobs)
        assert (lps[mask == 0] == 0).all() and (lps[mask == 1] < 0).all()
        edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
        replies = [fmt.reply_text(ids[a:b].tolist()) for a, b in zip(edges[::2], edges[1::2])]
        expected = turns[turns.episode_id == ep.episode_id].sort_values("turn")["action_text"].tolist()
        assert replies == expected


def test_mlflow_runs_metrics_and_checkpoint(run):
    cfg, result, _, _ = run
    client = MlflowClient(cfg.tracking.tracking_uri)
    parent = client.get_run(result["mlflow_run_id"])
    assert parent.info.status == "FINISHED"
    children = client.search_runs([parent.info.experiment_id],
                                  f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    assert sorted((c.data.params["stage"], c.data.params["horizon"]) for c in children) == [("0", "1"), ("1", "3")]
    # what MLflow's runs table shows first: the stage; a stage run's first chart section: learning/
    assert sorted(c.info.run_name.split(" ")[0] for c in children) == ["stage0-h1", "stage1-h3"]
    for c in children:
        assert {f"learning/{k}" for k in ("reward_mean", "success_rate", "turns_per_episode",
                                           "format_error_rate")} <= set(c.data.metrics)
        assert c.data.metrics["learning/success_rate"] == c.data.metrics["success_rate"]
    steps = [m.step for m in client.get_metric_history(parent.info.run_id, "reward_mean")]
    assert steps == [0, 1, 2, 3]
    for key in ("success_rate", "turns_per_episode", "format_error_rate", "policy_loss", "entropy",
                "clipfrac", "grad_norm", "gen_tokens_per_s", "loss", "lr", "ratio_mean", "optimizer_steps"):
        assert client.get_metric_history(parent.info.run_id, key), key
    # the validation loop: held-out tasks every eval_every=2 steps, on the pipeline run
    assert [m.step for m in client.get_metric_history(parent.info.run_id, "eval/seconds")] == [2, 4]
    assert {k for k in parent.data.metrics if k.startswith("eval/keyword/")}, parent.data.metrics.keys()
    ckpt = result["stages"][-1]["checkpoint"]
    local = Path(ckpt.replace("file://", ""))
    model = AutoModelForCausalLM.from_pretrained(local)
    tiny = AutoModelForCausalLM.from_pretrained(
        __import__("agentgym.models.folders", fromlist=["x"]).tiny_model_path(cfg.model.cache_dir))
    changed = any(not torch.equal(a, b) for a, b in zip(model.state_dict().values(), tiny.state_dict().values()))
    assert changed, "checkpoint should hold trained (changed) weights"


def test_lr_follows_the_schedule_in_mlflow(run):
    """Every number the update returns reaches MLflow (no allow-list), ``lr`` among them: the
    logged value of each iteration is the warmup + cosine multiplier of its last optimizer step."""
    from agentgym.training.policy_trainer import lr_lambda

    cfg, result, _, _ = run
    client = MlflowClient(cfg.tracking.tracking_uri)
    history = lambda key: [m.value for m in sorted(client.get_metric_history(result["mlflow_run_id"], key),
                                                   key=lambda m: m.step)]  # noqa: E731
    steps = history("optimizer_steps")
    assert steps == [2.0, 2.0, 2.0, 2.0]  # mini_batches=2 per iteration
    last_step = np.cumsum(steps) - 1  # 0-based index of each iteration's last optimizer step
    expected = [1e-3 * lr_lambda(cfg.trainer)(int(k)) for k in last_step]
    assert history("lr") == pytest.approx(expected, rel=1e-6)
    assert expected[0] < expected[1] and expected[1] > expected[3]  # warmup, then decay: it moved
    assert not client.get_metric_history(result["mlflow_run_id"], "pg_loss")  # one name per quantity


def test_prefect_records_flow_and_stage_subflows(run):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, FlowRunFilterParentFlowRunId

    _, _, flow_run_id, _ = run
    with get_client(sync_client=True) as client:
        parent = client.read_flow_run(flow_run_id)
        assert parent.state.is_completed()
        subs = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id])))
        assert sorted(r.name for r in subs) == ["stage-0-horizon-1", "stage-1-horizon-3"]
        assert all(r.state.is_completed() for r in subs)
        assert sorted(r.parameters["horizon"] for r in subs) == [1, 3]
        # each stage subflow is tagged with the pipeline run, its stage and its horizon
        assert sorted(sorted(r.tags) for r in subs) == [
            ["agentgym", "horizon:1", "run:flow-test", "stage:0"], ["agentgym", "horizon:3", "run:flow-test", "stage:1"]]
        # ...and their task runs carry none: a tagged task run costs a server round trip for
        # Prefect's tag concurrency check (flows/tagging.py)
        tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[r.id for r in subs])))
        assert {t.name.split("[")[0] for t in tasks} >= {"collect_rollouts", "compute_advantages", "update_policy"}
        assert [t.name for t in tasks if t.tags] == []


def test_stage_table_artifacts_link_their_mlflow_runs(run):
    import json

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    cfg, result, _, _ = run
    with get_client(sync_client=True) as client:
        for stage, steps in ((0, [0, 1]), (1, [2, 3])):
            found = client.read_artifacts(artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=[f"stage-{stage}-flow-test"])))
            assert found and found[0].type == "table"
            rows = found[0].data if isinstance(found[0].data, list) else json.loads(found[0].data)
            assert [r["global_step"] for r in rows] == steps
            assert {"reward_mean", "success_rate", "turns_per_episode", "format_error_rate"} <= set(rows[0])
            child = result["stages"][stage]["mlflow_run_id"]
            assert child in found[0].description and "mlflow ui --backend-store-uri" in found[0].description


def test_trajectory_viewer_is_an_mlflow_artifact_linked_from_prefect(run):
    """After each stage the run's viewer (`agentgym view`) is rewritten as the pipeline run's
    artifact viewer/<run_id>.html; the last one holds every committed episode, and the stage
    table artifacts and the summary point at it."""
    import json
    import re

    from prefect.client.orchestration import get_client

    cfg, result, _, tmp = run
    client = MlflowClient(cfg.tracking.tracking_uri)
    html = Path(client.download_artifacts(result["mlflow_run_id"], "viewer/flow-test.html", str(tmp))).read_text()
    data = json.loads(re.search(r'<script type="application/json" id="agentgym-data">(.*?)</script>', html, re.S).group(1))
    episodes = pd.read_parquet(result["store"] + "/episodes")
    assert sorted(e["episode_id"] for e in data["episodes"]) == sorted(episodes["episode_id"])
    uri = result["stages"][-1]["viewer"]
    assert uri.endswith("/viewer/flow-test.html") and all(s["viewer"] == uri for s in result["stages"])
    with get_client(sync_client=True) as pc:
        assert uri in _artifact(pc, "stage-1-flow-test").description
        assert uri in _artifact(pc, "summary-flow-test").data


def test_run_link_points_at_a_tracking_server():
    from agentgym.tracking.tracker import Tracker

    tracker = Tracker.__new__(Tracker)  # no server to connect to: only the link is under test
    tracker.uri, tracker.experiment_id = "http://127.0.0.1:5000/", "7"
    assert tracker.run_link("abc") == ("[MLflow run abc](http://127.0.0.1:5000/#/experiments/7/runs/abc"
                                       "?workflowType=machine_learning)")


def test_lineage_commits_as_dataset_inputs_and_in_the_checkpoint(run):
    import json

    cfg, result, _, _ = run
    client = MlflowClient(cfg.tracking.tracking_uri)
    digests = {}
    for stage in result["stages"]:
        inputs = client.get_run(stage["mlflow_run_id"]).inputs.dataset_inputs
        names = sorted(i.dataset.name for i in inputs)
        s = stage["stage"]
        assert names == [f"episodes/stage={s}/iteration={i}" for i in range(2)]
        for i in inputs:
            source = json.loads(i.dataset.source)
            assert source["uri"].endswith("/flow-test/episodes") and source["rows"] == 8
            digests[i.dataset.name] = source["sha256"]
            # what the MLflow UI shows beside the input: the episodes table's schema and a profile
            cols = {c["name"]: c["type"] for c in json.loads(i.dataset.schema)["mlflow_colspec"]}
            assert cols["reward"] == "double" and cols["success"] == "boolean" and "input_ids" in cols
            profile = json.loads(i.dataset.profile)
            assert profile["num_rows"] == 8 and 0 <= profile["success_rate"] <= 1 and "reward_mean" in profile
    # every checkpoint names the commits and the config that produced it
    ckpt = Path(result["stages"][-1]["checkpoint"].replace("file://", ""))
    meta = json.loads((ckpt / "agentgym_checkpoint.json").read_text())
    assert {f"episodes/stage={c['stage']}/iteration={c['iteration']}": c["digest"]
            for c in meta["episode_commits"]} == digests
    assert json.loads((ckpt / "agentgym_config.json").read_text()) == cfg.model_dump(mode="json")


def _all_task_runs(client, flow_run_id):
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, FlowRunFilterParentFlowRunId

    subs = client.read_flow_runs(flow_run_filter=FlowRunFilter(
        parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id])))
    ids = [flow_run_id] + [str(s.id) for s in subs]
    return subs, client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=ids)))


def _artifact(client, key):
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
    assert len(found) == 1, (key, found)
    return found[0]


def test_prefect_runs_are_named_after_the_run_stage_and_iteration(run):
    from prefect.client.orchestration import get_client

    _, _, flow_run_id, _ = run
    with get_client(sync_client=True) as client:
        assert client.read_flow_run(flow_run_id).name == "flow-test"  # the pipeline run id
        _, tasks = _all_task_runs(client, flow_run_id)
    names = {t.name for t in tasks}
    for want in ("restore_policy[flow-test]", "collect_rollouts[stage 0 h1 it 0]", "collect_rollouts[stage 1 h3 it 1]",
                 "compute_advantages[stage 1 it 0]", "update_policy[stage 0 it 1]", "save_checkpoint[stage 1 step 4]",
                 "evaluate_live_run[step 2]", "evaluate_live_run[step 4]", "log_final_policy[flow-test]"):
        assert want in names, (want, sorted(names))


def test_prefect_and_mlflow_link_each_other(run):
    from prefect.client.orchestration import get_client

    cfg, result, flow_run_id, _ = run
    flow_run_id = str(flow_run_id)
    client = MlflowClient(cfg.tracking.tracking_uri)
    parent = client.get_run(result["mlflow_run_id"])
    # MLflow -> Prefect: the flow run's id as a tag; no URL, since this test's Prefect server is a
    # temporary one whose pages end with the process (test_deployments checks the URL of a
    # configured server's flow run)
    tags = parent.data.tags
    assert tags["agentgym.prefect_flow_run_id"] == flow_run_id
    assert "agentgym.prefect_flow_run_url" not in tags
    note = tags["mlflow.note.content"]
    assert "`flow-test`" in note and "keyword" in note and "/runs/flow-run/" not in note
    with get_client(sync_client=True) as pc:
        subs, _ = _all_task_runs(pc, flow_run_id)
        stage_flow_runs = {r.parameters["index"]: str(r.id) for r in subs}
        for s in result["stages"]:  # each stage run points at its own stage subflow run
            stage_tags = client.get_run(s["mlflow_run_id"]).data.tags
            assert stage_tags["agentgym.prefect_flow_run_id"] == stage_flow_runs[s["stage"]]
            assert "agentgym.prefect_flow_run_url" not in stage_tags
            assert f"Stage {s['stage']} of ScalingInter-RL run `flow-test`" in stage_tags["mlflow.note.content"]
        # Prefect -> MLflow: a link artifact of the top-level flow run to the pipeline run's page
        link = _artifact(pc, "mlflow-flow-test")
        assert str(link.flow_run_id) == flow_run_id  # Prefect keeps a link artifact as markdown
        assert link.data == (f"[MLflow pipeline run flow-test](http://127.0.0.1:5000/#/experiments/"
                             f"{parent.info.experiment_id}/runs/{parent.info.run_id}"
                             "?workflowType=machine_learning)"), link.data
        # the run's summary: per-stage table, evaluation, links
        summary = _artifact(pc, "summary-flow-test")
    assert summary.type == "markdown" and str(summary.flow_run_id) == flow_run_id
    text = summary.data
    stages = result["stages"]
    assert f"| 0 | 1 | 2 | {stages[0]['success_rate']:.4f} |" in text and "| 1 | 3 | 2 |" in text, text
    assert f"#/experiments/{parent.info.experiment_id}/runs/{stages[1]['mlflow_run_id']}" in text
    assert "`eval/overall/avg_at_2`" in text and "models:/flow-test-policy/1" in text
    link_texts = re.findall(r"\[([^\]]*)\]\(", text)
    assert f"pipeline run {parent.info.run_id}" in link_texts and "stage run" in link_texts, link_texts
    assert not [t for t in link_texts if "`" in t], link_texts  # the Prefect UI would show the backticks


def test_final_policy_is_a_registered_mlflow_model(run):
    import mlflow.pyfunc

    from agentgym.registry.champion import materialize

    cfg, result, _, _ = run
    uri = cfg.tracking.tracking_uri
    client = MlflowClient(uri, registry_uri=uri)
    versions = client.search_model_versions("name = 'flow-test-policy'")
    assert [v.version for v in versions] == [1] and result["model"]["version"] == "1"
    mv = versions[0]
    assert mv.run_id == result["mlflow_run_id"]
    logged = client.get_logged_model(result["model"]["model_id"])
    assert logged.source_run_id == result["mlflow_run_id"] and str(logged.status).endswith("READY")
    outputs = client.get_run(result["mlflow_run_id"]).outputs.model_outputs
    assert [(o.model_id, o.step) for o in outputs] == [(logged.model_id, 4)]
    # the registered version holds the final checkpoint's weights ...
    folder = materialize("models:/flow-test-policy/1", uri, cfg.model.cache_dir)
    final = Path(result["stages"][-1]["checkpoint"].replace("file://", ""))
    a = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    b = AutoModelForCausalLM.from_pretrained(final).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # ... and loads as an MLflow pyfunc that answers a prompt
    model = mlflow.pyfunc.load_model(mv.source)
    replies = model.predict(pd.DataFrame({"prompt": ["say yes"]}), params={"max_new_tokens": 4})
    assert len(replies) == 1 and isinstance(replies[0], str)


def test_a_run_without_an_id_begins_under_the_id_it_makes_up():
    """The flow run's name comes from ``config.run_id`` after the overrides; for a run that has
    none, the name callable makes the id up before the flow run begins (so Prefect's "Beginning
    flow run" log names it) and the body takes that same id."""
    import logging

    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    from agentgym.config import PipelineConfig, with_overrides
    from tasks.links import pipeline_run_id, pipeline_run_name

    @flow(name="named", flow_run_name=pipeline_run_name)
    def named(config: PipelineConfig, overrides: list[str] | None = None):
        return flow_run.name, pipeline_run_id(with_overrides(config, overrides)), str(flow_run.id)

    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("prefect.flow_runs")  # where the engine logs a run's start
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        name, run_id, fr_id = named(parse_config({}), ["seed=3"])
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert re.fullmatch(r"\d{8}-\d{6}-[0-9a-f]{6}", name) and run_id == name
    begun = [r.getMessage() for r in records if r.getMessage().startswith("Beginning flow run")]
    assert begun == [f"Beginning flow run {name!r} for flow 'named'"], begun
    with get_client(sync_client=True) as client:
        assert client.read_flow_run(fr_id).name == run_id
    assert named(parse_config({}), ["run_id=from-overrides"])[:2] == ("from-overrides", "from-overrides")
    assert named(parse_config({}))[1] != run_id  # each run without an id makes up its own
