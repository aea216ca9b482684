"""Running a stage on a thread of the calling task's process: the runner of the engine-client stages (rollout,
evaluate; `flow_runner="task_process"`), thin clients of the run's engine actors for which a worker process's
start-up would dominate the cost.

    result = TaskProcessRunner(cfg, "rollout", resources).run(plan, log)   # usually: runner_for(cfg, stage)

It keeps the runner contract (forge_core.run.runner):
- outcome: SUCCESS when the stage returns; an exception is classified exactly as a worker's would be.
- stop (deadline, cancel): the run's engine actors are stopped, which ends the stage's calls into them; the
  thread gets STAGE_THREAD_STOP_GRACE_S to end.
- log: the stage's `forge_core` log records (from its thread and the threads it starts) go to `log`.

FORGE_FAULT stage failures address worker processes and engine actors, not this thread.
"""

from __future__ import annotations

import logging
import threading
from typing import Self

from forge_core.config import RunConfig
from forge_core.launch import LaunchResult, Outcome
from forge_core.launch.classify import exception_result
from forge_core.run.plan import StagePlan
from forge_core.run.resources import FlowResources
from forge_core.run.runner import Attempt, FlowProcessRunner, LogSink
from forge_core.run.scaffold import run_spec
from forge_core.timings import STAGE_THREAD_STOP_GRACE_S

# Threads a stage spawns whose records belong to it (engine start-up, reward workers).
_STAGE_THREAD_PREFIXES = ("forge-engine-ensure", "forge-reward-")


class TaskProcessRunner(FlowProcessRunner):
    """A stage on a thread of the task's process, talking to the flow's engines."""

    where = "the task's process"
    serves = "task_process"

    def start(self, plan: StagePlan, log: LogSink) -> Attempt:
        return _ThreadAttempt(plan, self.cfg, log, self.flow_resources)


class _ThreadAttempt:
    launch_id = ""

    def __init__(self, plan: StagePlan, cfg: RunConfig, log: LogSink, resources: FlowResources) -> None:
        self._stage = plan.stage
        self._resources = resources
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._body, args=(plan, cfg), name=f"forge-stage-{plan.stage}", daemon=True
        )
        self._relay = _StageLogRelay(log, self._thread).__enter__()
        self._thread.start()

    def _body(self, plan: StagePlan, cfg: RunConfig) -> None:
        try:
            run_spec(plan.spec, cfg)  # the task's RunConfig: validated once, by the flow
        except BaseException as exc:  # noqa: BLE001 - classified in _result, like a worker's exception
            self._error = exc

    def wait(self, timeout: float) -> LaunchResult | None:
        self._thread.join(timeout)
        return None if self._thread.is_alive() else self._result()

    def stop(self, reason: str) -> LaunchResult | None:
        self._resources.stop_engines()  # its engine calls fail now, and the thread ends
        self._thread.join(STAGE_THREAD_STOP_GRACE_S)
        if self._thread.is_alive():
            self._relay.__exit__(None, None, None)
            return None
        return self._result()

    def _result(self) -> LaunchResult:
        self._relay.__exit__(None, None, None)
        if self._error is None:
            return LaunchResult(outcome=Outcome.SUCCESS, returncode=0, reason="ran in the task's process")
        return _failure(self._stage, self._error, 0.0)


def _failure(stage: str, error: BaseException, duration_s: float) -> LaunchResult:
    """A stage's exception classified as a worker's would be (the runner sets the duration)."""
    return exception_result(f"{stage} (in the task's process)", error, duration_s)


class _StageLogRelay(logging.Handler):
    """While installed: the `forge_core` records of one stage thread (and the threads it starts) go to `sink`
    as formatted lines, and only there; other threads' records reach the parent handlers as if uninstalled."""

    def __init__(self, sink: LogSink, thread: threading.Thread):
        super().__init__(logging.INFO)
        self._sink = sink
        self._thread = thread
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        self._logger = logging.getLogger("forge_core")
        self._saved = (self._logger.level, self._logger.propagate)
        self._others_level = self._logger.getEffectiveLevel()

    def _from_stage(self, record: logging.LogRecord) -> bool:
        # Thread ids are reused once a thread has ended: only a live stage thread's id counts.
        own = record.thread == self._thread.ident and self._thread.is_alive()
        return own or record.threadName.startswith(_STAGE_THREAD_PREFIXES)

    def emit(self, record: logging.LogRecord) -> None:
        if not self._from_stage(record):
            if record.levelno >= self._others_level and self._logger.parent is not None:
                self._logger.parent.handle(record)  # what propagation would have done
            return
        try:
            self._sink(self.format(record))
        except Exception:  # noqa: BLE001 - a failing sink must not fail the stage
            self.handleError(record)

    def __enter__(self) -> Self:
        # INFO on for the stage's records; they stop here instead of reaching the root handlers too.
        self._logger.setLevel(min(logging.INFO, self._others_level))
        self._logger.propagate = False
        self._logger.addHandler(self)
        return self

    def __exit__(self, *exc_info) -> None:
        if self not in self._logger.handlers:
            return  # already removed
        self._logger.removeHandler(self)
        self._logger.setLevel(self._saved[0])
        self._logger.propagate = self._saved[1]
