"""The runner interface: how a planned stage attempt runs, with one deadline path and one classification path.

    runner = runner_for(cfg, plan.stage)             # forge_core.run.runners: chosen in one place
    result = runner.run(plan, log, cancel)           # -> LaunchResult, as forge_core.launch.launch returns

A `Runner` is bound to one stage and the run's config. `run` takes a plan whose spec is already written; what
runs the stage needs only the spec's URI and the store, so it may run on another node. Each implementation
starts an `Attempt`, which `run` supervises the same way:
- deadline: past `launch.<stage>.deadline_s` the attempt is stopped, RETRYABLE, naming the rank that made no
  progress when heartbeats tell (a worker launch's own deadline is only a backstop);
- cancellation: `cancel.request(reason)` from another thread stops the attempt, CANCELLED;
- classification: an exception raised here or by a stage body in this process is classified by
  `forge_core.launch.classify.exception_result`, exactly as a lone rank's error would be.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Protocol

from forge_core.config import RunConfig
from forge_core.config.schema import ResourceConfig
from forge_core.launch import LaunchResult, Outcome
from forge_core.launch.classify import exception_result
from forge_core.run.plan import StagePlan
from forge_core.run.resources import FlowResources
from forge_core.stages import FlowRunner, stage_named
from forge_core.timings import RUNNER_POLL_S

LogSink = Callable[[str], None]


class Cancel:
    """A request, from another thread, to end a running attempt (a lost lease, the flow being cancelled)."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.reason = ""

    def request(self, reason: str) -> None:
        self.reason = reason
        self._event.set()

    def is_requested(self) -> bool:
        return self._event.is_set()


class Attempt(Protocol):
    """One running attempt of a stage, whatever runs it."""

    launch_id: str  # the launch that runs it ("" when none)

    def wait(self, timeout: float) -> LaunchResult | None:
        """Its result once it ended (waiting at most `timeout` seconds); None while it still runs."""

    def stop(self, reason: str) -> LaunchResult | None:
        """End it now and return its result once it ended (None if it would not end within its own bound)."""


class Runner(ABC):
    """Runs planned attempts of one stage; subclasses say how an attempt starts."""

    where = "its own launch"  # what runs the stage, for messages

    def __init__(self, cfg: RunConfig, stage: str) -> None:
        self.cfg = cfg
        self.stage = stage

    @property
    def resources(self) -> ResourceConfig:
        return self.cfg.launch.for_stage(self.stage)

    @abstractmethod
    def start(self, plan: StagePlan, log: LogSink) -> Attempt:
        """Start the attempt of `plan` (its spec already written)."""

    def run(self, plan: StagePlan, log: LogSink, cancel: Cancel | None = None) -> LaunchResult:
        """Run the attempt to its end; never raises for a failed stage (the result says how it ended)."""
        assert plan.stage == self.stage, f"a {self.stage} runner was given a {plan.stage} plan"
        started = time.monotonic()
        attempt: Attempt | None = None
        try:
            attempt = self.start(plan, log)
            return self._supervise(attempt, started, cancel or Cancel())
        except Exception as exc:  # noqa: BLE001 - classified below, as a worker's exception would be
            if attempt is not None:
                attempt.stop(f"{self.stage}: the runner failed ({type(exc).__name__}); ending the attempt")
            where = f"{self.stage} ({self.where})"
            launch_id = attempt.launch_id if attempt is not None else ""
            return exception_result(where, exc, time.monotonic() - started, launch_id=launch_id)

    def _supervise(self, attempt: Attempt, started: float, cancel: Cancel) -> LaunchResult:
        deadline_s = self.resources.deadline_s
        while True:
            elapsed = time.monotonic() - started
            if elapsed >= deadline_s:
                reason = f"deadline of {deadline_s:g} s exceeded (launch.{self.stage}.deadline_s)"
                return self._past_deadline(attempt.stop(reason), deadline_s, started)
            if cancel.is_requested():
                stopped = attempt.stop(cancel.reason)
                return self._cancelled(stopped, cancel.reason, started)
            result = attempt.wait(min(RUNNER_POLL_S, deadline_s - elapsed))
            if result is not None:
                return dataclasses.replace(result, duration_s=time.monotonic() - started)

    def _past_deadline(self, stopped: LaunchResult | None, deadline_s: float, started: float) -> LaunchResult:
        stall = stopped.stall if stopped is not None else ""
        how = "it was ended" if stopped is not None else "it did not end when stopped"
        reason = f"deadline of {deadline_s:g} s exceeded while {self.stage} ran in {self.where}; {how}"
        return self._ended(stopped, Outcome.RETRYABLE, f"{reason}; {stall}" if stall else reason, started)

    def _cancelled(self, stopped: LaunchResult | None, why: str, started: float) -> LaunchResult:
        return self._ended(stopped, Outcome.CANCELLED, f"cancelled: {why}", started)

    @staticmethod
    def _ended(stopped: LaunchResult | None, outcome: Outcome, reason: str, started: float) -> LaunchResult:
        """A stopped attempt's result with the runner's outcome and reason (its tail and rank errors kept)."""
        base = stopped or LaunchResult(outcome=outcome, returncode=None, reason=reason)
        return dataclasses.replace(base, outcome=outcome, reason=reason, duration_s=time.monotonic() - started)


class FlowProcessRunner(Runner):
    """A runner that serves a stage with one of the flow run's long-lived processes (its FlowResources)."""

    serves: FlowRunner  # the registry's `Stage.flow_runner` this runner is

    def __init__(self, cfg: RunConfig, stage: str, resources: FlowResources) -> None:
        record = stage_named(stage)
        if record.flow_runner != self.serves or not resources.serves(record):
            lifetime = resources.lifetime(record)
            raise ValueError(
                f"stage {stage!r} with {record.lifetime_key or 'no lifetime setting'}={lifetime!r}: {self.where} "
                f"serves the stages whose record says flow_runner={self.serves!r} with that setting 'flow' (the "
                "engine clients always); launch it instead"
            )
        super().__init__(cfg, stage)
        self.flow_resources = resources
