"""The post-training flow: prepare -> SFT -> evaluate -> N x (rollout -> GRPO -> evaluate) -> summary.

    python -m flows.post_train configs/demo_cpu.yaml sft.steps=50
    prefect deployment run 'post-train/demo-cpu' --param overrides='["grpo.iterations=2"]'

Rollouts run one at a time in iteration order on a lane beside the stages, so with `grpo.mode: async` they
are generated while earlier iterations train. After `grpo.max_no_signal_iterations` iterations in a row
without learning signal the flow stops, completed, and says why in the summary's `stopped`. The run's
engines and trainer group end with the flow (FlowResources).
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.artifacts import create_image_artifact, create_markdown_artifact, create_table_artifact
from prefect.futures import PrefectFuture
from prefect.runtime import flow_run

from flows.preflight import check_run
from flows.report import (
    StageRecord,
    finish_run,
    no_learning_signal,
    no_signal_fix,
    placement_table,
    plot_curves,
    stage_table,
)
from forge_core.config import RunConfig, load_config
from forge_core.credentials import hide_credentials_in_overrides
from forge_core.launch import install_sigterm_handler, reap_orphaned_launches
from forge_core.run.resources import FlowResources, with_run_id
from forge_core.storage import ObjectStore
from forge_core.timings import LAUNCHER_BACKSTOP_S
from forge_core.trainers.staleness import rollouts_to_start
from tasks import run_as_task, stage_task


@dataclass
class EvalPoint:
    label: str
    policy_uri: str
    eval_uri: str
    accuracy: float
    mean_reward: float


@dataclass
class PipelineSummary:
    flow_run_id: str
    data_uri: str
    sft_uri: str
    final_policy_uri: str
    evals: list[EvalPoint] = field(default_factory=list)
    rollouts: list[str] = field(default_factory=list)
    stages: list[dict] = field(default_factory=list)  # rows of flows.report.stage_table
    placement: list[dict] = field(default_factory=list)  # rows of flows.report.placement_table
    plot_path: str | None = None
    # Why GRPO stopped before grpo.iterations (grpo.max_no_signal_iterations), with the fix; None = it did not.
    stopped: str | None = None

    def as_markdown(self) -> str:
        lines = ["| stage | accuracy | mean reward | policy |", "| --- | --- | --- | --- |"]
        for point in self.evals:
            lines.append(
                f"| {point.label} | {point.accuracy:.3f} | {point.mean_reward:.3f} | `{point.policy_uri}` |"
            )
        return "\n".join(
            [
                f"## forgeflow post-training (flow run `{self.flow_run_id}`)",
                "",
                *lines,
                "",
                f"Data: `{self.data_uri}`",
                "",
                f"Final policy: `{self.final_policy_uri}`",
                *(["", f"**GRPO stopped early**: {self.stopped}"] if self.stopped else []),
            ]
        )


def flow_config(config: str, overrides: list[str] | None, run_id: str | None) -> RunConfig:
    """The flow's resolved config, tagged with its flow run id so it uses only its own engines and trainers."""
    return with_run_id(load_config(config, list(overrides or [])), run_id)


def start_flow(config: str, overrides: list[str] | None) -> RunConfig:
    """Resolve the config, run preflight, install the SIGTERM handler, end what dead flow processes left
    running and sweep crashed attempts."""

    cfg = flow_config(config, overrides, flow_run.get_id())
    # This host is checked only when the Ray cluster is embedded; on a joined one each node checks itself.
    check_run(cfg)
    install_sigterm_handler()
    end_orphaned_launches()
    sweep_crashed_attempts(cfg)
    return cfg


# Crashed attempts a flow start deletes at most (the oldest first); the next start goes on with the rest.
SWEEP_LIMIT = 200


def sweep_crashed_attempts(cfg: RunConfig) -> list[str]:
    """Delete the files of up to SWEEP_LIMIT uncommitted attempts older than any attempt may run and than the
    lease TTL. Returns the attempt prefixes deleted."""
    store = ObjectStore.from_config(cfg.storage)
    longest = max(r.deadline_s + r.kill_grace_s for r in cfg.launch.stage_resources().values())
    older_than_s = max(longest + LAUNCHER_BACKSTOP_S, store.lease_ttl_s)
    deleted = store.sweep_stale_attempts(older_than_s, limit=SWEEP_LIMIT)
    if deleted:
        get_run_logger().info(
            "deleted the files of %d crashed attempt(s) older than %.0f s, e.g. %s", len(deleted), older_than_s,
            deleted[0],
        )
    return deleted


def kill_launches(flow, flow_run, state) -> None:
    """Cancellation/crash hook: take down this flow run's gangs, trainer group and rollout engines."""
    parameters = flow_run.parameters or {}
    try:
        cfg = flow_config(
            parameters.get("config", "configs/demo_cpu.yaml"), parameters.get("overrides"), str(flow_run.id)
        )
    except ValueError:
        return  # the flow failed on its config before it could start anything
    reason = f"flow run {flow_run.id} is {getattr(state, 'name', 'ending').lower()}"
    FlowResources.of(cfg).abort(reason)


def flow_resources(cfg: RunConfig) -> FlowResources:
    """The run's Ray cluster, engine actors and trainer group, ended with the flow (`with flow_resources(cfg):`)."""
    return FlowResources.of(cfg, log_line=get_run_logger().info)


def end_orphaned_launches() -> list[int]:
    """End the torchrun trees and vLLM engines that a killed flow process on this machine left running.
    Call before launching anything; returns the pids ended."""
    ended = reap_orphaned_launches()
    if ended:
        get_run_logger().warning(
            "ended %d processes left running by an earlier flow process that died: pids %s", len(ended), ended
        )
    return ended


def _eval_point(store: ObjectStore, label: str, policy_uri: str, eval_uri: str) -> EvalPoint:
    metrics = store.read_manifest(eval_uri).metrics
    return EvalPoint(label, policy_uri, eval_uri, float(metrics["accuracy"]), float(metrics["mean_reward"]))


class _StageClock:
    """Runs stages as tasks in order, logging each start and finish, and keeps their wall times."""

    def __init__(self, cfg: RunConfig, logger):
        self._cfg = cfg
        self._logger = logger
        self.records: list[StageRecord] = []

    def record(self, label: str, uri: str, seconds: float) -> None:
        self._logger.info("stage %s: done in %.1fs -> %s", label, seconds, uri)
        self.records.append(StageRecord(label, uri, seconds))

    def __call__(self, label: str, stage: str, inputs: dict[str, str], params: dict | None = None) -> str:
        self._logger.info("stage %s: start", label)
        started = time.monotonic()
        uri = run_as_task(self._cfg, stage, inputs, params)
        self.record(label, uri, time.monotonic() - started)
        return uri


@dataclass
class _SubmittedStage:
    label: str
    future: PrefectFuture
    submitted_at: float
    after: _SubmittedStage | None  # the stage it waits for (the lane's previous rollout)
    done_at: float | None = None

    def seconds(self) -> float:
        """Its own run time: from when it could start (submitted, and its predecessor done) to done."""
        ready_at = max(self.submitted_at, self.after.done_at if self.after and self.after.done_at else 0.0)
        return (self.done_at or time.monotonic()) - ready_at


class _RolloutLane:
    """The GRPO loop's rollout stages as submitted tasks, run one at a time in iteration order.

    `submit_ready(policies)` submits what `rollouts_to_start` allows before the next iteration trains."""

    def __init__(
        self, clock: _StageClock, cfg: RunConfig, resources: FlowResources, data_uri: str
    ):
        self._clock = clock
        self._cfg = cfg
        self._task = stage_task(cfg, "rollout")
        self._resources = resources
        self._data_uri = data_uri
        self._mode = cfg.grpo.mode
        self._max_staleness = cfg.grpo.max_staleness
        self._iterations = cfg.grpo.iterations
        self._submitted: list[_SubmittedStage] = []

    def submit_ready(self, policies: list[str]) -> None:
        trains_next = len(policies) - 1
        ready = rollouts_to_start(trains_next, len(self._submitted), self._iterations, self._mode, self._max_staleness)
        for iteration, sampler in ready:
            self._submit(iteration, sampler, policies[sampler])

    def _submit(self, iteration: int, sampler: int, policy_uri: str) -> None:
        label = f"rollout-{iteration + 1}"
        after = self._submitted[-1] if self._submitted else None
        get_run_logger().info("stage %s: start (submitted; sampled by policy %d)", label, sampler)
        future = self._task.submit(
            self._cfg, "rollout", {"policy": policy_uri, "data": self._data_uri},
            {"iteration": iteration, "policy_iteration": sampler}, wait_for=[after.future] if after else None,
        )
        stage = _SubmittedStage(label, future, time.monotonic(), after)
        future.add_done_callback(lambda _: setattr(stage, "done_at", time.monotonic()))
        self._submitted.append(stage)

    def result(self, iteration: int) -> str:
        """Iteration `iteration`'s committed rollouts URI (waits for them); raises what the task raised."""
        stage = self._submitted[iteration]
        uri = stage.future.result()
        self._clock.record(stage.label, uri, stage.seconds())
        return uri

    def drain(self) -> None:
        """Wait for the rollouts in flight: an engine serves one policy at a time."""

        for stage in self._submitted:
            stage.future.wait()

    def abandon(self) -> None:
        """The flow is failing: end the launches of rollouts still in flight and wait until they are gone."""
        in_flight = [stage for stage in self._submitted if stage.done_at is None]
        while in_flight:
            # Again each round: a rollout waiting on its predecessor may launch right after a cancel.
            self._resources.abort("the flow failed while rollouts were in flight")
            for stage in in_flight:
                stage.future.wait(timeout=1.0)
            in_flight = [stage for stage in in_flight if stage.done_at is None]


class _NoSignalWatch:
    """Warns on every GRPO iteration without learning signal; says to stop after `limit` in a row (0 = never)."""


    def __init__(self, limit: int, logger):
        self._limit = limit
        self._logger = logger
        self._in_a_row = 0

    def check(self, label: str, metrics: dict) -> str | None:
        """Why the flow stops GRPO after iteration `label` (with the fix), or None to go on."""
        reason = no_learning_signal(metrics)
        if reason is None:
            self._in_a_row = 0
            return None
        self._in_a_row += 1
        message = f"{label}: no learning signal: {reason} ({self._in_a_row} such iteration(s) in a row)"
        self._logger.warning(message)
        create_markdown_artifact(
            markdown=f"### {label}: no learning signal\n\n{message}.\n\n{no_signal_fix(self._limit)}.\n",
            key=f"{label}-no-learning-signal",
            description="a GRPO iteration that learned nothing",
        )
        if self._limit and self._in_a_row >= self._limit:
            return (
                f"stopped after {self._in_a_row} GRPO iterations in a row without learning signal (last: {label}: "
                f"{reason}). {no_signal_fix(self._limit)}"
            )
        return None


def run_pipeline(cfg: RunConfig, resources: FlowResources) -> PipelineSummary:
    """The stage graph; called inside a flow so every stage is a task run."""
    logger = get_run_logger()
    store = ObjectStore.from_config(cfg.storage)
    run = _StageClock(cfg, logger)

    data_uri = run("prepare", "prepare", {})
    sft_uri = run("sft", "sft", {"data": data_uri})
    summary = PipelineSummary(
        flow_run_id=str(flow_run.get_id() or "local"),
        data_uri=data_uri,
        sft_uri=sft_uri,
        final_policy_uri=sft_uri,
    )
    eval_uri = run("eval-sft", "evaluate", {"policy": sft_uri, "data": data_uri})
    summary.evals.append(_eval_point(store, "sft", sft_uri, eval_uri))
    logger.info("after SFT: accuracy %.3f", summary.evals[-1].accuracy)

    policies = [sft_uri]  # by policy index: SFT = 0, after GRPO iteration k = k+1
    lane = _RolloutLane(run, cfg, resources, data_uri)
    no_signal = _NoSignalWatch(cfg.grpo.max_no_signal_iterations, logger)
    try:
        for iteration in range(cfg.grpo.iterations):
            n = iteration + 1
            lane.submit_ready(policies)
            rollouts_uri = lane.result(iteration)
            inputs = {"policy": policies[iteration], "rollouts": rollouts_uri}
            policies.append(run(f"grpo-{n}", "grpo", inputs, {"iteration": iteration}))
            summary.stopped = no_signal.check(f"grpo-{n}", store.read_manifest(policies[n]).metrics)
            summary.rollouts.append(rollouts_uri)
            lane.drain()  # also the rollouts of later iterations a stop leaves unused: nothing stays in flight
            eval_uri = run(f"eval-grpo-{n}", "evaluate", {"policy": policies[n], "data": data_uri})
            summary.evals.append(_eval_point(store, f"grpo-{n}", policies[n], eval_uri))
            logger.info("after GRPO iteration %d: accuracy %.3f", n, summary.evals[-1].accuracy)
            if summary.stopped:
                logger.warning("GRPO %s", summary.stopped)
                break
    except BaseException:
        lane.abandon()
        raise
    summary.final_policy_uri = policies[-1]

    summary.stages = stage_table(run.records, store)
    summary.placement = placement_table(run.records, store)
    summary.plot_path = str(_plot(cfg, summary, store))
    _publish_summary(summary)
    return summary


def _plot(cfg: RunConfig, summary: PipelineSummary, store: ObjectStore) -> Path:
    rewards = [float(store.read_manifest(uri).metrics.get("reward_mean", 0.0)) for uri in summary.rollouts]
    path = Path(cfg.logging.dir).resolve() / cfg.name / summary.flow_run_id / "curves.png"
    return plot_curves([p.label for p in summary.evals], [p.accuracy for p in summary.evals], rewards, path)


def _publish_summary(summary: PipelineSummary) -> None:
    create_markdown_artifact(markdown=summary.as_markdown(), key="post-train-summary", description="summary")
    create_table_artifact(
        table=summary.stages, key="post-train-stages", description="stage times and metrics"
    )
    create_table_artifact(
        table=summary.placement,
        key="post-train-placement",
        description="where each stage ran: pool, node rank, worker, host, attempts, redirects",
    )
    if summary.plot_path:
        create_image_artifact(
            image_url=Path(summary.plot_path).as_uri(),
            key="post-train-curves",
            description="held-out accuracy and rollout reward per iteration",
        )


@flow(name="post-train", on_cancellation=[kill_launches], on_crashed=[kill_launches], log_prints=True)
def post_train(config: str = "configs/demo_cpu.yaml", overrides: list[str] | None = None) -> dict:
    """Post-train a model per the YAML `config` with `key=value` `overrides` applied; returns the summary."""
    cfg = start_flow(config, overrides)
    with flow_resources(cfg) as resources:
        return asdict(run_pipeline(cfg, resources))


if __name__ == "__main__":
    config, overrides = (sys.argv[1] if len(sys.argv) > 1 else "configs/demo_cpu.yaml"), sys.argv[2:]
    started = time.time()
    # Prefect records the flow's parameters: a tokenised URL in an override goes in redacted.
    summary = post_train(config, hide_credentials_in_overrides(overrides))
    sys.exit(1 if finish_run(summary, load_config(config, overrides), started, config).get("stopped") else 0)
