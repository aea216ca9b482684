"""Stages placed on the workers of their pools (launch.placement=pool, issue #18), on one cluster of real
processes: a Prefect server, process workers that share nothing but the Prefect API and moto S3, real torchrun
and vLLM. The checks share the module's cluster (conftest.py) and run in file order: the last one stops a worker.

    .venv/bin/python -m pytest tests/cluster -x --durations=20                # all of it (make test-all)
    .venv/bin/python -m pytest tests/cluster -m "not slow" --durations=20     # what make test runs

Every wait waits for an event (a run's state, a marker a fault writes, a worker seen gone) under a generous
bound; none depends on how fast the machine is.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from forge_core.config import load_config
from tests.cluster.cluster import (
    ONE_ITERATION_HELD,
    POST_TRAIN,
    PREPARE_AND_SFT,
    REPO_ROOT,
    TINY_CONFIG,
    Cluster,
    wait_for,
)

# A vLLM engine takes ~100 s to start on a loaded 2-core machine; the full pipeline starts three. `make test`
# runs the cluster's start, one 2-node SFT and one GRPO iteration with the flow lifetimes placed (one engine):
# 2.5 min idle, 7 min on one core beside a busy loop; the other checks are marked slow.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(2400)]

EVENT_WAIT_S = 600.0  # bound on waiting for an event of a pipeline run (a loaded 2-core machine is slow)
STAGE_KINDS = {"data": "prepare", "sft": "sft", "rollouts": "rollout", "grpo": "grpo", "eval": "evaluate"}


def _sft_losses(cluster: Cluster, name: str) -> dict[int, float]:
    """{step: loss} that rank 0 of the `<name>-sft` run logged, read from whichever node wrote it (the last
    value per step: a resumed attempt logs the steps after its checkpoint again)."""
    paths = sorted((cluster.root / "nodes").glob(f"*/work/**/{name}-sft/metrics.jsonl"))
    assert paths, f"no metrics.jsonl of run {name}-sft under any node's folder"
    losses: dict[int, float] = {}
    for path in paths:
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if "loss" in record and "step" in record:
                losses[int(record["step"])] = float(record["loss"])
    return losses


@pytest.fixture(scope="module")
def two_node_sft(cluster: Cluster) -> str:
    """One uninterrupted run of prepare (cpu-small) -> SFT on 2 gpu-a nodes x 1 rank; its flow run id."""
    run_id = cluster.run_pipeline(PREPARE_AND_SFT, cluster.overrides("two-node", "name=two-node"))
    cluster.wait_flow_run(run_id, timeout_s=EVENT_WAIT_S)
    return run_id


def test_two_node_sft_runs_on_both_workers_and_says_so(cluster: Cluster, two_node_sft: str):
    """Prepare on cpu-small's worker, SFT on both gpu-a workers under one launch; the manifests say where, and
    every node run and process ended."""
    prepared, trained = store_manifest(cluster, "two-node", "data"), store_manifest(cluster, "two-node", "sft")
    assert prepared.placement["pool"] == "cpu-small", prepared.placement
    assert [n["worker"] for n in prepared.placement["nodes"]] == ["cpu-small-0"], prepared.placement
    assert trained.placement["pool"] == "gpu-a", trained.placement
    assert sorted(n["worker"] for n in trained.placement["nodes"]) == ["gpu-a-0", "gpu-a-1"], trained.placement
    assert [n["node_rank"] for n in trained.placement["nodes"]] == [0, 1], trained.placement
    assert trained.placement["committed_by"]["worker"] in {"gpu-a-0", "gpu-a-1"}, trained.placement
    # Node workers started with `forgeflow worker start` fork node runs from their zygote (flows/warm_start.py).
    assert prepared.placement["committed_by"]["start"] == trained.placement["committed_by"]["start"] == "warm"
    assert trained.placement["attempt_number"] == 1 and not trained.placement["redirects"], trained.placement
    node_runs = cluster.child_runs(two_node_sft)
    assert sorted(r.name.rsplit("-", 1)[-1] for r in node_runs) == ["node0", "node0", "node1"], [r.name for r in node_runs]
    assert all(r.state.type.value == "COMPLETED" for r in node_runs), [(r.name, r.state.name) for r in node_runs]
    wait_for("no stage process left on any worker", lambda: not cluster.stage_processes(), 120)


@pytest.mark.slow  # 2.5-6 min each on a loaded 2-core machine: `make test-all` / -m slow
def test_two_node_sft_equals_one_node_with_two_ranks(cluster: Cluster, two_node_sft: str):
    """The same SFT on 1 node x 2 ranks (one gpu-a worker) logs the per-step losses the 2-node run did."""
    overrides = cluster.overrides("one-node", "name=one-node", "launch.sft.nnodes=1", "launch.sft.nproc_per_node=2")
    run_id = cluster.run_pipeline(PREPARE_AND_SFT, overrides)
    cluster.wait_flow_run(run_id, timeout_s=EVENT_WAIT_S)
    two_nodes, one_node = _sft_losses(cluster, "two-node"), _sft_losses(cluster, "one-node")
    assert sorted(two_nodes) == sorted(one_node) and len(one_node) >= 2, (two_nodes, one_node)
    for step, loss in one_node.items():
        assert abs(two_nodes[step] - loss) <= 1e-6, (step, two_nodes[step], loss)


def _node_run(cluster: Cluster, run_id: str, suffix: str):
    """The pipeline's running node run whose name ends with `suffix` (e.g. "-node1" of the SFT)."""
    runs = [r for r in cluster.child_runs(run_id) if r.name.endswith(suffix) and r.state and r.state.is_running()]
    return runs[0] if runs else None


@pytest.mark.slow  # 2.5-6 min each on a loaded 2-core machine: `make test-all` / -m slow
def test_node_killed_mid_sft_retries_from_its_checkpoint(cluster: Cluster, two_node_sft: str, tmp_path: Path):
    """Node 1's whole process tree SIGKILLed during SFT step 3 (after the step-2 checkpoint): the attempt is
    retryable, no rank survives on any node, the retry resumes from step 2 and commits what an uninterrupted
    run does."""
    marker = tmp_path / "fault-once"
    env = {"FORGE_FAULT": "hang_rank:1:3@sft", "FORGE_FAULT_ONCE": str(marker)}
    overrides = cluster.overrides("killed", "name=killed", "launch.sft.retries=1")
    run_id = cluster.run_pipeline(PREPARE_AND_SFT, overrides, env=env)
    wait_for("the hang at SFT step 3", marker.exists, EVENT_WAIT_S)
    node_run = wait_for("node 1's run of the SFT", lambda: _node_run(cluster, run_id, "-r0-node1"), 60)
    tree = wait_for("node 1's process tree", lambda: cluster.node_run_tree(str(node_run.id)), 60)
    assert cluster.kill_tree(tree)
    cluster.wait_flow_run(run_id, timeout_s=EVENT_WAIT_S)
    store = cluster.store("killed")
    manifest = store.read_manifest(_sft_uri(cluster, run_id))
    assert manifest.metrics["resumed_from_step"] == 2, manifest.metrics
    (earlier,) = manifest.placement["earlier_attempts"]
    assert earlier["outcome"] == "retryable" and "node 1" in earlier["reason"], earlier
    assert manifest.placement["attempt_number"] == 2
    uninterrupted = store_manifest(cluster, "two-node", "sft")
    assert abs(manifest.metrics["final_loss"] - uninterrupted.metrics["final_loss"]) <= 1e-6
    assert _sft_losses(cluster, "killed") == pytest.approx(_sft_losses(cluster, "two-node"), abs=1e-6)
    policy = {rel: f["sha256"] for rel, f in manifest.files.items() if rel.startswith("policy/")}
    assert policy == {rel: f["sha256"] for rel, f in uninterrupted.files.items() if rel.startswith("policy/")}
    wait_for("no stage process left on any worker", lambda: not cluster.stage_processes(), 120)


def _sft_uri(cluster: Cluster, run_id: str) -> str:
    sft = [r for r in cluster.artifacts(run_id)["sft-output"]]
    assert len(sft) == 1, sft
    return next(word.strip("`") for word in sft[0].data.split() if "://" in word)


@pytest.mark.slow  # two vLLM start-ups: `make test-all` / -m slow
def test_a_lost_resident_is_replaced_and_a_cancel_ends_every_resident(cluster: Cluster):
    """The engines' resident SIGKILLed (its whole process tree) between the GRPO and the evaluate stage: the
    flow sees it lost (its run Crashed; or, should the order come first, the order finds it gone and the attempt
    is retried) and the evaluate stage gets a new resident on a live, free gpu-a worker. Then, with both
    residents live and the flow holding, the pipeline run is cancelled: every resident run ends and no engine or
    trainer process is left on any worker."""
    cluster.wait_workers(["gpu-a-0", "gpu-a-1"], live=True)
    name = "resident-lost"
    overrides = cluster.overrides(
        name, f"name={name}", "rollout.engine_lifetime=flow", "grpo.trainer_lifetime=flow", "launch.sft.nnodes=1",
        "launch.evaluate.retries=1",
    )
    store = cluster.store(name)
    resume, release = store.join(store.root, "resume"), store.join(store.root, "release")

    def engine_residents() -> list:
        runs = [run for run in cluster.child_runs(run_id) if run.name.startswith("resident-task_process")]
        return sorted(runs, key=lambda run: run.created)

    run_id = cluster.run_pipeline(ONE_ITERATION_HELD, overrides, resume_uri=resume, release_uri=release)
    try:
        wait_for("the GRPO stage committed", lambda: _committed(cluster, name, "grpo"), EVENT_WAIT_S)
        first = engine_residents()
        assert len(first) == 1, [run.name for run in cluster.child_runs(run_id)]
        tree = wait_for("the resident's processes", lambda: cluster.node_run_tree(str(first[0].id)), 60)
        assert cluster.kill_tree(tree)
        wait_for("the killed resident's run final", lambda: cluster.flow_run(str(first[0].id)).state.is_final(), 180)
        store.put_bytes(resume, b"")
        wait_for("the evaluation committed", lambda: _committed(cluster, name, "eval"), EVENT_WAIT_S)
        runs = engine_residents()
        assert [run.state.type.value for run in runs] == ["CRASHED", "RUNNING"], [(r.name, r.state) for r in runs]
        placement = store_manifest(cluster, name, "eval").placement
        assert placement["resident"] == "engines" and placement["pool"] == "gpu-a", placement
        assert cluster.stage_processes("forge_core.rollout.service") and cluster.stage_processes("grpo-job")
        cluster.cancel(run_id)
        cluster.wait_flow_run(run_id, expected="CANCELLED", timeout_s=EVENT_WAIT_S)
    finally:
        store.put_bytes(resume, b"")
        store.put_bytes(release, b"")
    wait_for(
        "every resident run final",
        lambda: all(run.state.is_final() for run in cluster.child_runs(run_id)),
        180,
    )
    wait_for("no engine or trainer process left on any worker", lambda: not cluster.stage_processes(), 180)
    assert not cluster.stage_processes("forge_core.rollout.service")


def store_manifest(cluster: Cluster, store_name: str, kind: str):
    """The one committed manifest of `kind` in the cluster store `store_name`."""
    store = cluster.store(store_name)
    found = [
        store.read_manifest(uri.rsplit("/_MANIFEST.json", 1)[0])
        for uri in store.list_files(store.root)
        if uri.endswith("/_MANIFEST.json")
    ]
    found = [m for m in found if m.kind == kind]
    assert len(found) == 1, [m.kind for m in found]
    return found[0]


@pytest.mark.slow  # 2.5-6 min each on a loaded 2-core machine: `make test-all` / -m slow
def test_cancelling_the_pipeline_ends_every_rank_on_every_node(cluster: Cluster, tmp_path: Path):
    """Cancelled while both SFT nodes run (rank 0 hangs at step 1, rank 1 waits for it): the pipeline run and
    its node runs end, and no process of any stage is left on any worker."""
    marker = tmp_path / "fault-once"
    env = {"FORGE_FAULT": "hang_rank:0:1@sft", "FORGE_FAULT_ONCE": str(marker)}
    run_id = cluster.run_pipeline(PREPARE_AND_SFT, cluster.overrides("cancelled", "name=cancelled"), env=env)
    wait_for("the hang at SFT step 1", marker.exists, EVENT_WAIT_S)
    assert len(cluster.stage_processes("forge_core.run sft")) >= 2
    cluster.cancel(run_id)
    cluster.wait_flow_run(run_id, expected="CANCELLED", timeout_s=EVENT_WAIT_S)
    wait_for("every node run of the pipeline final",
             lambda: all(r.state.is_final() for r in cluster.child_runs(run_id)), 180)
    wait_for("no stage process left on any worker", lambda: not cluster.stage_processes(), 180)


def _committed(cluster: Cluster, store_name: str, kind: str) -> bool:
    """Whether an artifact of `kind` is committed in the cluster store `store_name`."""
    store = cluster.store(store_name)
    return any(uri.endswith("/_MANIFEST.json") and f"/{kind}/" in uri for uri in store.list_files(store.root))


def _residents(cluster: Cluster, store_name: str, run_id: str) -> dict[str, dict]:
    """{"engines-gpu-a": its service record, ...}: the residents of flow run `run_id` that published an address."""
    store = cluster.store(store_name)
    found = {}
    for uri in store.list_files(store.join(store.root, "_residents", run_id)):
        if uri.endswith("/service.json"):
            name = uri.split("/_residents/", 1)[1].split("/")[1]
            found[name] = json.loads(store.get_bytes(uri))
    return found


def _process_on_worker(cluster: Cluster, fragment: str) -> str | None:
    """The worker whose folder (FORGE_NODE_DIR) a live process with `fragment` in its command line runs in."""
    for proc in cluster.stage_processes(fragment):
        node_dir = Path(proc.environ()["FORGE_NODE_DIR"])
        for name in cluster.workers:
            if node_dir == cluster.worker_dir(name) / "work":
                return name
    return None


def test_flow_lifetimes_run_on_their_pools_workers(cluster: Cluster, monkeypatch):
    """One GRPO iteration with the flow lifetimes placed: the run's vLLM engine and its trainer job run on gpu-a's
    workers (a resident each, holding its worker), the stages reach them over TCP with the run's secret, and a
    client without that secret is refused; the manifests name the worker; everything ends with the flow. The
    flow holds its residents until the test has looked (tests/cluster/pipelines.py: one_iteration_held)."""
    from multiprocessing.connection import AuthenticationError

    from forge_core.run import resident

    cluster.wait_workers(["gpu-a-0", "gpu-a-1"], live=True)
    name = "residents"
    overrides = cluster.overrides(
        name, f"name={name}", "rollout.engine_lifetime=flow", "grpo.trainer_lifetime=flow", "launch.sft.nnodes=1"
    )
    store = cluster.store(name)
    release = store.join(store.root, "release-the-residents")
    run_id = cluster.run_pipeline(ONE_ITERATION_HELD, overrides, release_uri=release)
    try:
        # Both residents serve from their first stage on, and stay until the release.
        wait_for("the iteration's evaluation committed", lambda: _committed(cluster, name, "eval"), EVENT_WAIT_S)
        services = _residents(cluster, name, run_id)
        assert sorted(services) == ["engines-gpu-a", "trainer-gpu-a"], services
        hosts = {key: service["worker"] for key, service in services.items()}
        assert sorted(hosts.values()) == ["gpu-a-0", "gpu-a-1"], hosts  # each holds a worker of its own
        # The processes run in their resident's worker's folder, not on the flow's machine.
        assert _process_on_worker(cluster, "forge_core.rollout.service") == hosts["engines-gpu-a"]
        assert _process_on_worker(cluster, "grpo-job") == hosts["trainer-gpu-a"]
        # The channel: the run's secret (the cluster key's HMAC with this flow run id) gets in, nothing else.
        monkeypatch.setenv(resident.CLUSTER_KEY_ENV, cluster.cluster_key)
        this_run = load_config(str(REPO_ROOT / TINY_CONFIG), [*overrides, f"launch.run_id={run_id}"])
        other_run = load_config(str(REPO_ROOT / TINY_CONFIG), [*overrides, "launch.run_id=another-run"])
        for key in ("engines-gpu-a", "trainer-gpu-a"):
            address = (services[key]["host"], int(services[key]["port"]))
            for wrong in (resident.run_secret(other_run), b"0" * 32):
                with pytest.raises(AuthenticationError):
                    resident.connect(address, wrong)
            resident.connect(address, resident.run_secret(this_run)).close()
    finally:
        store.put_bytes(release, b"")
    cluster.wait_flow_run(run_id, timeout_s=EVENT_WAIT_S)

    for kind, key in (("rollouts", "engines-gpu-a"), ("eval", "engines-gpu-a"), ("grpo", "trainer-gpu-a")):
        placement = store_manifest(cluster, name, kind).placement
        workers = [node["worker"] for node in placement["nodes"]]
        assert (placement["pool"], placement["resident"], workers) == ("gpu-a", key.split("-")[0], [hosts[key]])
    residents = {run.name: run for run in cluster.child_runs(run_id) if run.name.startswith("resident-")}
    assert sorted(n.split("-")[1] for n in residents) == ["task_process", "trainer_job"], residents
    assert {run.state.type.value for run in residents.values()} == {"COMPLETED"}, residents
    for run in residents.values():
        assert cluster.logs(str(run.id)).count("without this run's secret") == 2, cluster.logs(str(run.id))
    logs = cluster.logs(run_id, limit=100_000)  # all of them
    assert cluster.cluster_key not in logs and resident.run_secret(this_run).hex() not in logs
    assert all(run.state.is_final() for run in cluster.child_runs(run_id))
    wait_for("no engine or trainer process left", lambda: not cluster.stage_processes(), 180)
    assert not cluster.stage_processes("forge_core.rollout.service")


@pytest.mark.slow
def test_pipeline_runs_on_the_workers_of_its_pools(cluster: Cluster):
    """The whole tiny pipeline placed: prepare on cpu-small, SFT on both gpu-a workers (2 nodes x 1 rank),
    rollouts, GRPO and evals on gpu-a; completes, and every manifest and the placement table artifact name
    where the stage ran. (Slow: three vLLM start-ups.)"""
    cluster.wait_workers(["gpu-a-0", "gpu-a-1"], live=True)
    run_id = cluster.run_pipeline(POST_TRAIN, cluster.overrides("full", "name=placed"))
    cluster.wait_flow_run(run_id, timeout_s=EVENT_WAIT_S * 2)
    store = cluster.store("full")
    uris = {row["stage"]: row["artifact"] for row in cluster.table(run_id, "post-train-stages")}
    assert {"prepare", "sft", "rollout-1", "grpo-1", "eval-sft", "eval-grpo-1"} <= set(uris), uris
    for label, uri in uris.items():
        placement = store.read_manifest(uri).placement
        assert placement is not None, f"{label}: manifest records no placement"
        workers = [node["worker"] for node in placement["nodes"]]
        if label == "prepare":
            assert (placement["pool"], workers) == ("cpu-small", ["cpu-small-0"]), placement
        elif label == "sft":
            assert placement["pool"] == "gpu-a" and sorted(workers) == ["gpu-a-0", "gpu-a-1"], placement
        else:
            assert placement["pool"] == "gpu-a" and len(workers) == 1 and workers[0].startswith("gpu-a-"), placement
    rows = cluster.table(run_id, "post-train-placement")
    assert sorted(row["worker"] for row in rows if row["stage"] == "sft") == ["gpu-a-0", "gpu-a-1"], rows
    assert {row["stage"] for row in rows} == set(uris), rows
    assert all(run.state.is_final() for run in cluster.child_runs(run_id))
    wait_for("no stage process left on any worker", lambda: not cluster.stage_processes(), 120)


@pytest.mark.slow  # 2.5-6 min each on a loaded 2-core machine: `make test-all` / -m slow
def test_worker_down_one_node_stages_move_and_two_node_stage_fails_clearly(cluster: Cluster):
    """gpu-a-1 stopped before the run: prepare (1 node, on gpu-a here) runs on gpu-a-0; the 2-node SFT fails
    after launch.pool_wait_s naming the pool's state and the fix."""
    cluster.stop_worker("gpu-a-1")
    cluster.wait_workers(["gpu-a-1"], live=False)
    overrides = cluster.overrides("worker-down", "name=worker-down", "launch.prepare.pool=gpu-a", "launch.pool_wait_s=20")
    run_id = cluster.run_pipeline(PREPARE_AND_SFT, overrides)
    run = cluster.wait_flow_run(run_id, expected="FAILED", timeout_s=EVENT_WAIT_S)
    logs = cluster.logs(run_id)
    assert "launch.pool_wait_s=20" in logs and "gpu-a-1 (not live" in logs, f"{run.state.message}\n{logs}"
    prepared = store_manifest(cluster, "worker-down", "data")
    assert [node["worker"] for node in prepared.placement["nodes"]] == ["gpu-a-0"], prepared.placement
