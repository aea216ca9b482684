"""The Prefect side of stage placement on pools (launch.placement=pool): forge_core.run.placement's dispatcher.

    dispatcher = PrefectDispatcher()
    runner_for(cfg, "sft", dispatcher)                     # forge_core.run.runners: a PoolRunner

A node run is a run of the pool's stage deployment `stage-node/<pool>` (flows/stage_deployment.py; made by
`forgeflow pools create <pool>`), started from the stage task with `run_deployment(..., as_subflow=True,
timeout=0)` so that the UI nests it under the task, and pinned to one worker through that worker's own work
queue (a worker started with `--work-queue <its name>`: job variables cannot pin a run, per-worker queues do).
What Prefect 3.7 does not do for us, the PoolRunner does (docs/architecture.md, "Placement on pools"):
`run_deployment` never raises (a crashed node run is a Crashed state: the runner checks), a run on a queue
without a live worker stays Late forever (the runner waits launch.node_start_s, then redirects), a lost machine
leaves its run Running (the runner and the peers judge the node's heartbeat in the store), cancelling the
pipeline does not cancel the node runs (the runner cancels them: `cancel` here).

Liveness of a worker is Prefect's own: the worker ONLINE (its heartbeats, PREFECT_WORKER_HEARTBEAT_SECONDS)
and its queue READY (polled within the server's PREFECT_SERVER_SERVICES_FOREMAN_WORK_QUEUE_LAST_POLLED_
TIMEOUT_SECONDS, 60 s by default). Busy: its queue holds a run that is scheduled, pending, running or
cancelling.
"""

from __future__ import annotations

import contextvars

import httpx
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterParentFlowRunId,
    FlowRunFilterState,
    FlowRunFilterStateType,
    WorkPoolFilter,
    WorkPoolFilterName,
)
from prefect.client.schemas.objects import StateType, WorkerStatus, WorkQueueStatus
from prefect.deployments import run_deployment
from prefect.exceptions import ObjectNotFound
from prefect.states import Cancelled, Cancelling

from forge_core.launch import RetryableStageError
from forge_core.run.placement import NodeOrder, NodeRunState, WorkerSlot

STAGE_FLOW_NAME = "stage-node"
UNFINISHED = (StateType.SCHEDULED, StateType.PENDING, StateType.RUNNING, StateType.CANCELLING, StateType.PAUSED)


def stage_deployment_name(pool: str) -> str:
    """`stage-node/<pool>`: the deployment whose runs are the node runs of stages placed on `pool`."""
    return f"{STAGE_FLOW_NAME}/{pool}"


class PrefectApiUnavailable(RetryableStageError):
    """The Prefect API did not answer (after its client's own retries): the attempt is retried."""


def _api_call(what: str, fn, *args, **kwargs):
    """`fn(*args)`, a transport failure turned into a retryable error naming `what` (Prefect's client already
    retried it)."""
    try:
        return fn(*args, **kwargs)
    except httpx.TransportError as exc:
        raise PrefectApiUnavailable(f"Prefect API unavailable while {what}: {exc}") from exc


def _node_run_name(order: NodeOrder) -> str:
    """`<stage>-<attempt>-r<round>-node<rank>`; a resident's: `resident-<what it hosts>-<attempt>-r<round>`."""
    if order.resident:
        return f"resident-{order.resident}-{order.attempt[-12:]}-r{order.round}"
    return f"{order.stage}-{order.attempt[-12:]}-r{order.round}-node{order.node_rank}"


class PrefectDispatcher:
    """forge_core.run.placement.NodeDispatcher on the Prefect API (module docstring).

    Made in a stage task (prefect_dispatcher), it keeps that task's Prefect run context: a node run it starts
    from another thread (a resident's watcher, forge_core.run.resident) is a subflow of the same task too, so the
    UI nests it there and the flow's cancel hook (cancel_node_runs) finds it."""

    def __init__(self) -> None:
        self._context = contextvars.copy_context()

    def workers(self, pool: str) -> list[WorkerSlot]:
        with get_client(sync_client=True) as client:
            try:
                workers = _api_call(f"reading the workers of pool {pool!r}", client.read_workers_for_work_pool, pool)
                queues = _api_call("reading its work queues", client.read_work_queues, work_pool_name=pool)
            except ObjectNotFound:
                raise ValueError(
                    f"launch.<stage>.pool={pool!r}: no such work pool; create it with `forgeflow pools create {pool}`"
                ) from None
            unfinished = _api_call(
                "reading its unfinished runs",
                client.read_flow_runs,
                work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[pool])),
                flow_run_filter=FlowRunFilter(
                    state=FlowRunFilterState(type=FlowRunFilterStateType(any_=list(UNFINISHED)))
                ),
            )
        by_queue = {queue.name: queue for queue in queues}
        busy: dict[str, str] = {}
        for run in unfinished:
            busy.setdefault(run.work_queue_name or "", f"holds run {run.name} ({run.state_name})")
        slots = []
        for worker in workers:
            queue = by_queue.get(worker.name)
            if queue is None:
                continue  # no queue of its own: a run cannot be pinned to it
            online = worker.status == WorkerStatus.ONLINE
            polled = queue.status == WorkQueueStatus.READY
            notes = [] if online else [f"worker {str(worker.status.value).lower()}"]
            notes += [] if polled else [f"queue {str(queue.status.value).lower()}"]
            notes += [busy[worker.name]] if worker.name in busy else []
            slots.append(WorkerSlot(worker.name, online and polled, worker.name in busy, "; ".join(notes)))
        return slots

    def start_node(self, pool: str, worker: str, order: NodeOrder, env: dict[str, str]) -> str:
        name = stage_deployment_name(pool)
        try:
            run = self._context.copy().run(  # a copy per call: threads cannot share one entered context
                _api_call,
                f"starting a node run of {name}",
                run_deployment,
                name,
                parameters={"order": order.to_params()},
                timeout=0,
                as_subflow=True,
                work_queue_name=worker,
                job_variables={"env": env} if env else None,
                flow_run_name=_node_run_name(order),
                tags=["forgeflow-node"],
            )
        except ObjectNotFound:
            raise ValueError(
                f"launch.placement=pool: pool {pool!r} has no stage deployment {name!r}; create it with "
                f"`forgeflow pools create {pool}` (it makes the pool's stage deployment too)"
            ) from None
        return str(run.id)

    def state(self, run_id: str) -> NodeRunState:
        with get_client(sync_client=True) as client:
            run = _api_call(f"reading node run {run_id}", client.read_flow_run, run_id)
        state = run.state
        if state is None:
            return NodeRunState("unknown", False)
        return NodeRunState(state.name or state.type.value, state.is_final(), state.message or "")

    def cancel(self, run_id: str, reason: str) -> None:
        with get_client(sync_client=True) as client:
            run = _api_call(f"reading node run {run_id}", client.read_flow_run, run_id)
            if run.state is None or run.state.is_final():
                return
            # A run no worker took yet is cancelled outright; a running one goes Cancelling, and its worker
            # ends its process (SIGTERM: the node's launches end with it).
            scheduled = run.state.type is StateType.SCHEDULED
            state = Cancelled(message=reason) if scheduled else Cancelling(message=reason)
            _api_call(f"cancelling node run {run_id}", client.set_flow_run_state, run_id, state, force=True)


def cancel_node_runs(flow_run_id, reason: str) -> list[str]:
    """Cancel the unfinished node runs (stage-node subflow runs) of pipeline flow run `flow_run_id`; returns their
    ids. For the flow's cancel/crash hook: Prefect does not cancel a parent's subflow runs by itself."""
    with get_client(sync_client=True) as client:
        children = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id]),
                state=FlowRunFilterState(type=FlowRunFilterStateType(any_=list(UNFINISHED))),
            )
        )
    dispatcher = PrefectDispatcher()
    for child in children:
        dispatcher.cancel(str(child.id), reason)
    return [str(child.id) for child in children]


def prefect_dispatcher(cfg) -> PrefectDispatcher | None:
    """The dispatcher the stage tasks hand to runner_for: one with launch.placement=pool, None otherwise."""
    return PrefectDispatcher() if cfg.launch.placement == "pool" else None
