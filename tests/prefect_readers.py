"""Reading a flow run's task runs back from the Prefect API, as tests assert on them (retries, states)."""

from __future__ import annotations

import time
from collections.abc import Mapping

from flows.task_runs import read_task_runs, run_async  # noqa: F401 - run_async: read from here by the fault kit
from flows.task_runs import settled_task_runs as task_runs_settled


class TaskRuns(Mapping):
    """Task runs of a flow run by task name (`train_sft`, ...; one run per task in these flows), read from the
    API. Prefect 3 records task runs from the events its client sends in the background, so the API may lag
    the flow's return: a name not there yet, or a run not yet in a final state, is read again (bounded)
    instead of being taken as missing or unfinished."""

    WAIT_S = 180.0

    def __init__(self, flow_run_id) -> None:
        self.flow_run_id = flow_run_id
        from prefect.events.worker import EventsWorker

        EventsWorker.drain_all(timeout=30)  # what the flow sent is at the API before the first read
        self._runs = self._read()

    def _read(self) -> dict[str, object]:
        return {run.name.rsplit("-", 1)[0]: run for run in _read_task_runs(self.flow_run_id)}

    def __getitem__(self, name: str):
        deadline = time.monotonic() + self.WAIT_S
        while not (name in self._runs and self._runs[name].state.is_final()):
            if time.monotonic() > deadline:
                state = self._runs[name].state.type if name in self._runs else "absent"
                raise KeyError(f"task run {name!r} of flow run {self.flow_run_id}: {state} after {self.WAIT_S:g} s")
            time.sleep(0.5)
            self._runs = self._read()
        return self._runs[name]

    def __iter__(self):
        return iter(self._runs)

    def __len__(self) -> int:
        return len(self._runs)


def task_runs(flow_run_id) -> TaskRuns:
    """Task runs of a flow run by task name: `TaskRuns`."""
    return TaskRuns(flow_run_id)


def settled_task_runs(flow_run_id, count: int) -> list:
    """All task runs of a flow run (several may share a name), once `count` of them are there, each in a final
    state (bounded: TaskRuns.WAIT_S)."""
    return task_runs_settled(flow_run_id, count, TaskRuns.WAIT_S)


def _read_task_runs(flow_run_id) -> list:
    return read_task_runs(flow_run_id)
