"""What the benchmarks that run the real `post-train` flow share: a private Prefect API, a warm-up, and the
flow run's task runs read back from that API.

    from bench._flow_runs import isolate_prefect, warm_up_api, read_task_runs
    isolate_prefect(workdir / "prefect-home")   # before anything imports Prefect
    warm_up_api()                               # server start and client set-up off the clock
    summary = post_train(config, overrides)
    runs = read_task_runs(summary["flow_run_id"])   # by start time, with .name, .start_time, .end_time
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path


def isolate_prefect(home: Path) -> None:
    """A private ephemeral API: set before Prefect reads its settings (i.e. before importing it)."""
    for name in [k for k in os.environ if k.startswith("PREFECT_")]:
        del os.environ[name]
    os.environ["PREFECT_HOME"] = str(home)
    os.environ["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] = "120"
    os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    os.environ["PREFECT_LOGGING_LEVEL"] = "INFO"


def warm_up_api() -> None:
    """Start the local API and run one flow with one task, so that once-per-process costs (server start,
    database, client, task engine, importing the flow) stay out of the measured runs."""
    from prefect import flow, task

    import flows.post_train  # noqa: F401 - imported here, after isolate_prefect, and outside the clock

    @task(name="bench-warmup-task")
    def noop() -> int:
        return 0

    @flow(name="bench-warmup")
    def warmup() -> int:
        return noop()

    warmup()


def read_task_runs(flow_run_id: str) -> list:
    """The flow run's task runs (Prefect's TaskRun objects), oldest start first."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    async def read() -> list:
        async with get_client() as client:
            return await client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
            )

    return sorted(asyncio.run(read()), key=lambda run: run.start_time)
