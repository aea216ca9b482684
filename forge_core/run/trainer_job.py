"""The long-lived GRPO trainer job (`grpo.trainer_lifetime: flow`) seen from the flow process: its runner.

    result = TrainerJobRunner(cfg, "grpo", resources).run(plan, log)   # usually: runner_for(cfg, stage)

The first GRPO stage of a flow run starts one torchrun job (`python -m forge_core.run grpo-job`, worker:
forge_core.run.grpo_job) through forge_core.launch with `launch.grpo`'s nproc/env settings: its own launch id
and launch-registry record owned by this process, so `terminate_all_live()` (the flow's cancel/crash hook) and
`reap_orphaned_launches()` (the next flow, if this process died hard) end it like any stage launch. The job is
one of the run's long-lived processes, held and ended by its FlowResources (forge_core.run.resources). Each GRPO
stage then writes its order (the spec URI) into the job's private order folder and waits until its output is
committed, watching the job; the runner interface (forge_core.run.runner) supervises that wait like any
attempt:

- committed: SUCCESS (the result names the job's launch id);
- the job died: the launcher's own classification of the job's exit (a killed rank is RETRYABLE: the task's
  retry starts a new job, which resumes the iteration from its newest in-stage checkpoint; a user error on
  a rank is FATAL with that rank's message), its log tail included; a job that exits cleanly without
  committing is RETRYABLE;
- stopped (`launch.grpo.deadline_s` passed, counted per stage, or a cancel): the job is ended, so that a retry's
  new order is not served after this one by the same job; past the deadline the result names the rank that
  hung (from the ranks' heartbeats, forge_core.launch.heartbeat);
- the wait itself failed (a store call still failing after `storage.retry_horizon_s`): the job is ended and
  the error classified as a worker's would be.

The job's output reaches the waiting stage's log (and progress reporter); between stages this module's logger.
State folder (mode 0700): `<engine_state_dir(cfg)>-trainer` (forge_core.run.resources.trainer_state_dir), one
order folder per job inside it; like the engines' folder it belongs to one flow run (`launch.run_id`), so
concurrent runs of one config never share a job.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import time
import uuid
from pathlib import Path

from forge_core.config import RunConfig
from forge_core.launch import LaunchHandle, LaunchResult, LaunchSpec, Outcome, start
from forge_core.run.plan import StagePlan, launch_spec_for
from forge_core.run.resources import STOP_TIMEOUT_S, FlowResources, trainer_state_dir
from forge_core.run.runner import Attempt, FlowProcessRunner, LogRelay, LogSink
from forge_core.storage import ObjectStore

log = logging.getLogger(__name__)

JOB_MODULE_ARG = "grpo-job"
POLL_S = 0.2
# How often a waiting stage looks for its order's done marker (a local file: cheap to look at often; the store,
# which may be S3, is asked every POLL_S and once the marker is there).
DONE_POLL_S = 0.02
# The job spans the whole flow run; each stage's own deadline (launch.grpo.deadline_s) is enforced while it
# waits. This only bounds a job nobody stops (a week).
JOB_DEADLINE_S = 7 * 24 * 3600.0


def order_path(orders: Path, seq: int) -> Path:
    """Order `seq` of a job: `<orders>/<seq:06d>.json` (forge_core.run.grpo_job reads them in order)."""
    return orders / f"{seq:06d}.json"


def done_path(orders: Path, seq: int) -> Path:
    """The marker rank 0 writes once order `seq` has run: the waiting stage sees it without polling the store."""
    return orders / f"{seq:06d}.done"


@dataclasses.dataclass
class TrainerJob:
    """One running trainer job: its launch, its order folder and the next order's number."""

    handle: LaunchHandle
    orders: Path
    identity: LaunchSpec  # the launch settings it was started with (its order folder aside)
    relay: LogRelay  # the job's output: to the stage waiting on it, else to this module's logger
    next_seq: int = 0

    def alive(self) -> bool:
        return not self.handle.done()

    def submit(self, order: dict) -> int:
        """Write the next order atomically (a rank never reads half a file); returns its number."""
        seq = self.next_seq
        path = order_path(self.orders, seq)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(order))
        os.replace(tmp, path)
        self.next_seq += 1
        return seq

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> list[int]:
        """Ask the job to exit after its current order, end it if it does not; returns the pids it had."""
        pids = self.handle.pids()
        if self.alive():
            self.submit({"stop": True})
            try:
                self.handle.wait(timeout_s)
            except TimeoutError:
                self.handle.cancel("trainer job did not stop on its stop order")
                self.handle.wait()
        shutil.rmtree(self.orders, ignore_errors=True)
        return pids


def _job_identity(plan: StagePlan, cfg: RunConfig) -> LaunchSpec:
    stage_launch = launch_spec_for(plan, cfg)
    return dataclasses.replace(
        stage_launch, args=[JOB_MODULE_ARG, "--device", cfg.training.device], deadline_s=JOB_DEADLINE_S
    )


def _private_state_dir(cfg: RunConfig) -> Path:
    from forge_core.rollout.service import check_private

    state = trainer_state_dir(cfg)
    state.mkdir(mode=0o700, parents=True, exist_ok=True)
    check_private(state, "trainer job state folder (set rollout.engine_state_dir to choose another)")
    return state


def _start_job(state: Path, identity: LaunchSpec) -> TrainerJob:
    orders = state / f"orders-{uuid.uuid4().hex[:12]}"
    orders.mkdir(mode=0o700)
    relay = LogRelay(log.info)
    spec = dataclasses.replace(identity, args=[*identity.args, "--orders", str(orders)])
    handle = start(spec, log=relay)
    log.info("trainer job started: launch %s, pid %d, orders %s", handle.launch_id, handle.pid, orders)
    return TrainerJob(handle=handle, orders=orders, identity=identity, relay=relay)


def ensure_trainer_job(resources: FlowResources, plan: StagePlan) -> TrainerJob:
    """The run's live trainer job, started now if there is none (or the one there has other launch settings)."""
    cfg = resources.cfg
    state = _private_state_dir(cfg)
    identity = _job_identity(plan, cfg)
    with resources.lock:
        job = resources.trainer_job
        if job is not None and job.alive() and job.identity == identity:
            return job
        if job is not None:
            job.stop()
        job = resources.trainer_job = _start_job(state, identity)
        return job


def _forget(resources: FlowResources, job: TrainerJob) -> None:
    with resources.lock:
        if resources.trainer_job is job:
            resources.trainer_job = None
    shutil.rmtree(job.orders, ignore_errors=True)


class TrainerJobRunner(FlowProcessRunner):
    """A GRPO stage as an order to the run's long-lived trainer job (module docstring)."""

    where = "the flow's trainer job"
    serves = "trainer_job"

    def start(self, plan: StagePlan, log: LogSink) -> Attempt:
        job = ensure_trainer_job(self.flow_resources, plan)
        job.relay.target = log
        seq = job.submit({"spec_uri": plan.spec_uri})
        store = ObjectStore.from_config(self.cfg.storage)
        return _OrderAttempt(job, seq, store, plan.output_uri, self.flow_resources)


class _OrderAttempt:
    """One stage's order to the job: done when its output is committed or the job has ended."""

    def __init__(
        self, job: TrainerJob, seq: int, store: ObjectStore, output_uri: str, resources: FlowResources
    ) -> None:
        self.job = job
        self.launch_id = job.handle.launch_id
        self._done = done_path(job.orders, seq)
        self._store = store
        self._output_uri = output_uri
        self._resources = resources
        self._next_store_check = 0.0

    def _committed(self) -> bool:
        """Asks the store once the job marked the order done, else at most every POLL_S."""
        now = time.monotonic()
        if not self._done.exists() and now < self._next_store_check:
            return False
        self._next_store_check = now + POLL_S
        return self._store.is_committed(self._output_uri)

    def wait(self, timeout: float) -> LaunchResult | None:
        until = time.monotonic() + timeout
        while True:
            if self._committed():
                return self._success()
            if not self.job.alive():
                if self._store.is_committed(self._output_uri):  # committed just before it ended
                    return self._success()
                return self._job_ended()
            if time.monotonic() >= until:
                return None
            time.sleep(min(DONE_POLL_S, max(0.0, until - time.monotonic())))

    def _success(self) -> LaunchResult:
        self.job.relay.target = None
        return LaunchResult(
            outcome=Outcome.SUCCESS,
            returncode=None,
            reason=f"committed by trainer job {self.launch_id}",
            launch_id=self.launch_id,
        )

    def stop(self, reason: str) -> LaunchResult:
        """End the job (a retry's new order must not be served after this one by the same job)."""
        self.job.handle.cancel(reason)
        result = self.job.handle.wait()
        self.job.relay.target = None
        _forget(self._resources, self.job)
        return result

    def _job_ended(self) -> LaunchResult:
        """The result of a stage whose job ended before its output was committed."""
        result = self.job.handle.wait()
        self.job.relay.target = None
        _forget(self._resources, self.job)
        where = f"trainer job {result.launch_id} ended while training {self._output_uri}"
        if result.outcome is Outcome.SUCCESS:
            return dataclasses.replace(
                result, outcome=Outcome.RETRYABLE, reason=f"{where}: it exited with code 0 without committing it"
            )
        return dataclasses.replace(result, reason=f"{where}: {result.reason}")
