"""The cluster path end to end on one box: `prefect server start`, `forgeflow pools create`,
`prefect --no-prompt deploy --all` (prefect.yaml), `prefect worker start`, `prefect deployment run` with
parameters, then the flow run's state, UI artifacts and schedules read back through the Prefect API.
A first run is cancelled (`prefect flow-run cancel`) during SFT: the worker's cancel must end every process
the run launched. The next run, of the same deployment on a Ray cluster joined by address, skips the stage that
run committed and runs the others there.

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
from tests.ray_cluster import POOL, ray_client_environment

pytestmark = pytest.mark.integration

FLOW_RUN_TIMEOUT_S = 600.0
TERMINAL_STATES = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
# Stages of post_train on a config with `grpo.iterations` = N: evaluate runs 1 + N times, rollout/grpo N.
STAGES = ("prepare", "sft", "evaluate", "rollout", "grpo")


FLOW_RUN_ID = re.compile(r"UUID: ([0-9a-f-]{36})")
SKIPPED_LOG = "output already committed"  # what tasks.stages.run_stage logs when it skips a stage


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


def run_deployment(prefect: LocalPrefect, deployment: str, params: dict, env: dict | None = None) -> str:
    """`prefect deployment run` as an operator types it; returns the new flow run's id.

    prefect 3.7 reads every --param value as JSON (a bare word falls back to a string), so a list of
    overrides travels as one JSON array; `--job-variable env=...` adds to the flow run process's environment.
    """
    args = ["deployment", "run", deployment]
    for name, value in params.items():
        args += ["--param", f"{name}={value if isinstance(value, str) else json.dumps(value)}"]
    if env:
        args += ["--job-variable", f"env={json.dumps(env)}"]
    done = prefect.cli("prefect", *args)
    match = FLOW_RUN_ID.search(done.stdout)
    assert match, done.stdout
    return match.group(1)


def wait_for_flow_run(prefect: LocalPrefect, flow_run_id: str, worker_log, expected: str = "COMPLETED"):
    """The flow run once terminal; fails with the run's logs unless it ended in the `expected` state."""
    deadline = time.monotonic() + FLOW_RUN_TIMEOUT_S
    while time.monotonic() < deadline:
        run = prefect.api(lambda client: client.read_flow_run(flow_run_id))
        if run.state is not None and run.state.type.value in TERMINAL_STATES:
            break
        time.sleep(2.0)
    else:
        state = run.state.type.value if run.state else "no state"
        pytest.fail(
            f"flow run {flow_run_id}: not finished after {FLOW_RUN_TIMEOUT_S:.0f}s (state {state})\n"
            f"--- worker log ---\n{tail(worker_log)}"
        )
    if run.state.type.value != expected:
        pytest.fail(
            f"flow run {run.id} ended {run.state.type.value} (expected {expected}): {run.state.message}\n"
            f"--- flow run logs ---\n{_flow_run_logs(prefect, run.id)}\n"
            f"--- worker log ---\n{tail(worker_log)}"
        )
    return run


def _running_sft_ranks(keeper) -> list:
    return [
        p
        for p in keeper.seen_matching("forge_core.run sft")
        if "torch.distributed.run" not in p.cmdline and p.still_running()
    ]


def cancel_during_sft(prefect: LocalPrefect, keeper, flow_run_id: str, worker_log) -> None:
    """Once both SFT ranks run, cancel the flow run the way an operator does; wait until it is CANCELLED."""
    deadline = time.monotonic() + FLOW_RUN_TIMEOUT_S
    while len(_running_sft_ranks(keeper)) < 2:
        run = prefect.api(lambda client: client.read_flow_run(flow_run_id))
        if run.state is not None and run.state.type.value in TERMINAL_STATES:
            pytest.fail(f"flow run ended {run.state.type.value} before SFT ran:\n{tail(worker_log)}")
        if time.monotonic() > deadline:
            pytest.fail(f"SFT's ranks not running after {FLOW_RUN_TIMEOUT_S:.0f}s:\n{tail(worker_log)}")
        time.sleep(0.5)
    prefect.cli("prefect", "flow-run", "cancel", flow_run_id)
    wait_for_flow_run(prefect, flow_run_id, worker_log, expected="CANCELLED")


def assert_launches_ended(keeper) -> None:
    """Every process a stage launch started (torchrun, its ranks, stage workers) is gone. The worker reaps
    the flow-run process after the state change, hence a short bounded wait for stragglers to exit."""
    launched = keeper.seen_matching("forge_core.run")
    assert any("torch.distributed.run" in p.cmdline for p in launched), "no torchrun process was ever seen"
    deadline = time.monotonic() + 15.0
    while any(p.still_running() for p in launched) and time.monotonic() < deadline:
        time.sleep(0.5)
    alive = [p for p in launched if p.still_running()]
    assert alive == [], f"launched processes outlived the cancelled flow run: {alive}"


def _task_runs_by_name(prefect: LocalPrefect, flow_run_id) -> dict[str, list]:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    runs = prefect.api(
        lambda client: client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
        )
    )
    by_name: dict[str, list] = {}
    for run in runs:
        by_name.setdefault(run.name.rsplit("-", 1)[0], []).append(run)
    return by_name


def _task_run_logs(prefect: LocalPrefect, task_run_id) -> str:
    from prefect.client.schemas.filters import LogFilter, LogFilterTaskRunId

    logs = prefect.api(
        lambda client: client.read_logs(
            log_filter=LogFilter(task_run_id=LogFilterTaskRunId(any_=[task_run_id]))
        )
    )
    return "\n".join(log.message for log in logs)


def data_commit_times(store: ObjectStore) -> dict[str, str]:
    return {uri: store.read_manifest(uri).committed_at for uri in store.list_committed("data")}


def assert_prepare_skipped(prefect: LocalPrefect, flow_run_id, store: ObjectStore, before: dict) -> None:
    """The re-run after the cancelled run: its prepare_data task run completed by skipping the data
    artifact the cancelled run committed, which keeps its commit time."""
    # The API records task runs from events, a little after the flow run ends: wait for its final state.
    deadline = time.monotonic() + 180.0
    while True:
        runs = _task_runs_by_name(prefect, flow_run_id).get("prepare_data", [])
        if (runs and runs[0].state.is_final()) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    (prepare,) = runs
    assert prepare.state.type.value == "COMPLETED", prepare.state
    assert SKIPPED_LOG in _task_run_logs(prefect, prepare.id)
    assert len(before) == 1 and data_commit_times(store) == before, (before, data_commit_times(store))


def _artifacts(prefect: LocalPrefect, flow_run_id) -> list:
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    return prefect.api(
        lambda client: client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
    )


def _table_rows(artifact) -> list[dict]:
    return json.loads(artifact.data) if isinstance(artifact.data, str) else artifact.data


def assert_ui_artifacts(
    prefect: LocalPrefect, flow_run_id, store: ObjectStore, iterations: int, skipped: tuple[str, ...] = ()
) -> None:
    """Per stage run: a progress artifact, a metrics table and an output markdown naming a committed URI
    (none for a `skipped` stage, which launched nothing); per flow run: the summary."""
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
        expected = 0 if stage in skipped else runs_per_stage[stage]
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


def assert_pools_create_is_idempotent(prefect: LocalPrefect) -> None:
    """`pools create` makes a process work pool, and running it again keeps it."""
    prefect.cli("forgeflow", "pools", "create", "gpu-a")
    again = prefect.cli("forgeflow", "pools", "create", "gpu-a")
    assert "work pool 'gpu-a' exists (type process)" in again.stdout, again.stdout
    pool = prefect.api(lambda client: client.read_work_pool("gpu-a"))
    assert pool.type == "process"


def assert_deployment_is_portable(prefect: LocalPrefect) -> None:
    """Deployed without FORGEFLOW_HOME, the pull step keeps the placeholder for each worker to fill."""
    deployment = prefect.api(lambda client: client.read_deployment_by_name("post-train/demo-cpu"))
    assert deployment.pull_steps == [
        {"prefect.deployments.steps.set_working_directory": {"directory": "{{ $FORGEFLOW_HOME }}"}}
    ]


def assert_ran_on_the_cluster(store: ObjectStore, ray_cluster) -> None:
    """The deployment run on the Ray cluster: SFT as two torchrun nodes on two Ray nodes of pool gpu-a."""
    (sft,) = [store.read_manifest(uri) for uri in store.list_committed("sft")]
    placement = sft.placement
    assert placement["placement"] == "ray" and placement["pool"] == POOL, placement
    pool_ids = {node.node_id for node in ray_cluster.compute.pool_nodes(POOL)}
    assert len({n["node_id"] for n in placement["nodes"]}) == 2 and {n["node_id"] for n in placement["nodes"]} <= pool_ids


def test_deploy_run_and_read_back(ray_cluster, local_prefect: LocalPrefect, process_keeper, tmp_path):
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
    assert_pools_create_is_idempotent(local_prefect)
    local_prefect.cli("prefect", "--no-prompt", "deploy", "--all")
    assert_deployment_is_portable(local_prefect)
    worker_dir = tmp_path / "worker-cwd"  # not the checkout: the deployment's pull step must get there itself
    worker_dir.mkdir()
    worker = local_prefect.start_worker("local-cpu", cwd=worker_dir)
    params = {"config": "configs/tiny_test.yaml", "overrides": overrides}
    store = ObjectStore.from_config(cfg.storage)

    # 1. Cancel a run during SFT (its rank 1 hangs at step 1): the worker SIGTERMs the flow-run process,
    # which must take torchrun and both ranks down with it.
    hanging = run_deployment(
        local_prefect, "post-train/demo-cpu", params, env={"FORGE_FAULT": "hang_rank:1:1@sft"}
    )
    cancel_during_sft(local_prefect, process_keeper, hanging, worker.log_path)
    assert_launches_ended(process_keeper)
    assert store.list_committed("sft") == []
    data_committed = data_commit_times(store)

    # 2. Run again, without the fault, on a Ray cluster joined by address (the test run's cluster_utils raylets,
    # pool gpu-a): the flow run on the worker joins it with the cluster's token and runs every stage there, SFT
    # as two torchrun nodes. The data prep the cancelled run committed is skipped, the rest runs to completion.
    on_cluster = [
        *overrides,
        f"launch.ray_address={ray_cluster.compute.address}",
        "launch.sft.nnodes=2", "launch.sft.nproc_per_node=1",
        *(f"launch.{stage}.pool={POOL}" for stage in ("prepare", "sft", "rollout", "grpo", "evaluate")),
    ]
    params = {"config": "configs/tiny_test.yaml", "overrides": on_cluster}
    flow_run_id = run_deployment(local_prefect, "post-train/demo-cpu", params, env=ray_client_environment(ray_cluster))
    run = wait_for_flow_run(local_prefect, flow_run_id, worker.log_path)

    assert run.parameters == params
    assert_prepare_skipped(local_prefect, run.id, store, data_committed)
    for kind, count in {"sft": 1, "eval": 1, "grpo": cfg.grpo.iterations}.items():
        assert len(store.list_committed(kind)) == count, kind
    assert_ran_on_the_cluster(store, ray_cluster)
    assert_ui_artifacts(local_prefect, run.id, store, cfg.grpo.iterations, skipped=("prepare",))
    assert_nightly_schedule_inactive(local_prefect)
    status = local_prefect.cli("forgeflow", "status", "--config", "configs/tiny_test.yaml", *on_cluster)
    assert re.search(rf"^{run.id}  {run.name} +Completed ", status.stdout, re.MULTILINE), status.stdout
    grpo_line = rf"^grpo\s+{cfg.grpo.iterations} committed"
    assert re.search(grpo_line, status.stdout, re.MULTILINE), status.stdout

    process_keeper.stop_all()
    survivors = process_keeper.survivors()
    assert survivors == [], f"processes outlived the stop: {survivors}"
