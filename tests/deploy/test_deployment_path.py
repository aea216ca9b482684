"""The cluster path end to end on one box: `prefect server start`, `forgeflow pools create`,
`prefect --no-prompt deploy --all` (prefect.yaml), `prefect worker start`, `prefect deployment run` with
parameters, then the flow run's state, UI artifacts and schedules read back through the Prefect API.

    .venv/bin/python -m pytest tests/deploy -q -x
"""

from __future__ import annotations

import json
import re
import time

import pytest

from forge_core.config import load_config
from forge_core.storage import ObjectStore
from tests.deploy.conftest import REPO_ROOT, LocalPrefect, tail

pytestmark = pytest.mark.integration

FLOW_RUN_TIMEOUT_S = 600.0
TERMINAL_STATES = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
# Stages of post_train on a config with `grpo.iterations` = N: evaluate runs 1 + N times, rollout/grpo N.
STAGES = ("prepare", "sft", "evaluate", "rollout", "grpo")


async def _deployment_runs(client, name: str) -> list:
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    deployment = await client.read_deployment_by_name(name)
    return await client.read_flow_runs(
        deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id]))
    )


def _flow_run_logs(prefect: LocalPrefect, flow_run_id) -> str:
    """The run's last 200 log lines, where a failure's cause is."""
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort

    newest_first = prefect.api(
        lambda client: client.read_logs(
            log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])),
            sort=LogSort.TIMESTAMP_DESC,
            limit=200,
        )
    )
    return "\n".join(log.message for log in reversed(newest_first))


def wait_for_flow_run(prefect: LocalPrefect, deployment: str, worker_log) -> object:
    """The deployment's only flow run, once terminal; fails with the run's logs unless it COMPLETED."""
    deadline = time.monotonic() + FLOW_RUN_TIMEOUT_S
    run = None
    while time.monotonic() < deadline:
        runs = prefect.api(lambda client: _deployment_runs(client, deployment))
        assert len(runs) <= 1, f"expected one flow run of {deployment}, found {len(runs)}"
        run = runs[0] if runs else None
        if run is not None and run.state is not None and run.state.type.value in TERMINAL_STATES:
            break
        time.sleep(2.0)
    else:
        state = run.state.type.value if run and run.state else "no flow run"
        pytest.fail(
            f"{deployment}: not finished after {FLOW_RUN_TIMEOUT_S:.0f}s (state {state})\n"
            f"--- worker log ---\n{tail(worker_log)}"
        )
    if run.state.type.value != "COMPLETED":
        pytest.fail(
            f"{deployment}: flow run {run.id} ended {run.state.type.value}: {run.state.message}\n"
            f"--- flow run logs ---\n{_flow_run_logs(prefect, run.id)}\n"
            f"--- worker log ---\n{tail(worker_log)}"
        )
    return run


def _artifacts(prefect: LocalPrefect, flow_run_id) -> list:
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    return prefect.api(
        lambda client: client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
    )


def _table_rows(artifact) -> list[dict]:
    return json.loads(artifact.data) if isinstance(artifact.data, str) else artifact.data


def assert_ui_artifacts(prefect: LocalPrefect, flow_run_id, store: ObjectStore, iterations: int) -> None:
    """Per stage run: a progress artifact, a metrics table and an output markdown naming a committed URI;
    per flow run: the summary."""
    artifacts = _artifacts(prefect, flow_run_id)
    by_key: dict[str, list] = {}
    for artifact in artifacts:
        by_key.setdefault(artifact.key, []).append(artifact)
    runs_per_stage = {
        "prepare": 1,
        "sft": 1,
        "evaluate": 1 + iterations,
        "rollout": iterations,
        "grpo": iterations,
    }
    for stage in STAGES:
        expected = runs_per_stage[stage]
        for suffix, kind in (("progress", "progress"), ("metrics", "table"), ("output", "markdown")):
            found = by_key.setdefault(f"{stage}-{suffix}", [])
            assert len(found) == expected, f"{stage}-{suffix}: {len(found)} artifacts, expected {expected}"
            assert all(a.type == kind for a in found), f"{stage}-{suffix}: types {[a.type for a in found]}"
        for output in by_key[f"{stage}-output"]:
            uri = next(word.strip("`") for word in output.data.split() if "://" in word)
            assert store.is_committed(uri), f"{stage}-output names {uri}, which is not committed"
    for stage in ("sft", "grpo"):  # the stages that report progress lines
        assert all(float(a.data) == 100.0 for a in by_key[f"{stage}-progress"]), stage
    for table in by_key["sft-metrics"]:
        rows = _table_rows(table)
        assert any(row["metric"] == "wall_s" and float(row["value"]) > 0 for row in rows), rows
    (summary,) = by_key["post-train-summary"]
    assert summary.type == "markdown"
    assert str(flow_run_id) in summary.data
    (stage_table,) = by_key["post-train-stages"]
    assert len(_table_rows(stage_table)) == sum(runs_per_stage.values())


def assert_nightly_schedule_inactive(prefect: LocalPrefect) -> None:
    deployment = prefect.api(lambda client: client.read_deployment_by_name("retrain/nightly-demo"))
    assert len(deployment.schedules) == 1, deployment.schedules
    (schedule,) = deployment.schedules
    assert schedule.schedule.cron == "0 2 * * *"
    assert schedule.active is False
    # Inactive means the scheduler creates no runs for it.
    assert prefect.api(lambda client: _deployment_runs(client, "retrain/nightly-demo")) == []


def assert_pools_create_is_declarative(prefect: LocalPrefect) -> None:
    """Re-running `pools create` with another GPU count sets the limit to it, not keeping the old one."""
    prefect.cli("forgeflow", "pools", "create", "gpu-a", "--gpus", "4")
    done = prefect.cli("forgeflow", "pools", "create", "gpu-a", "--gpus", "8")
    assert "changed from 4 to 8 GPUs" in done.stdout, done.stdout
    limit = prefect.api(lambda client: client.read_global_concurrency_limit_by_name("gpu-a"))
    assert limit.limit == 8
    pool = prefect.api(lambda client: client.read_work_pool("gpu-a"))
    assert pool.type == "process"


def assert_deployment_is_portable(prefect: LocalPrefect) -> None:
    """Deployed without FORGEFLOW_HOME, the pull step keeps the placeholder for each worker to fill."""
    deployment = prefect.api(lambda client: client.read_deployment_by_name("post-train/demo-cpu"))
    assert deployment.pull_steps == [
        {"prefect.deployments.steps.set_working_directory": {"directory": "{{ $FORGEFLOW_HOME }}"}}
    ]


def test_deploy_run_and_read_back(local_prefect: LocalPrefect, process_keeper, tmp_path):
    overrides = [
        f"storage.root=file://{tmp_path}/store",
        f"logging.dir={tmp_path}/runs",
        # The deployment path, not the loop, is under test here (tests/flows runs the GRPO iterations):
        # prepare, SFT under torchrun and one vLLM evaluation keep it within its time budget.
        "grpo.iterations=0",
    ]
    cfg = load_config(str(REPO_ROOT / "configs/tiny_test.yaml"), overrides)

    local_prefect.cli("forgeflow", "pools", "create", "local-cpu")
    # `deploy --all` refuses a deployment whose pool does not exist: the GPU deployment needs its pool too.
    assert_pools_create_is_declarative(local_prefect)
    local_prefect.cli("prefect", "--no-prompt", "deploy", "--all")
    assert_deployment_is_portable(local_prefect)
    worker_dir = tmp_path / "worker-cwd"  # not the checkout: the deployment's pull step must get there itself
    worker_dir.mkdir()
    worker = local_prefect.start_worker("local-cpu", cwd=worker_dir)

    # prefect 3.7 reads every --param value as JSON (a bare word falls back to a string), so the list of
    # overrides travels as one JSON array.
    local_prefect.cli(
        "prefect",
        "deployment",
        "run",
        "post-train/demo-cpu",
        "--param",
        "config=configs/tiny_test.yaml",
        "--param",
        f"overrides={json.dumps(overrides)}",
    )
    run = wait_for_flow_run(local_prefect, "post-train/demo-cpu", worker.log_path)

    assert run.parameters == {"config": "configs/tiny_test.yaml", "overrides": overrides}
    store = ObjectStore.from_config(cfg.storage)
    assert len(store.list_committed("grpo")) == cfg.grpo.iterations
    assert_ui_artifacts(local_prefect, run.id, store, cfg.grpo.iterations)
    assert_nightly_schedule_inactive(local_prefect)
    status = local_prefect.cli("forgeflow", "status", "--config", "configs/tiny_test.yaml", *overrides)
    assert re.search(rf"^{run.id}  {run.name} +Completed ", status.stdout, re.MULTILINE), status.stdout
    grpo_line = rf"^grpo\s+{cfg.grpo.iterations} committed"
    assert re.search(grpo_line, status.stdout, re.MULTILINE), status.stdout

    assert process_keeper.seen_matching("torch.distributed.run"), "no torchrun process was ever seen"
    process_keeper.stop_all()
    survivors = process_keeper.survivors()
    assert survivors == [], f"processes outlived the stop: {survivors}"
