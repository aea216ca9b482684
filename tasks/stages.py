"""The Prefect task that runs any stage of the registry, named and described by its registry record.

    from tasks import run_as_task, stage_task
    sft_uri = run_as_task(cfg, "sft", {"data": data_uri})        # inside a flow: a task run named train_sft
    future = stage_task(cfg, "rollout").submit(cfg, "rollout", inputs, {"iteration": 0, "policy_iteration": 0})

Each task plans the stage, returns at once if its output is committed, else runs it through its runner, verifies
the commit and publishes UI artifacts; only URIs go out. Retryable failures are retried with exponential
backoff and jitter; fatal ones (bad config or data) fail at once with the worker's message.
"""

from __future__ import annotations

import os
import re
import time

from prefect import Task, get_run_logger, task
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.cache_policies import NO_CACHE
from prefect.runtime import task_run as current_task_run
from prefect.tasks import exponential_backoff
from tqdm import tqdm

from forge_core.config import RunConfig
from forge_core.launch import LaunchResult, Outcome
from forge_core.launch.errors import Category, classify_exception
from forge_core.metrics.progress import parse_progress_line
from forge_core.run.plan import StagePlan, plan_stage
from forge_core.run.runner import Cancel, Runner
from forge_core.run.runners import runner_for
from forge_core.run.spec import write_spec
from forge_core.stages import stage_named
from forge_core.storage import ObjectStore, new_attempt_id

STAGE_RETRIES = 2


class StageOutputMissing(RuntimeError):
    """A worker that reported success without committing its output: a bug, not worth a retry."""


def is_retryable(task, task_run, state) -> bool:
    """Prefect retry condition: whether what the task raised is RETRYABLE by
    forge_core.launch.errors.classify_exception (a failed launch as the launcher classified it)."""
    try:
        state.result()
    except Exception as failure:  # noqa: BLE001 - classified, never swallowed: Prefect keeps the failed state
        return classify_exception(failure).category is Category.RETRYABLE
    return False


def _artifact_key(text: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:100]


PROGRESS_BARS_ENV = "FORGE_PROGRESS_BARS"  # "1": also draw a terminal progress bar (the demo sets it)


class _ProgressReporter:
    """Turns the worker's progress lines into a Prefect progress artifact (and an optional terminal bar);
    every other line goes to the task's log."""

    def __init__(self, plan: StagePlan, logger):
        self._logger = logger
        self._artifact_id = create_progress_artifact(
            progress=0.0,
            key=_artifact_key(f"{plan.stage}-progress"),
            description=f"{plan.stage} -> {plan.output_uri}",
        )
        self._last_update = 0.0
        self._bar = None
        self._want_bar = os.environ.get(PROGRESS_BARS_ENV) == "1"

    def __call__(self, line: str) -> None:
        progress = parse_progress_line(line)
        if progress is None:
            self._logger.info(line)
            return
        self._draw_bar(progress)
        now = time.monotonic()
        # Throttle: the API does not need more than a few updates a second.
        if progress.fraction >= 1.0 or now - self._last_update > 0.5:
            update_progress_artifact(self._artifact_id, progress=100.0 * progress.fraction)
            self._last_update = now

    def _draw_bar(self, progress) -> None:
        if not self._want_bar:
            return
        if self._bar is None:
            self._bar = tqdm(total=progress.total, desc=progress.stage, unit="step", leave=False)
        self._bar.update(progress.step - self._bar.n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _publish_stage_artifacts(plan: StagePlan, store: ObjectStore) -> None:
    metrics = store.read_manifest(plan.output_uri).metrics
    rows = [{"metric": k, "value": v} for k, v in sorted(metrics.items()) if isinstance(v, (int, float, str))]
    if rows:
        create_table_artifact(
            table=rows, key=_artifact_key(f"{plan.stage}-metrics"), description=f"{plan.stage} metrics"
        )
    lineage = "\n".join(f"- **{name}**: `{uri}`" for name, uri in sorted(plan.inputs.items())) or "- (none)"
    create_markdown_artifact(
        markdown=f"### {plan.stage}\n\nOutput: `{plan.output_uri}`\n\nInputs:\n{lineage}\n",
        key=_artifact_key(f"{plan.stage}-output"),
        description=f"{plan.stage} output and lineage",
    )


def run_stage(
    cfg: RunConfig,
    stage: str,
    inputs: dict[str, str],
    params: dict | None = None,
    runner: Runner | None = None,
) -> str:
    """Plan, skip-if-committed, take the output key's lease, run, verify; returns the committed output URI.
    `runner` defaults to the stage's own (forge_core.run.runners.runner_for).

    Of two runs at the same stage, the first takes the output key's lease and computes; the other waits, holding
    no pool capacity, until the output is committed (then returns it) or the lease goes stale (then computes).
    An attempt that lost the commit race, or failed while another committed, returns the committed URI. A holder
    that loses its lease cancels its attempt."""
    logger = get_run_logger()
    store = ObjectStore.from_config(cfg.storage)
    plan = plan_stage(cfg, store, stage, inputs=inputs, params=params)
    if store.is_committed(plan.output_uri):
        logger.info("%s: output already committed at %s; skipping", stage, plan.output_uri)
        return plan.output_uri

    plan = plan.for_attempt(new_attempt_id())

    def committed() -> bool:
        return store.is_committed(plan.output_uri)

    def waiting(record: dict) -> None:
        logger.info(
            "%s: %s is being computed by attempt %s on %s; waiting for its commit (or for its lease to go "
            "stale: storage.lease_ttl_s=%g)",
            stage,
            plan.output_uri,
            record.get("holder"),
            record.get("host"),
            store.lease_ttl_s,
        )

    # The owner is this task run: a retry may take over the lease of its own earlier attempt at once.
    owner = str(current_task_run.id) if current_task_run.id else None
    lease = store.acquire_lease(
        plan.output_uri, holder=plan.spec.attempt, is_done=committed, on_wait=waiting, owner=owner
    )
    if lease is None or committed():
        if lease is not None:
            lease.release()
        logger.info("%s: output already committed at %s by another run; skipping", stage, plan.output_uri)
        return plan.output_uri
    runner = runner or runner_for(cfg, stage)
    cancel = Cancel()
    with lease.kept_alive(on_lost=lambda lost: cancel.request(str(lost))):
        result = _run_planned(plan, cfg, store, runner, logger, cancel)
    logger.info("%s: %s in %.1fs", stage, result.outcome.name, result.duration_s)

    if not committed():
        lease.check()  # LeaseLost (retryable): another run took the stage over; a retry finds its commit
        result.raise_for_outcome()
        raise StageOutputMissing(
            f"{stage}: the worker exited cleanly but {plan.output_uri} has no committed manifest"
        )
    if result.outcome is not Outcome.SUCCESS:
        logger.info(
            "%s: this attempt ended %s (%s), but %s is committed by another attempt of the stage; using it",
            stage,
            result.outcome.name,
            result.reason,
            plan.output_uri,
        )
    # Consumers verify every file's hash as they read it; here a readable manifest is the check.
    _publish_stage_artifacts(plan, store)
    return plan.output_uri


def _run_planned(
    plan: StagePlan, cfg: RunConfig, store: ObjectStore, runner: Runner, logger, cancel: Cancel
) -> LaunchResult:
    """Write the attempt's spec and run it with a progress reporter."""
    write_spec(store, plan.spec)
    attempt = plan.spec.attempt
    logger.info("%s: running in %s -> %s (attempt %s)", plan.stage, runner.where, plan.output_uri, attempt)
    reporter = _ProgressReporter(plan, logger)
    try:
        return runner.run(plan, reporter, cancel)
    finally:
        reporter.close()


_stage_task = task(
    retries=STAGE_RETRIES,
    retry_delay_seconds=exponential_backoff(backoff_factor=5),
    retry_jitter_factor=0.5,
    retry_condition_fn=is_retryable,
    cache_policy=NO_CACHE,  # skipping is explicit: the committed output is the cache
    log_prints=True,
)


@_stage_task(name="run_stage")
def run_stage_task(cfg: RunConfig, stage: str, inputs: dict[str, str] | None = None, params: dict | None = None) -> str:
    """Any stage of the registry (forge_core.stages) as a task; `stage_task` names it after its stage."""
    return run_stage(cfg, stage, dict(inputs or {}), params)


def stage_task(cfg: RunConfig, stage: str) -> Task:
    """The task that runs `stage`, named and described by its registry record, with its retry budget
    `launch.<stage>.retries`; ValueError when `stage` is not registered."""
    record = stage_named(stage)
    return run_stage_task.with_options(
        name=record.task, description=record.description, retries=cfg.launch.for_stage(stage).retries
    )


def run_as_task(cfg: RunConfig, stage: str, inputs: dict[str, str], params: dict | None = None) -> str:
    """Run `stage` as its task on `inputs` ({input name: committed URI}) and `params`; returns its committed
    output URI. Inside a flow it is a task run of that flow."""
    return stage_task(cfg, stage)(cfg, stage, inputs, params)
