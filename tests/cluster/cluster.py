"""A cluster of Prefect workers on one machine, for placement tests and bench/stage_dispatch.py.

`prefect server start` on loopback; `forgeflow pools create` for the pools (each gets its stage deployment);
process workers, each started as on its own node: its own HOME, TMPDIR, PREFECT_HOME and working folder
(FORGE_NODE_DIR), its own work queue named after it, FORGE_NODE_ADDRESS=127.0.0.1 and the cluster's one
FORGE_CLUSTER_KEY (forge_core.run.resident), so nothing can pass between two workers (or the flow) through a
local path: the object store (moto S3) and the Prefect API are all they share. Pipelines run as deployment runs on a worker of the `local-cpu` pool, like a production flow run.

    cluster = Cluster(root, s3_endpoint, workers={"cpu-small": 1, "gpu-a": 2, "local-cpu": 1}).start()
    run_id = cluster.run_pipeline(PIPELINE, overrides, env={"FORGE_FAULT": ...})
    run = cluster.wait_flow_run(run_id)
    cluster.stop()

Timing settings: workers poll every second (PREFECT_WORKER_QUERY_SECONDS=1) and beat every 2 s; the server's
foreman marks a worker offline after 10 missed beats and a queue not ready 30 s after its last poll, checked
every second, so a stopped worker is seen as gone in ~30 s instead of ~60-90 s (fewer missed beats made
workers of a machine loaded to 19 on 2 cores flap between online and offline).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import signal
import tempfile
import time
import uuid
from pathlib import Path

import psutil

from tests.deploy.conftest import (
    REPO_ROOT,
    SERVER_STARTUP_TIMEOUT_S,
    VENV_BIN,
    LocalPrefect,
    ProcessKeeper,
    Started,
    free_port,
    isolated_prefect_env,
    tail,
    wait_until_healthy,
)

PIPELINE_POOL = "local-cpu"
POST_TRAIN = "post-train/cluster"  # flows.post_train.post_train
PREPARE_AND_SFT = "cluster-sft/cluster"  # tests.cluster.pipelines.prepare_and_sft
ONE_ITERATION_HELD = "cluster-held/cluster"  # tests.cluster.pipelines.one_iteration_held
TINY_CONFIG = "configs/tiny_test.yaml"
TERMINAL_STATES = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
SERVER_SETTINGS = {
    "PREFECT_SERVER_SERVICES_FOREMAN_LOOP_SECONDS": "1",
    "PREFECT_SERVER_SERVICES_FOREMAN_WORK_QUEUE_LAST_POLLED_TIMEOUT_SECONDS": "30",
    "PREFECT_SERVER_SERVICES_FOREMAN_INACTIVITY_HEARTBEAT_MULTIPLE": "10",
}
WORKER_SETTINGS = {"PREFECT_WORKER_QUERY_SECONDS": "1", "PREFECT_WORKER_HEARTBEAT_SECONDS": "2"}


class ClusterError(AssertionError):
    """Something of the cluster did not happen within its bound (the message has the logs)."""


class Cluster:
    """The server, its pools and deployments, and named workers (module docstring)."""

    def __init__(self, root: Path, s3_endpoint: str, workers: dict[str, int]) -> None:
        self.root = root
        self.s3_endpoint = s3_endpoint
        self.pool_sizes = dict(workers)
        self.keeper = ProcessKeeper(log_dir=root)
        self.prefect: LocalPrefect | None = None
        self.workers: dict[str, Started] = {}
        self.worker_pool: dict[str, str] = {}
        self.bucket = f"forge-cluster-{uuid.uuid4().hex[:10]}"
        # FORGE_CLUSTER_KEY of every worker: the flow lifetimes' residents derive each run's secret from it.
        self.cluster_key = secrets.token_hex(32)
        self.short_dirs: list[Path] = []

    # ---- lifecycle

    def start(self) -> Cluster:
        port = free_port()
        home = self.root / "server-home"
        home.mkdir(parents=True)
        env = {**isolated_prefect_env(home, port), **SERVER_SETTINGS}
        argv = [str(VENV_BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)]
        server = self.keeper.start("server", argv, env, self.root)
        wait_until_healthy(server, env["PREFECT_API_URL"], SERVER_STARTUP_TIMEOUT_S)
        self.prefect = LocalPrefect(self.keeper, env, env["PREFECT_API_URL"], server)
        for pool, count in self.pool_sizes.items():
            for index in range(count):
                self.start_worker(f"{pool}-{index}", pool)
        with self.api_settings():
            from flows.cli import main as forgeflow

            for pool in sorted({PIPELINE_POOL, *self.pool_sizes}):
                names = [f"--worker={pool}-{index}" for index in range(self.pool_sizes.get(pool, 0))]
                assert forgeflow(["pools", "create", pool, *(names if pool != PIPELINE_POOL else [])]) == 0
        self.prefect.api(self._create_pipeline_deployments)
        self.wait_workers(list(self.workers), live=True)
        self._create_bucket()
        return self

    def stop(self) -> list:
        """Stop everything; returns the processes that outlived the orderly stop (then killed)."""
        self.keeper.stop_all()
        survivors = self.keeper.survivors()
        self.keeper.kill_survivors()
        for folder in self.short_dirs:
            shutil.rmtree(folder, ignore_errors=True)
        return survivors

    # ---- workers

    def worker_dir(self, name: str) -> Path:
        return self.root / "nodes" / name

    def api_settings(self):
        """This process's Prefect client pointed at the cluster's server (a context manager)."""
        from prefect.settings import PREFECT_API_URL, temporary_settings

        return temporary_settings(updates={PREFECT_API_URL: self.prefect.api_url})

    def start_worker(self, name: str, pool: str) -> Started:
        """A process worker as on a node of its own. On a stage pool it polls its own queue `name` (placement
        pins node runs through it); on the pipeline pool every queue (pipelines go to the default one)."""
        node = self.worker_dir(name)
        folders = {key: node / key for key in ("home", "prefect", "work")}
        # A short private TMPDIR: the engine services' Unix sockets live under it (107 bytes at most).
        folders["tmp"] = Path(tempfile.mkdtemp(prefix=f"fc-{name}-", dir="/tmp"))
        self.short_dirs.append(folders["tmp"])
        for folder in folders.values():
            folder.mkdir(parents=True, exist_ok=True)
        env = {
            **self.prefect.env,
            **WORKER_SETTINGS,
            "HOME": str(folders["home"]),
            "TMPDIR": str(folders["tmp"]),
            "PREFECT_HOME": str(folders["prefect"]),
            "FORGE_NODE_DIR": str(folders["work"]),
            "FORGE_NODE_ADDRESS": "127.0.0.1",
            "FORGE_CLUSTER_KEY": self.cluster_key,
            "PYTHONPATH": str(REPO_ROOT),  # the test pipelines (tests.cluster.pipelines) are not installed
        }
        env.pop("PREFECT_API_DATABASE_CONNECTION_URL", None)
        if pool == PIPELINE_POOL:
            argv = [str(VENV_BIN / "prefect"), "worker", "start", "--pool", pool, "--name", name]
        else:  # a node's worker: its own queue, and node runs forked warm (flows/node_worker.py)
            argv = [str(VENV_BIN / "forgeflow"), "worker", "start", pool, "--name", name]
        started = self.keeper.start(f"worker-{name}", argv, env, folders["work"])
        self.workers[name] = started
        self.worker_pool[name] = pool
        return started

    def stop_worker(self, name: str) -> None:
        self.keeper.stop(self.workers[name])

    def worker_slots(self, pool: str) -> dict:
        """{worker: WorkerSlot} as placement sees them (tasks.placement.PrefectDispatcher)."""
        from tasks.placement import PrefectDispatcher

        with self.api_settings():
            return {slot.name: slot for slot in PrefectDispatcher().workers(pool)}

    def wait_workers(self, names: list[str], live: bool, timeout_s: float = 180.0) -> None:
        """Until placement sees every stage-pool worker in `names` live (or, with live=False, not live); a
        worker of the pipeline pool, which has no queue of its own, until Prefect says it is ONLINE."""
        deadline = time.monotonic() + timeout_s
        while True:
            states = {}
            for name in names:
                pool = self.worker_pool[name]
                if pool == PIPELINE_POOL:
                    online = [w for w in self.prefect.api(lambda c, p=pool: c.read_workers_for_work_pool(p))
                              if w.name == name and w.status.value == "ONLINE"]
                    states[name] = "online" if online else None
                    continue
                states[name] = self.worker_slots(pool).get(name)
            if all(slot is not None and (slot == "online" or slot.live == live) for slot in states.values()):
                return
            if time.monotonic() > deadline:
                logs = "\n".join(f"--- {n} ---\n{tail(self.workers[n].log_path, 20)}" for n in names)
                raise ClusterError(f"workers not {'live' if live else 'gone'} after {timeout_s:.0f} s: {states}\n{logs}")
            time.sleep(1.0)

    # ---- runs

    async def _create_pipeline_deployments(self, client) -> None:
        from flows.post_train import post_train
        from flows.stage_deployment import ensure_module_deployment
        from tests.cluster.pipelines import one_iteration_held, prepare_and_sft

        for deployment, entrypoint, fn in (
            (POST_TRAIN, "flows.post_train.post_train", post_train),
            (PREPARE_AND_SFT, "tests.cluster.pipelines.prepare_and_sft", prepare_and_sft),
            (ONE_ITERATION_HELD, "tests.cluster.pipelines.one_iteration_held", one_iteration_held),
        ):
            await ensure_module_deployment(client, fn, deployment.split("/")[1], PIPELINE_POOL, entrypoint)

    def run_pipeline(
        self,
        deployment: str,
        overrides: list[str],
        env: dict[str, str] | None = None,
        config: str = TINY_CONFIG,
        **more_params,
    ) -> str:
        """Start a run of `deployment` (`config`, the tiny test config by default, with `overrides` and any
        further parameters of its flow); returns its flow run id."""
        params = {"config": str(REPO_ROOT / config), "overrides": overrides, **more_params}

        async def create(client):
            found = await client.read_deployment_by_name(deployment)
            run = await client.create_flow_run_from_deployment(
                found.id, parameters=params, job_variables={"env": env} if env else None
            )
            return str(run.id)

        return self.prefect.api(create)

    def flow_run(self, run_id: str):
        return self.prefect.api(lambda client: client.read_flow_run(run_id))

    def wait_flow_run(self, run_id: str, expected: str = "COMPLETED", timeout_s: float = 900.0):
        """The flow run once terminal; ClusterError with its logs unless it ended `expected`."""
        deadline = time.monotonic() + timeout_s
        while True:
            run = self.flow_run(run_id)
            if run.state is not None and run.state.type.value in TERMINAL_STATES:
                break
            if time.monotonic() > deadline:
                raise ClusterError(f"flow run {run_id} not finished after {timeout_s:.0f} s\n{self.logs(run_id)}")
            time.sleep(1.0)
        if run.state.type.value != expected:
            raise ClusterError(
                f"flow run {run_id} ended {run.state.type.value} (expected {expected}): {run.state.message}\n"
                f"{self.logs(run_id)}"
            )
        return run

    def logs(self, run_id: str, limit: int = 200) -> str:
        """The last log lines of a flow run and of its subflow (node) runs, oldest first."""
        from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
        from prefect.client.schemas.sorting import LogSort

        ids = [run_id, *(str(r.id) for r in self.child_runs(run_id))]
        newest: list = []
        while len(newest) < limit:  # the API returns at most 200 records a call
            page_size, offset = min(200, limit - len(newest)), len(newest)
            page = self.prefect.api(
                lambda client, size=page_size, skip=offset: client.read_logs(
                    log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=ids)),
                    sort=LogSort.TIMESTAMP_DESC,
                    limit=size,
                    offset=skip,
                )
            )
            newest += page
            if len(page) < 200:
                break
        return "\n".join(log.message for log in reversed(newest))

    def child_runs(self, run_id: str) -> list:
        """The subflow runs of a flow run (its stages' node runs)."""
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

        return self.prefect.api(
            lambda client: client.read_flow_runs(
                flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[run_id]))
            )
        )

    def artifacts(self, run_id: str) -> dict[str, list]:
        from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

        found = self.prefect.api(
            lambda client: client.read_artifacts(
                artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run_id]))
            )
        )
        by_key: dict[str, list] = {}
        for artifact in found:
            by_key.setdefault(artifact.key, []).append(artifact)
        return by_key

    def table(self, run_id: str, key: str) -> list[dict]:
        """The rows of the run's one table artifact `key` (e.g. post-train-stages)."""
        found = self.artifacts(run_id).get(key, [])
        assert len(found) == 1, f"flow run {run_id}: {len(found)} artifacts {key!r}"
        data = found[0].data
        return json.loads(data) if isinstance(data, str) else data

    def cancel(self, run_id: str) -> None:
        self.prefect.cli("prefect", "flow-run", "cancel", run_id)

    # ---- processes

    def stage_processes(self, fragment: str = "forge_core.run") -> list[psutil.Process]:
        """Live processes of any stage launch of this cluster's workers (their node runs launch them; other
        processes on a shared machine are not ours: they lack a FORGE_NODE_DIR of this cluster)."""
        found = []
        for proc in psutil.process_iter(["cmdline"]):
            cmdline = " ".join(proc.info["cmdline"] or [])
            if fragment not in cmdline or proc.pid == os.getpid():
                continue
            try:
                ours = proc.environ().get("FORGE_NODE_DIR", "").startswith(str(self.root))
                if ours and proc.status() != psutil.STATUS_ZOMBIE:
                    found.append(proc)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return found

    def node_run_tree(self, node_run_id: str) -> list[psutil.Process]:
        """The process of a node run (its PREFECT__FLOW_RUN_ID) and everything below it: one node's tree. Started
        warm (flows/warm_start.py), that is the client and the engine its worker's zygote forked for it, with
        the engine's descendants (a worker runs one node run at a time here: the zygote's child is this run's)."""
        for proc in psutil.process_iter():
            try:
                cmdline = " ".join(proc.cmdline())
                if proc.environ().get("PREFECT__FLOW_RUN_ID") != node_run_id:
                    continue
                if "prefect.engine" in cmdline:
                    return [proc, *proc.children(recursive=True)]
                if "flows.warm_start" in cmdline:
                    zygotes = [p for p in proc.parent().children() if "serve" in p.cmdline()]
                    engines = [e for z in zygotes for e in z.children() if e.create_time() >= proc.create_time()]
                    return [proc, *[p for e in engines for p in (e, *e.children(recursive=True))]]
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return []

    @staticmethod
    def kill_tree(procs: list[psutil.Process]) -> list[int]:
        killed = []
        for proc in procs:
            try:
                proc.send_signal(signal.SIGKILL)
                killed.append(proc.pid)
            except psutil.NoSuchProcess:
                continue
        return killed

    # ---- the store

    def _create_bucket(self) -> None:
        import boto3

        boto3.client("s3", endpoint_url=self.s3_endpoint, region_name="us-east-1").create_bucket(Bucket=self.bucket)

    def store_root(self, name: str) -> str:
        return f"s3://{self.bucket}/{name}"

    def store(self, name: str):
        from forge_core.storage import ObjectStore

        return ObjectStore(self.store_root(name), endpoint_url=self.s3_endpoint)

    def overrides(self, name: str, *extra: str) -> list[str]:
        """The tiny config placed on the pools: prepare on cpu-small, every other stage on gpu-a, SFT on 2
        nodes x 1 rank, the store at `name` in the cluster's bucket."""
        return [
            f"storage.root={self.store_root(name)}",
            f"storage.endpoint_url={self.s3_endpoint}",
            "launch.placement=pool",
            "launch.prepare.pool=cpu-small",
            *(f"launch.{stage}.pool=gpu-a" for stage in ("sft", "rollout", "grpo", "evaluate")),
            "launch.sft.nnodes=2",
            "launch.sft.nproc_per_node=1",
            "launch.node_start_s=180",  # a worker of a loaded machine takes a while to poll and start a run
            *extra,
        ]


def read_json_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_for(what: str, check, timeout_s: float, every_s: float = 0.5):
    """`check()`'s first truthy value, polled every `every_s`; ClusterError naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise ClusterError(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(every_s)


def environment_without_prefect() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}


def run_async(coroutine):
    return asyncio.run(coroutine)
