"""The worker of a node: Prefect's process worker, whose stage-node runs start warm (flows/warm_start.py).

    forgeflow worker start gpu-a --name node-7        # on node 7: polls its own queue node-7 of pool gpu-a

It is `prefect worker start --pool gpu-a --name node-7 --work-queue node-7` (which works too, with a cold start
per node run) plus two things:
- the worker's own work queue, through which placement pins node runs to it, is created when missing;
- a zygote, started beside the worker and ending with it, forks each `stage-node` run from an interpreter that
  already imported Prefect, the stage-node flow and torch. Runs of other flows start as the process worker
  starts them. Everything else (polling, cancellation, crash reports, heartbeats) is the process worker's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile

from prefect.utilities.processutils import command_to_string
from prefect.workers.process import ProcessJobConfiguration, ProcessWorker

from flows.warm_start import ENGINE_ARGV, SOCKET_ENV
from tasks.placement import STAGE_FLOW_NAME

NODE_QUERY_S = 1.0
PREFECT_DEFAULT_QUERY_S = 10.0
_SOCKET_PATH_MAX = 100  # AF_UNIX paths stop at 107 bytes; a deep TMPDIR falls back to /tmp


class NodeJobConfiguration(ProcessJobConfiguration):
    """The process job configuration, with the warm-start client as the command of stage-node runs when this
    worker has a zygote and the deployment did not set a command of its own."""

    def prepare_for_flow_run(self, flow_run, deployment=None, flow=None, work_pool=None, worker_name=None, worker_id=None):
        super().prepare_for_flow_run(flow_run, deployment, flow, work_pool, worker_name, worker_id=worker_id)
        default = command_to_string([sys.executable, *ENGINE_ARGV])  # what ProcessJobConfiguration set
        if flow is not None and flow.name == STAGE_FLOW_NAME and self.command == default and self.env.get(SOCKET_ENV):
            self.command = command_to_string([sys.executable, "-m", "flows.warm_start"])


class NodeWorker(ProcessWorker):
    """A process worker (the pool's type stays "process") whose job configuration starts stage-node runs warm."""

    job_configuration = NodeJobConfiguration

    @classmethod
    def __dispatch_key__(cls) -> str:
        return "forgeflow-node"  # Prefect's registry of worker types keeps "process" for ProcessWorker


def _socket_path() -> str:
    folder = tempfile.mkdtemp(prefix="ffw-")  # 0700: only this user reaches the zygote
    if len(folder) + 8 > _SOCKET_PATH_MAX:
        os.rmdir(folder)
        folder = tempfile.mkdtemp(prefix="ffw-", dir="/tmp")
    return os.path.join(folder, "zygote")


@contextlib.contextmanager
def zygote_beside():
    """The node's zygote as a child of this process (it also exits by itself when this process ends); its
    socket goes into this process's environment, which every run's environment starts from."""
    path = _socket_path()
    zygote = subprocess.Popen([sys.executable, "-m", "flows.warm_start", "serve", path])
    os.environ[SOCKET_ENV] = path
    try:
        yield zygote
    finally:
        os.environ.pop(SOCKET_ENV, None)
        zygote.terminate()
        try:
            zygote.wait(timeout=10)
        except subprocess.TimeoutExpired:
            zygote.kill()
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def query_seconds(poll_s: float | None) -> float:
    """How often the worker asks for runs: `poll_s` when given, else PREFECT_WORKER_QUERY_SECONDS when set away
    from Prefect's default, else NODE_QUERY_S (every placed stage waits up to this for its node run to start;
    Prefect's default 10 s would add 5 s to each on average)."""
    from prefect.settings import PREFECT_WORKER_QUERY_SECONDS

    if poll_s is not None:
        if poll_s <= 0:
            raise ValueError(f"--poll-s={poll_s}: must be > 0 (seconds between the worker's polls, e.g. 1)")
        return poll_s
    configured = PREFECT_WORKER_QUERY_SECONDS.value()
    return NODE_QUERY_S if configured == PREFECT_DEFAULT_QUERY_S else configured


async def _serve(pool: str, name: str) -> None:
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_WORKER_HEARTBEAT_SECONDS, PREFECT_WORKER_PREFETCH_SECONDS

    from flows.pools import ensure_work_pool, ensure_worker_queue

    async with get_client() as client:
        await ensure_work_pool(client, pool)  # as a Prefect worker would; `forgeflow pools create` does the rest
        await ensure_worker_queue(client, pool, name)
    worker = NodeWorker(
        name=name,
        work_pool_name=pool,
        work_queues=[name],
        prefetch_seconds=PREFECT_WORKER_PREFETCH_SECONDS.value(),
        heartbeat_interval_seconds=int(PREFECT_WORKER_HEARTBEAT_SECONDS.value()),
    )
    await worker.start()


def run_node_worker(pool: str, name: str, poll_s: float | None = None) -> int:
    """Run the node's worker (module docstring) until it is stopped: SIGINT or SIGTERM stops polling and lets
    the running flow runs finish, as with `prefect worker start`; a second one kills."""
    from prefect.settings import PREFECT_WORKER_QUERY_SECONDS, temporary_settings
    from prefect.utilities.processutils import setup_signal_handlers_worker

    seconds = query_seconds(poll_s)
    setup_signal_handlers_worker(os.getpid(), f"the node worker {name!r}", print)
    with zygote_beside(), temporary_settings(updates={PREFECT_WORKER_QUERY_SECONDS: seconds}):
        try:
            asyncio.run(_serve(pool, name))
        except (KeyboardInterrupt, asyncio.CancelledError):
            print(f"worker {name!r} stopped")
    return 0
