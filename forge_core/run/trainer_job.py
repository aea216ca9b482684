"""The flow process's side of the long-lived GRPO trainer job (`grpo.trainer_lifetime: flow`).

    result = run_in_flow_trainer(plan, cfg, log)   # a GRPO task: the planned, spec-written stage -> LaunchResult
    stop_flow_trainers(cfg)                         # the flow: at its end and on failure/cancellation

The first GRPO stage of a flow run starts one torchrun job (`python -m forge_core.run grpo-job`, worker:
forge_core.run.grpo_job) through forge_core.launch with `launch.grpo`'s nproc/env settings: its own launch
id and launch-registry record owned by this process, so `terminate_all_live()` (the flow's cancel/crash hook)
and `reap_orphaned_launches()` (the next flow, if this process died hard) end it like any stage launch. Each
GRPO stage then writes its order (the spec URI) into the job's private order folder and waits until its
output is committed, watching the job:

- committed: SUCCESS (the result names the job's launch id);
- the job died: the launcher's own classification of the job's exit (a killed rank is RETRYABLE: the task's
  retry starts a new job, which resumes the iteration from its newest in-stage checkpoint; a user error on
  a rank is FATAL with that rank's message), its log tail included; a job that exits cleanly without
  committing is RETRYABLE;
- `launch.grpo.deadline_s` passed (counted per stage): the job is ended and the result is RETRYABLE, naming
  the rank that hung (from the ranks' heartbeats, forge_core.launch.heartbeat);
- the wait itself failed (a store call still failing after `storage.retry_horizon_s`): the job is ended and
  the error classified as a worker's would be (forge_core.launch.errors.classify_exception).

The job's output reaches the waiting stage's log (and progress reporter); between stages this module's logger.
State folder (mode 0700): `<engine_state_dir(cfg)>-trainer` (forge_core.rollout.lifetime), one order folder
per job inside it; like the engines' folder it belongs to one flow run (`launch.run_id`), so concurrent runs of
one config never share a job.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from forge_core.config import RunConfig
from forge_core.launch import LaunchHandle, LaunchResult, LaunchSpec, Outcome, start
from forge_core.launch.classify import exception_result
from forge_core.run.plan import StagePlan, launch_spec_for
from forge_core.storage import ObjectStore

log = logging.getLogger(__name__)

FLOW = "flow"
JOB_MODULE_ARG = "grpo-job"
POLL_S = 0.2
STOP_TIMEOUT_S = 60.0
# The job spans the whole flow run; each stage's own deadline (launch.grpo.deadline_s) is enforced while it
# waits. This only bounds a job nobody stops (a week).
JOB_DEADLINE_S = 7 * 24 * 3600.0


def order_path(orders: Path, seq: int) -> Path:
    """Order `seq` of a job: `<orders>/<seq:06d>.json` (forge_core.run.grpo_job reads them in order)."""
    return orders / f"{seq:06d}.json"


def trainer_state_dir(cfg: RunConfig) -> Path:
    """`<engine state dir>-trainer`: next to the run's engine services, keyed the same way (per flow run:
    forge_core.rollout.lifetime.engine_state_dir)."""
    from forge_core.rollout.lifetime import engine_state_dir

    engine_dir = engine_state_dir(cfg)
    return engine_dir.with_name(engine_dir.name + "-trainer")


class _LogRelay:
    """The job's output goes to the stage waiting on it, else to this module's logger."""

    def __init__(self) -> None:
        self.target: Callable[[str], None] | None = None

    def __call__(self, line: str) -> None:
        (self.target or log.info)(line)


@dataclasses.dataclass
class TrainerJob:
    """One running trainer job: its launch, its order folder and the next order's number."""

    handle: LaunchHandle
    orders: Path
    identity: LaunchSpec  # the launch settings it was started with (its order folder aside)
    relay: _LogRelay
    next_seq: int = 0

    def alive(self) -> bool:
        return not self.handle.done()

    def submit(self, order: dict) -> None:
        """Write the next order atomically: a rank never reads half a file."""
        path = order_path(self.orders, self.next_seq)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(order))
        os.replace(tmp, path)
        self.next_seq += 1

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


_jobs: dict[Path, TrainerJob] = {}
_jobs_lock = threading.Lock()


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
    relay = _LogRelay()
    spec = dataclasses.replace(identity, args=[*identity.args, "--orders", str(orders)])
    handle = start(spec, log=relay)
    log.info("trainer job started: launch %s, pid %d, orders %s", handle.launch_id, handle.pid, orders)
    return TrainerJob(handle=handle, orders=orders, identity=identity, relay=relay)


def ensure_trainer_job(plan: StagePlan, cfg: RunConfig) -> TrainerJob:
    """The run's live trainer job, started now if there is none (or the one there has other launch settings)."""
    state = _private_state_dir(cfg)
    identity = _job_identity(plan, cfg)
    with _jobs_lock:
        job = _jobs.get(state)
        if job is not None and job.alive() and job.identity == identity:
            return job
        if job is not None:
            job.stop()
        job = _jobs[state] = _start_job(state, identity)
        return job


def _forget(job: TrainerJob) -> None:
    with _jobs_lock:
        for state, known in list(_jobs.items()):
            if known is job:
                del _jobs[state]
    shutil.rmtree(job.orders, ignore_errors=True)


def _job_ended(job: TrainerJob, output_uri: str, elapsed_s: float) -> LaunchResult:
    """The result of a stage whose job ended before its output was committed."""
    result = job.handle.wait()
    _forget(job)
    where = f"trainer job {result.launch_id} ended while training {output_uri}"
    if result.outcome is Outcome.SUCCESS:
        return dataclasses.replace(
            result,
            outcome=Outcome.RETRYABLE,
            reason=f"{where}: it exited with code 0 without committing it",
            duration_s=elapsed_s,
        )
    return dataclasses.replace(result, reason=f"{where}: {result.reason}", duration_s=elapsed_s)


def _past_deadline(job: TrainerJob, output_uri: str, deadline_s: float, elapsed_s: float) -> LaunchResult:
    job.handle.cancel(f"launch.grpo.deadline_s={deadline_s:g} exceeded while training {output_uri}")
    result = job.handle.wait()
    _forget(job)
    stall = f"; {result.stall}" if result.stall else ""  # which rank hung, from the ranks' heartbeats
    return dataclasses.replace(
        result,
        outcome=Outcome.RETRYABLE,
        reason=f"deadline of {deadline_s:g} s exceeded while trainer job {result.launch_id} trained {output_uri}; "
        f"the job was ended{stall}",
        duration_s=elapsed_s,
    )


def _waiting_failed(job: TrainerJob, output_uri: str, error: Exception, elapsed_s: float) -> LaunchResult:
    """The wait itself failed (a store call still failing after storage.retry_horizon_s): the job is ended, so
    that a retry's new order is not served after this one by the same job, and the error is classified like a
    worker's (forge_core.launch.errors.classify_exception)."""
    job.handle.cancel(f"waiting for {output_uri} failed: {type(error).__name__}")
    job.handle.wait()
    _forget(job)
    where = f"grpo (waiting for trainer job {job.handle.launch_id} to commit {output_uri})"
    return exception_result(where, error, elapsed_s, launch_id=job.handle.launch_id)


def run_in_flow_trainer(plan: StagePlan, cfg: RunConfig, log_sink: Callable[[str], None]) -> LaunchResult:
    """Hand a planned GRPO stage (its spec already written) to the run's trainer job and wait for its commit;
    returns a LaunchResult as `forge_core.launch.launch` would (module docstring)."""
    started = time.monotonic()
    store = ObjectStore.from_config(cfg.storage)
    deadline_s = cfg.launch.grpo.deadline_s
    job = ensure_trainer_job(plan, cfg)
    job.relay.target = log_sink
    try:
        job.submit({"spec_uri": plan.spec_uri})
        return _wait_for_commit(job, store, plan.output_uri, deadline_s, started)
    except Exception as exc:  # noqa: BLE001 - becomes a classified result, as a worker's exception would
        return _waiting_failed(job, plan.output_uri, exc, time.monotonic() - started)
    finally:
        job.relay.target = None


def _wait_for_commit(
    job: TrainerJob, store: ObjectStore, output_uri: str, deadline_s: float, started: float
) -> LaunchResult:
    while True:
        elapsed = time.monotonic() - started
        if store.is_committed(output_uri):
            return LaunchResult(
                outcome=Outcome.SUCCESS,
                returncode=None,
                reason=f"committed by trainer job {job.handle.launch_id}",
                duration_s=elapsed,
                launch_id=job.handle.launch_id,
            )
        if not job.alive():
            if store.is_committed(output_uri):  # committed just before it ended
                continue
            return _job_ended(job, output_uri, elapsed)
        if elapsed > deadline_s:
            return _past_deadline(job, output_uri, deadline_s, elapsed)
        time.sleep(POLL_S)


def stop_flow_trainers(cfg: RunConfig, timeout_s: float = STOP_TIMEOUT_S) -> list[int]:
    """Stop the run's trainer job if this process started one (nothing otherwise) and remove the run's trainer
    state folder; returns the job's pids. The job gets `timeout_s` to finish its order and exit on its stop
    order, then the launcher ends it (SIGTERM, `launch.grpo.kill_grace_s`, SIGKILL); the cancel/crash path
    passes 0.

    Safe to call whatever `grpo.trainer_lifetime` says: a flow calls it in its `finally`.
    """
    try:
        state = trainer_state_dir(cfg)
    except ValueError:  # e.g. a shared temp base owned by another user: then no job of ours lives there
        return []
    with _jobs_lock:
        job = _jobs.pop(state, None)
    pids = job.stop(timeout_s) if job is not None else []
    with contextlib.suppress(OSError):
        state.rmdir()  # empty once its order folders are gone; this run's only (forge_core.rollout.lifetime)
    return pids
