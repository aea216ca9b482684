"""The flow run's long-lived processes — its rollout engines and its GRPO trainer — and their end.

    with FlowResources.of(cfg, log=logger.info) as resources:     # a flow: everything ends with the block
        ...                                                       # runners find it: FlowResources.of(cfg)
    FlowResources.of(cfg).abort("the flow was cancelled")         # the cancel/crash hook, a failing lane

One object per flow run (keyed by the run's engine state folder, which is per `launch.run_id`:
forge_core.rollout.lifetime.engine_state_dir), found by every runner that needs it through the config it
holds. The first rollout/evaluate stage with `rollout.engine_lifetime: flow` starts the engine services (in
the run's state folder: forge_core.rollout.lifetime.stage_generator); the first GRPO stage with
`grpo.trainer_lifetime: flow` starts the trainer job (forge_core.run.trainer_job), or with `launch.placement:
pool` the trainer group and the engine actors on the Ray cluster (forge_core.run.trainer_group,
forge_core.run.engines), which this object holds. Nothing else would stop them, so the flow ends them here, and only here:

- `close(failing=False)` (the block's normal end): the trainer job finishes its current order and exits on a
  stop order (up to STOP_TIMEOUT_S, then the launcher ends it), the engines get STOP_GRACE_S;
- `close(failing=True)` (the block ends with an exception): the trainer job is ended without waiting for its
  order, the engines get ENGINE_STOP_GRACE_ON_FAILURE_S, then SIGTERM and SIGKILL 2 s later;
- `abort(reason)` (the flow's cancel/crash hook, the rollout lane abandoning rollouts in flight): the same,
  after every launch of this process was ended at once (forge_core.launch.terminate_all_live: SIGTERM, kill
  grace, SIGKILL; the trainer job is one of them).

Bounds (Prefect 3.7's process worker SIGKILLs a cancelled flow run 30 s after its SIGTERM: prefect/runner/
_cancellation_manager.py, grace_seconds = 30.0): terminate_all_live takes at most max(launch.*.kill_grace_s) +
10 s (20 s by default), the engines at most ENGINE_STOP_GRACE_ON_FAILURE_S + 2 s: ~25 s in all; a trainer group on
a Ray cluster is ended meanwhile (its actors killed at once). Whatever a
SIGKILL still catches ends itself within ~2 s through its owner watchdog (forge_core.launch.owner), the one
place owner watching lives (launched workers, the trainer job, the engine services and reward workers alike).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Self

from forge_core.compute.cluster import ComputeCluster, connect
from forge_core.config import RunConfig, section_to_dict
from forge_core.launch import terminate_all_live
from forge_core.rollout.lifetime import STOP_GRACE_S, engine_state_dir, stop_flow_engines
from forge_core.stages import Stage

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 60.0  # the trainer job's time to finish its current order at a flow's normal end
ENGINE_STOP_GRACE_ON_FAILURE_S = 3.0


def trainer_state_dir(cfg: RunConfig) -> Path:
    """`<engine state dir>-trainer`: next to the run's engine services, keyed the same way (per flow run)."""
    engine_dir = engine_state_dir(cfg)
    return engine_dir.with_name(engine_dir.name + "-trainer")


class FlowResources:
    """The long-lived processes of one flow run (module docstring)."""

    def __init__(self, cfg: RunConfig, key: Path, log_line: Callable[[str], None] | None = None) -> None:
        self.cfg = cfg
        self.key = key
        self.log_line = log_line or log.info
        self.lock = threading.Lock()  # guards the trainer slots (forge_core.run.trainer_job, .trainer_group)
        self.trainer_job: Any = None  # a forge_core.run.trainer_job.TrainerJob while one runs
        # With launch.placement=pool: the run's trainer group on the Ray cluster (forge_core.run.trainer_group.
        # TrainerGroup), guarded by `lock`.
        self.trainer_group: Any = None
        # With launch.placement=pool: the engine actors in use (forge_core.rollout.actor_engines.EngineActors):
        # the run's own (`flow_engines`, rollout.engine_lifetime=flow) and those of stages running now.
        # Guarded by `engines_lock`.
        self.flow_engines: Any = None
        self.stage_engines: set[Any] = set()
        self.engines_lock = threading.Lock()
        self._cluster: ComputeCluster | None = None
        self._cluster_lock = threading.Lock()

    @classmethod
    def of(cls, cfg: RunConfig, log_line: Callable[[str], None] | None = None) -> FlowResources:
        """The run's resources (made now if this process has none for the run yet)."""
        key = engine_state_dir(cfg)
        with _active_lock:
            resources = _active.get(key)
            if resources is None:
                resources = _active[key] = cls(cfg, key, log_line)
            elif log_line is not None:
                resources.log_line = log_line
            return resources

    def cluster(self) -> ComputeCluster:
        """The Ray cluster of launch.placement=pool: joined at `launch.ray_address`, or the embedded one started
        now (forge_core.compute.cluster); the connection this process already has, when it has one."""
        with self._cluster_lock:
            if self._cluster is None:
                self._cluster = connect(self.cfg.launch.ray_address)
                if self._cluster.owned:
                    self.log_line(
                        f"started the run's embedded Ray cluster ({self._cluster.address}) in {self._cluster.start_s:.1f} s"
                    )
            return self._cluster

    @contextlib.contextmanager
    def engine_actors(self, seed: int) -> Iterator[Any]:
        """The engine actors a stage samples with (forge_core.run.engines): the run's, started by the first stage
        that asks and kept (rollout.engine_lifetime=flow), or the stage's own, ended with the block (stage)."""
        from forge_core.rollout.actor_engines import EngineActors  # imports Ray: only a pool run pays for it

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
        """Whether the flow's own processes serve `stage` (forge_core.run.runners): its lifetime setting is "flow",
        or it is an engine client (flow_runner "task_process") and the engines are Ray actors (launch.placement=
        pool), where a launch of its own would only relay between the flow and its engines."""
        if stage.flow_runner is None:
            return False
        engines_on_cluster = self.cfg.launch.placement == "pool" and stage.flow_runner == "task_process"
        return self.lifetime(stage) == "flow" or engines_on_cluster

    def lifetime(self, stage: Stage) -> str:
        """"stage" or "flow": the stage's lifetime setting in this run's config ("stage" when it has none)."""
        return section_to_dict(self.cfg, stage.lifetime_key) if stage.lifetime_key else "stage"

    def stop_trainer(self, timeout_s: float = STOP_TIMEOUT_S) -> list[int]:
        """Stop the run's trainer job if there is one (`timeout_s` to finish its order; 0 on failure) and
        remove the run's trainer state folder; returns the job's pids."""
        with self.lock:
            job, self.trainer_job = self.trainer_job, None
        pids = job.stop(timeout_s) if job is not None else []
        with contextlib.suppress(OSError, ValueError):  # ValueError: a shared temp base not ours: nothing there
            trainer_state_dir(self.cfg).rmdir()  # empty once its order folders are gone
        return pids

    def stop_engines(self, grace_s: float = STOP_GRACE_S) -> list[int]:
        """Stop the run's engines: its engine services on this machine (each gets `grace_s` after its shutdown
        request; their state folder is removed) and its engine actors on the Ray cluster (each gets `grace_s` to
        shut vLLM down); returns their pids. Nothing when there are none."""
        with self.engines_lock:
            actors = [a for a in (self.flow_engines, *self.stage_engines) if a is not None]
            self.flow_engines, self.stage_engines = None, set()
        pids = [engine.pid for engines in actors for engine in engines.slots if engine is not None]
        closing = [
            threading.Thread(target=engines.close, args=(grace_s,), name="forge-close-engines") for engines in actors
        ]
        for thread in closing:
            thread.start()
        pids += stop_flow_engines(self.cfg, grace_s)
        for thread in closing:
            thread.join()
        return pids

    def abort(self, reason: str) -> None:
        """End everything at once: every launch of this process (gangs on the cluster too), the trainer group on
        the cluster (at the same time), the trainer job, the engines (bounded)."""
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
        """End the run's trainer group on the cluster, if there is one (forge_core.run.trainer_group: at a normal
        end its ranks leave their process group first, bounded); returns where it ran ("" when none)."""
        with self.lock:
            group, self.trainer_group = self.trainer_group, None
        if group is None:
            return ""
        group.close(failing)
        return group.describe()

    def _stop(self, failing: bool) -> None:
        trainer_group = self.stop_trainer_group(failing)
        engines = self.stop_engines(ENGINE_STOP_GRACE_ON_FAILURE_S if failing else STOP_GRACE_S)
        with self._cluster_lock:  # last: the trainer group and engine actors above are ended through it
            cluster, self._cluster = self._cluster, None
        if cluster is not None:
            cluster.close()
        if trainer_group:
            self.log_line(f"stopped the run's trainer group ({trainer_group})")
        trainers = self.stop_trainer(0.0 if failing else STOP_TIMEOUT_S)
        if trainers:
            self.log_line(f"stopped the run's GRPO trainer job: pids {trainers}")
        if engines:
            self.log_line(f"stopped the run's rollout engines: pids {engines}")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(failing=exc_type is not None)


# This process's FlowResources by run (engine state folder): what FlowResources.of finds.
_active: dict[Path, FlowResources] = {}
_active_lock = threading.Lock()
