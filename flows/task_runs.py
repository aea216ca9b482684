"""Reading a flow run's task runs back from the Prefect API once they have settled.

Prefect 3 records task runs from events its client sends in the background, so the API may lag a flow's return:
`settled_task_runs` drains what this process sent and reads again (bounded) until every run is there and final.
"""

from __future__ import annotations

import asyncio
import time

from forge_core.timings import DRILL_POLL_S, DRILL_TASK_RUNS_S


def run_async(coro_fn):
    """`coro_fn(client)` with a Prefect client, run to its end."""

    async def wrapped():
        from prefect.client.orchestration import get_client

        async with get_client() as client:
            return await coro_fn(client)

    return asyncio.run(wrapped())


def read_task_runs(flow_run_id) -> list:
    """The task runs of a flow run as the API holds them now."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    return run_async(
        lambda c: c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    )


def settled_task_runs(flow_run_id, count: int, wait_s: float = DRILL_TASK_RUNS_S) -> list:
    """All task runs of a flow run (several may share a name), once `count` of them are there, each final.

    Raises:
        TimeoutError: they did not settle within `wait_s`.
    """
    from prefect.events.worker import EventsWorker

    EventsWorker.drain_all(timeout=30)
    deadline = time.monotonic() + wait_s
    while True:
        runs = read_task_runs(flow_run_id)
        if len(runs) >= count and all(run.state.is_final() for run in runs):
            return runs
        if time.monotonic() > deadline:
            raise TimeoutError(f"flow run {flow_run_id}: {count} final task runs expected, found {runs}")
        time.sleep(DRILL_POLL_S)
