"""The flow lifetimes' runners: the run's long-lived engines and trainer job on the flow's machine
(launch.placement=local); with pool, the trainer job in a Ray actor on a node of GRPO's pool (the engines are
Ray actors of their own there: forge_core.rollout.actor_engines, and the engine-client stages run in the task's
process: forge_core.run.runners).

    runner = flow_lifetime_runner(cfg, "grpo", resources)      # usually: forge_core.run.runners.runner_for
    result = runner.run(plan, log, cancel)                     # the runner interface, as always

Local placement: the flow process's FlowResources hold the engine services and the trainer job
(TaskProcessRunner, TrainerJobRunner). Pool placement: the first GRPO stage with `grpo.trainer_lifetime: flow`
starts the **trainer resident**: a hosted object (forge_core.compute.actors) on a node of GRPO's pool, holding
its GPUs (`launch.grpo.gpus_per_node`), which does what the flow process does with local placement: it holds a
FlowResources of its own and runs each order through the same local runner, so the trainer job runs on that node
and is started, reused, restarted and stopped by exactly the local code. An order is a Ray call
(`run(spec_uri)`) whose log lines stream back while it runs; a stop is another call. The resident is owned by the
flow process (Ray ends it when that process dies, and its trainer job ends with it through its owner watchdog);
the run's FlowResources ends it at the flow's end (its own FlowResources closed first) and on failure or cancel.
A resident lost during an order (its actor or node died) makes the attempt RETRYABLE, and the retry starts a new
resident on whichever node the cluster gives then. What its stages commit records `placement` with
`resident: trainer`, the pool and the Ray node.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time

from forge_core.compute.actors import Hosted, HostRequest
from forge_core.compute.gang import NodePlace
from forge_core.config import RunConfig
from forge_core.engine.preflight import preflight
from forge_core.launch import LaunchResult, Outcome, RetryableStageError
from forge_core.launch.classify import exception_result
from forge_core.run.in_process import TaskProcessRunner
from forge_core.run.plan import StagePlan
from forge_core.run.resources import FlowResources
from forge_core.run.runner import Attempt, Cancel, FlowProcessRunner, LogRelay, LogSink, Runner
from forge_core.run.spec import read_spec
from forge_core.run.trainer_job import TrainerJobRunner
from forge_core.stages import stage_named
from forge_core.storage.manifest import PLACEMENT_ENV

log = logging.getLogger(__name__)

# Names for people (logs, manifests) of what a resident hosts, by Stage.flow_runner.
RESIDENT_NAMES = {"trainer_job": "trainer"}
# A resident's normal end: its trainer job finishes its order and its engines shut down.
NORMAL_STOP_S = 90.0
FAILING_STOP_S = 30.0
# How long a stopped order may take to report beyond its stage's kill grace.
STOP_MARGIN_S = 15.0

FLOW_RUNNERS: dict[str, type[FlowProcessRunner]] = {r.serves: r for r in (TaskProcessRunner, TrainerJobRunner)}


class ResidentGone(RetryableStageError):
    """The resident serving an order ended or could not be reached: the stage's retry starts a new one."""


def flow_lifetime_runner(cfg: RunConfig, stage: str, resources: FlowResources) -> Runner:
    """The runner of a stage served by the flow's own processes: the local flow runner (the engine-client stages
    also with launch.placement=pool), or with pool an order to the run's trainer resident (module docstring)."""
    kind = stage_named(stage).flow_runner
    assert kind in FLOW_RUNNERS, f"{stage}: no flow runner {kind!r}"
    if cfg.launch.placement != "pool" or kind == TaskProcessRunner.serves:
        return FLOW_RUNNERS[kind](cfg, stage, resources)  # with pool its engines are Ray actors of their own
    return ResidentRunner(cfg, stage, resources)


# ---- on the node -------------------------------------------------------------------------------------------------


class ResidentHost:
    """What runs in a resident's actor (module docstring): a FlowResources of its own, orders run with the local
    flow runner of its kind."""

    def __init__(self, cfg: RunConfig, kind: str, stage: str) -> None:
        self.cfg = dataclasses.replace(cfg, launch=dataclasses.replace(cfg.launch, placement="local"))
        self.kind = kind
        preflight(self.cfg, [stage], checks=())  # this node can run what it hosts (GPUs, vLLM build)
        self.relay = LogRelay(log.info)  # the order waiting on it gets the lines of its long-lived processes
        self.resources = FlowResources.of(self.cfg, log_line=self.relay)
        self._cancel: Cancel | None = None

    def placed(self, record: dict) -> None:
        """Where this resident runs: what every manifest committed from this process records (the stages it runs
        in this process and in the trainer job it launches)."""
        os.environ[PLACEMENT_ENV] = json.dumps(record, sort_keys=True)

    def run(self, spec_uri: str, log: LogSink) -> LaunchResult:
        """Run one order (a stage attempt's spec) to its end with the local flow runner."""
        spec = read_spec(spec_uri, self.cfg.storage)
        if stage_named(spec.stage).flow_runner != self.kind:
            raise ValueError(f"{spec_uri}: a {spec.stage} stage, which a {RESIDENT_NAMES[self.kind]} resident does not run")
        plan = StagePlan(spec.stage, "", spec.output_uri, spec, dict(spec.inputs))
        self._cancel = Cancel()
        self.relay.target = log
        try:
            return FLOW_RUNNERS[self.kind](self.cfg, spec.stage, self.resources).run(plan, log, self._cancel)
        finally:
            self.relay.target = None

    def stop_order(self, reason: str) -> None:
        if self._cancel is not None:
            self._cancel.request(reason)

    def close(self, failing: bool) -> None:
        self.resources.close(failing=failing)


# ---- on the flow's side --------------------------------------------------------------------------------------------


def _resident_record(cfg: RunConfig, kind: str, pool: str, place: NodePlace) -> dict:
    node = {"node_rank": 0, "node_id": place.node_id, "host": place.address, "gpus": list(place.gpu_ids)}
    return {"placement": "ray", "pool": pool, "resident": RESIDENT_NAMES[kind], "nodes": [node], "committed_by": node,
            "flow_run": cfg.launch.run_id}


def ensure_resident(resources: FlowResources, kind: str, stage: str) -> Hosted:
    """The run's resident of `kind` on `stage`'s pool, started now when there is none that can serve."""
    cfg = resources.cfg
    stage_resources = cfg.launch.for_stage(stage)
    pool = stage_resources.pool
    with resources.lock:
        resident = resources.residents.get((kind, pool))
        if resident is not None and resident.lost() is None:
            return resident
        if resident is not None:
            resident.close(FAILING_STOP_S, True)
        cluster = resources.cluster()
        request = HostRequest(None if cluster.embedded else pool, gpus=stage_resources.gpus_per_node)
        name = f"{RESIDENT_NAMES[kind]}-{pool}"
        resident = Hosted.start(cluster, request, ResidentHost, (cfg, kind, stage), cfg.launch.pool_wait_s, name)
        resident.call("placed", _resident_record(cfg, kind, pool, resident.place))
        resources.residents[(kind, pool)] = resident
        resources.log_line(
            f"the run's {RESIDENT_NAMES[kind]} resident runs on Ray node {resident.place.node_id[:8]} "
            f"({resident.place.address}) of pool {pool!r}"
        )
        return resident


class ResidentRunner(Runner):
    """A flow-lifetime stage as an order to the run's resident on its pool (module docstring)."""

    def __init__(self, cfg: RunConfig, stage: str, resources: FlowResources) -> None:
        super().__init__(cfg, stage)
        self.flow_resources = resources
        self.kind = stage_named(stage).flow_runner
        self.where = f"the run's {RESIDENT_NAMES[self.kind]} resident on pool {self.resources.pool!r}"

    def start(self, plan: StagePlan, log_sink: LogSink) -> Attempt:
        resident = ensure_resident(self.flow_resources, self.kind, plan.stage)
        return _Order(resident, plan, log_sink, self.resources.kill_grace_s + STOP_MARGIN_S)


class _Order:
    """One stage's order to a resident: a streamed call of its `run`."""

    launch_id = ""

    def __init__(self, resident: Hosted, plan: StagePlan, log_sink: LogSink, stop_bound_s: float) -> None:
        self.resident = resident
        self.plan = plan
        self._stop_bound_s = stop_bound_s
        self._started = time.monotonic()
        self._call = resident.stream("run", plan.spec_uri, log_sink=log_sink)

    def wait(self, timeout: float) -> LaunchResult | None:
        try:
            done, result = self._call.wait(timeout)
        except Exception as exc:  # noqa: BLE001 - the resident's loss, or the order's own error, classified
            lost = self.resident.lost()
            if lost is not None:
                reason = f"{self.plan.stage}: the run's {self.resident.name} resident went away during the order: {lost}"
                return LaunchResult(Outcome.RETRYABLE, None, reason)
            return exception_result(f"{self.plan.stage} (resident)", exc, time.monotonic() - self._started)
        return result if done else None

    def stop(self, reason: str) -> LaunchResult | None:
        if self.resident.lost() is None:
            try:
                self.resident.call("stop_order", reason, timeout=self._stop_bound_s)
            except Exception as exc:  # noqa: BLE001 - a resident that cannot be reached is gone: the wait says so
                log.warning("%s: could not stop the order (%s)", self.resident.name, type(exc).__name__)
        return self.wait(self._stop_bound_s)
