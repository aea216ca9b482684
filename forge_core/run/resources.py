"""The flow run's long-lived parts on the Ray cluster — its engine actors and its GRPO trainer group — and their end.

    with FlowResources.of(cfg, log_line=logger.info) as resources:   # a flow: everything ends with the block
        ...                                                          # runners find it: FlowResources.of(cfg)
    FlowResources.of(cfg).abort("the flow was cancelled")            # the cancel/crash hook, a failing lane

One object per flow run, keyed by `run_identity(cfg)` (the flow sets `launch.run_id` to its Prefect flow run id,
so concurrent runs of one config share nothing), the run's name and storage root. It holds the run's Ray
connection, the flow-lifetime engine actors and trainer group; nothing else stops them, so they end here:

- `close(failing=False)`: the trainer ranks leave their process group first (bounded), the engines get
  ENGINE_CLOSE_S to shut vLLM down;
- `close(failing=True)`: the trainer actors are killed at once, the engines get ENGINE_STOP_GRACE_ON_FAILURE_S;
- `abort(reason)`: the same as failing, after every gang of this process was ended.

Then the embedded cluster is shut down. Every stop is bounded because Prefect's process worker SIGKILLs a
cancelled flow run 30 s after its SIGTERM; after a SIGKILL, Ray ends the driver's actors and launches end through
their owner watchdog.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Protocol, Self

from forge_core.compute.cluster import ComputeCluster, connect
from forge_core.config import RunConfig, replace, section_to_dict
from forge_core.launch import terminate_all_live
from forge_core.stages import Stage
from forge_core.timings import ENGINE_CLOSE_S, ENGINE_STOP_GRACE_ON_FAILURE_S

if TYPE_CHECKING:
    from forge_core.compute.actors import Hosted
    from forge_core.rollout.actor_engines import EngineActors

log = logging.getLogger(__name__)


class TrainerGroupSlot(Protocol):
    """What the flow's parts use of the run's trainer group (forge_core.run.trainer_group.TrainerGroup, which
    imports this module)."""

    ranks: list[Hosted]  # one Ray actor per rank, in rank order
    busy: threading.Lock  # held by an order while it runs and by a weight push: one collective at a time
    call_timeout_s: float  # a rank's time to answer a short question

    def describe(self) -> str: ...

    def close(self, failing: bool) -> None: ...


# This process's run identity when the config names none (a flow always does: launch.run_id).
_PROCESS_RUN_ID = f"process-{uuid.uuid4().hex}"


def run_identity(cfg: RunConfig) -> str:
    """The flow run the config runs in (`launch.run_id`), else a fresh id for this process."""
    return cfg.launch.run_id or _PROCESS_RUN_ID


def with_run_id(cfg: RunConfig, run_id: str | None) -> RunConfig:
    """`cfg` with `launch.run_id` set (a fresh id when `run_id` is empty): what a flow hands its stages."""
    launch = replace(cfg.launch, run_id=run_id or f"run-{uuid.uuid4().hex}")
    return replace(cfg, launch=launch)


def embedded_cpus(cfg: RunConfig) -> int:
    """Logical CPUs of the embedded cluster's one node: this host's cores, or more when the run's long-lived
    parts and concurrent stages hold more at once (one each), so no stage waits for CPUs that never free up."""
    held = 2 * cfg.rollout.num_engines + cfg.launch.grpo.nproc_per_node + 1  # async: two stages' engines at once
    return max(os.cpu_count() or 1, held)


def embedded_node_problems(cfg: RunConfig) -> list[str]:
    """The stages that ask the embedded cluster, one node, for more nodes than it has."""
    return [
        f"launch.{stage}.nnodes={resources.nnodes}: the run's Ray cluster is the embedded one (launch.ray_address "
        f"null), a single node on this machine; set launch.ray_address to a cluster with {resources.nnodes} nodes "
        f"of the pool, or launch.{stage}.nnodes=1"
        for stage, resources in cfg.launch.stage_resources().items()
        if resources.nnodes > 1
    ]


class FlowResources:
    """The long-lived processes of one flow run (module docstring)."""

    def __init__(self, cfg: RunConfig, key: str, log_line: Callable[[str], None] | None = None) -> None:
        self.cfg = cfg
        self.key = key
        self.log_line = log_line or log.info
        self.lock = threading.Lock()  # guards the trainer group slot
        # The run's trainer group on the Ray cluster (forge_core.run.trainer_group.TrainerGroup), guarded by `lock`.
        self.trainer_group: TrainerGroupSlot | None = None
        # The engine actors in use (forge_core.rollout.actor_engines.EngineActors): the run's own (`flow_engines`,
        # rollout.engine_lifetime=flow) and those of stages running now. Guarded by `engines_lock`.
        self.flow_engines: EngineActors | None = None
        self.stage_engines: set[EngineActors] = set()
        self.engines_lock = threading.Lock()
        self._cluster: ComputeCluster | None = None
        self._cluster_lock = threading.Lock()

    @classmethod
    def of(cls, cfg: RunConfig, log_line: Callable[[str], None] | None = None) -> FlowResources:
        """The run's resources (made now if this process has none for the run yet)."""
        # The run and what names its outputs: configs run in one process without a flow run id never share.
        key = "\0".join((run_identity(cfg), cfg.name, cfg.storage.root))
        with _active_lock:
            resources = _active.get(key)
            if resources is None:
                resources = _active[key] = cls(cfg, key, log_line)
            elif log_line is not None:
                resources.log_line = log_line
            return resources

    def cluster(self) -> ComputeCluster:
        """The run's Ray cluster: this process's connection, else joined at `launch.ray_address` or the embedded
        one started now; ValueError when embedded and a stage asks for more than its one node."""
        with self._cluster_lock:
            if self._cluster is None:
                self._cluster = connect(self.cfg.launch.ray_address, num_cpus=embedded_cpus(self.cfg))
                if self._cluster.owned:
                    how = "started the run's embedded" if self._cluster.embedded else "joined the"
                    self.log_line(f"{how} Ray cluster ({self._cluster.address}) in {self._cluster.start_s:.1f} s")
            if self._cluster.embedded and (problems := embedded_node_problems(self.cfg)):
                raise ValueError("; ".join(problems))
            return self._cluster

    @contextlib.contextmanager
    def engine_actors(self, seed: int) -> Iterator[EngineActors]:
        """The engine actors a stage samples with: the run's, started by the first stage that asks and kept
        (rollout.engine_lifetime=flow), or the stage's own, ended with the block (stage)."""
        from forge_core.rollout.actor_engines import EngineActors  # imports vLLM's pieces: only when sampling

        if self.cfg.rollout.engine_lifetime == "flow":
            with self.engines_lock:
                engines = self.flow_engines
            if engines is None:  # started outside the lock: a stop must not wait out the placement wait
                started = EngineActors.start(self.cluster(), self.cfg, seed)
                with self.engines_lock:
                    self.flow_engines = self.flow_engines or started
                    engines = self.flow_engines
                if engines is not started:
                    started.close()  # another stage was first
            yield engines
            return
        engines = EngineActors.start(self.cluster(), self.cfg, seed)
        with self.engines_lock:
            self.stage_engines.add(engines)
        try:
            yield engines
        finally:
            with self.engines_lock:
                self.stage_engines.discard(engines)
            engines.close()

    def serves(self, stage: Stage) -> bool:
        """Whether the flow's long-lived parts serve `stage`: it is an engine client (flow_runner
        "task_process") or its lifetime setting is "flow"."""
        if stage.flow_runner is None:
            return False
        return stage.flow_runner == "task_process" or self.lifetime(stage) == "flow"

    def lifetime(self, stage: Stage) -> str:
        """"stage" or "flow": the stage's lifetime setting in this run's config ("stage" when it has none)."""
        return section_to_dict(self.cfg, stage.lifetime_key) if stage.lifetime_key else "stage"

    def stop_engines(self, grace_s: float = ENGINE_CLOSE_S) -> list[int]:
        """Stop the run's engine actors (each gets `grace_s` to shut vLLM down); returns their pids."""
        with self.engines_lock:
            actors = [a for a in (self.flow_engines, *self.stage_engines) if a is not None]
            self.flow_engines, self.stage_engines = None, set()
        pids = [engine.pid for engines in actors for engine in engines.slots if engine is not None]
        closing = [
            threading.Thread(target=engines.close, args=(grace_s,), name="forge-close-engines") for engines in actors
        ]
        for thread in closing:
            thread.start()
        for thread in closing:
            thread.join()
        return pids

    def abort(self, reason: str) -> None:
        """End everything at once: every gang of this process and the trainer group, then the engines (bounded)."""
        group = threading.Thread(target=self.stop_trainer_group, args=(True,), name="forge-abort-trainer-group")
        group.start()
        terminate_all_live(reason=reason)
        group.join()
        self._stop(failing=True)

    def close(self, failing: bool = False) -> None:
        """End the run's long-lived processes (module docstring) and forget this object."""
        self._stop(failing)
        with _active_lock:
            if _active.get(self.key) is self:
                del _active[self.key]

    def stop_trainer_group(self, failing: bool) -> str:
        """End the run's trainer group, if any (at a normal end its ranks leave their process group first,
        bounded); returns where it ran ("" when none)."""
        with self.lock:
            group, self.trainer_group = self.trainer_group, None
        if group is None:
            return ""
        group.close(failing)
        return group.describe()

    def _stop(self, failing: bool) -> None:
        trainer_group = self.stop_trainer_group(failing)
        engines = self.stop_engines(ENGINE_STOP_GRACE_ON_FAILURE_S if failing else ENGINE_CLOSE_S)
        with self._cluster_lock:  # last: the trainer group and engine actors above are ended through it
            cluster, self._cluster = self._cluster, None
        if cluster is not None:
            started = time.monotonic()
            cluster.close()
            if cluster.embedded and cluster.owned:
                self.log_line(f"shut down the run's embedded Ray cluster in {time.monotonic() - started:.1f} s")
        if trainer_group:
            self.log_line(f"stopped the run's trainer group ({trainer_group})")
        if engines:
            self.log_line(f"stopped the run's rollout engines: pids {engines}")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(failing=exc_type is not None)


# This process's FlowResources by run (run identity, name, storage root): what FlowResources.of finds.
_active: dict[str, FlowResources] = {}
_active_lock = threading.Lock()
