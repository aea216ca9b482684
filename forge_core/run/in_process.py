"""Running a rollout or evaluate stage in the calling task's process, for `rollout.engine_lifetime: flow`.

    result = run_in_task_process(plan, cfg, log)   # like forge_core.launch.launch: returns a LaunchResult

With long-lived engines a rollout or evaluate stage's worker is a thin client of the flow's engine services:
it plans, fetches the policy, has the engines load it, sends the prompts, scores and commits. A launched
worker process for that costs about 2.5 s a stage (interpreter start, imports, exit; measured by
bench/grpo_iteration.py), as much as all the rest of a warm iteration's fixed overhead. So the task runs the
stage's `run(spec)` on a thread of its own process instead, with the launcher's contract kept:

- outcome: SUCCESS when `run` returns. An exception is classified exactly as a worker's would be
  (forge_core.launch.errors.classify_exception): a user error (ValueError, ConfigError, ...), access denied,
  a corrupted input, a full disk or out of memory is FATAL with its fix; an engine that died
  (EngineServiceError), a policy version mismatch or a transient storage error is RETRYABLE, and anything
  unclassified is FATAL as it would be for a lone rank. Reason, message, fix and traceback tail are kept.
- deadline: past `launch.<stage>.deadline_s` the flow's engine services are stopped, which ends the stage's
  calls into them, and the result is RETRYABLE (the retry starts fresh engines), as a launch past its
  deadline would be.
- log: the stage's own log records (loggers under `forge_core`, from its thread and the engine start-up
  threads it spawns) go to `log`, as a worker's output lines would.

Stage failures injected with FORGE_FAULT (forge_core.faults) address worker processes and do not fire here.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Self

from forge_core.config import RunConfig
from forge_core.launch import LaunchResult, Outcome
from forge_core.launch.classify import exception_result
from forge_core.rollout.lifetime import FLOW, stop_flow_engines
from forge_core.run.plan import StagePlan
from forge_core.run.scaffold import run_spec

IN_PROCESS_STAGES = ("rollout", "evaluate")
# Threads a stage spawns whose records belong to it (EngineService.ensure_engines starts engines on these,
# forge_core.rewards.isolation scores on these with several reward workers).
_STAGE_THREAD_PREFIXES = ("forge-engine-ensure", "forge-reward-")
# After stopping the engines at the deadline, how long the stage's thread gets to notice and end.
_DEADLINE_GRACE_S = 30.0


def runs_in_task_process(stage: str, cfg: RunConfig) -> bool:
    """Whether `stage` runs in the task's process: rollout and evaluate with the flow's long-lived engines."""
    return stage in IN_PROCESS_STAGES and cfg.rollout.engine_lifetime == FLOW


def run_in_task_process(plan: StagePlan, cfg: RunConfig, log: Callable[[str], None]) -> LaunchResult:
    """Run the planned stage (its spec already written) on a thread of this process (module docstring)."""
    if not runs_in_task_process(plan.stage, cfg):
        raise ValueError(
            f"stage {plan.stage!r} with rollout.engine_lifetime={cfg.rollout.engine_lifetime!r}: only "
            f"{'/'.join(IN_PROCESS_STAGES)} with engine_lifetime=flow run in the task's process; launch it instead"
        )
    stage_run = _stage_run(plan.stage)
    deadline_s = getattr(cfg.launch, plan.stage).deadline_s
    outcome: dict[str, BaseException] = {}

    def body() -> None:
        try:
            run_spec(stage_run, plan.spec)
        except BaseException as exc:  # noqa: BLE001 - classified below, like a worker's exception
            outcome["error"] = exc

    started = time.monotonic()
    thread = threading.Thread(target=body, name=f"forge-stage-{plan.stage}", daemon=True)
    with _StageLogRelay(log, thread):
        thread.start()
        thread.join(deadline_s)
        if thread.is_alive():
            stop_flow_engines(cfg)  # its engine calls fail now, and the thread ends
            thread.join(_DEADLINE_GRACE_S)
            return LaunchResult(
                outcome=Outcome.RETRYABLE,
                returncode=None,
                reason=(
                    f"{plan.stage} ran past launch.{plan.stage}.deadline_s={deadline_s:g}s in the task's process; "
                    "the flow's engines were stopped and a retry starts them again"
                ),
                duration_s=time.monotonic() - started,
            )
    duration_s = time.monotonic() - started
    error = outcome.get("error")
    if error is None:
        return LaunchResult(outcome=Outcome.SUCCESS, returncode=0, reason="ran in the task's process", duration_s=duration_s)
    return _failure(plan.stage, error, duration_s)


def _stage_run(stage: str) -> Callable:
    if stage == "rollout":
        from forge_core.run.rollout import run
    else:
        from forge_core.run.evaluate import run
    return run


def _failure(stage: str, error: BaseException, duration_s: float) -> LaunchResult:
    return exception_result(f"{stage} (in the task's process)", error, duration_s)


class _StageLogRelay(logging.Handler):
    """While installed: the `forge_core` log records of one stage thread (and the threads it starts for the
    engines) go to `sink` as formatted lines, and only there; other threads' records go on to the parent
    loggers' handlers exactly as before (same level threshold), as if nothing were installed."""

    def __init__(self, sink: Callable[[str], None], thread: threading.Thread):
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
        self._logger.removeHandler(self)
        self._logger.setLevel(self._saved[0])
        self._logger.propagate = self._saved[1]
