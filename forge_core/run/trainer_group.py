"""The flow-lifetime GRPO trainer on the Ray cluster (`grpo.trainer_lifetime: flow`):
one actor per rank on `launch.grpo.nnodes` nodes of GRPO's pool, one process group for the whole flow run.

    runner = runner_for(cfg, "grpo")        # a TrainerGroupRunner: each GRPO stage is an order to the group
    result = runner.run(plan, log, cancel)  # the runner interface: deadline, cancel, classification

The first GRPO stage of a run places the group; each rank sees only its own GPUs (LOCAL_RANK 0 on a GPU node),
joins one env:// rendezvous on rank 0's node, and keeps its process group and process for later iterations. An
order is the stage's spec URI, run by every rank at once through run_spec.

A dead rank makes the attempt RETRYABLE; a rank's own exception is classified as a worker's would be. Either
way, and on a deadline or cancel, the whole group is ended (a rank may be waiting in a collective that never
completes) and the next order places a new one. Ray ends the actors when the flow process dies.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from forge_core.compute.actors import Hosted, HostGroup, HostLost, HostRequest
from forge_core.compute.cluster import ComputeCluster
from forge_core.compute.gang import free_port
from forge_core.config import RunConfig
from forge_core.config.schema import ResourceConfig
from forge_core.engine import destroy_distributed, init_distributed, new_gloo_group
from forge_core.engine.preflight import preflight
from forge_core.faults import fault_environment
from forge_core.launch import LaunchResult, Outcome
from forge_core.launch.classify import exception_result
from forge_core.launch.heartbeat import HEARTBEAT_DIR_ENV, Heartbeat, read_heartbeats, stall_note
from forge_core.launch.spec import DEADLINE_ENV
from forge_core.rollout.weight_buckets import release_shared_memory
from forge_core.run.plan import StagePlan
from forge_core.run.resources import FlowResources
from forge_core.run.runner import Attempt, FlowProcessRunner, LogSink
from forge_core.run.scaffold import HeldPolicy, run_spec, worker_process_setup
from forge_core.run.spec import read_spec
from forge_core.run.weight_sync import WeightPush, export_push_plan, push_held_weights
from forge_core.stages import stage_named
from forge_core.storage.manifest import PLACEMENT_ENV
from forge_core.timings import TRAINER_CLOSE_S, TRAINER_RANK_CALL_S, TRAINER_RENDEZVOUS_S

log = logging.getLogger(__name__)



# ---- on the node -------------------------------------------------------------------------------------------------


class TrainerRank:
    """One rank of the trainer group, in its actor on its node."""

    def __init__(self, cfg: RunConfig, rank: int, world_size: int) -> None:
        worker_process_setup("grpo")
        preflight(cfg, ["grpo"], checks=())  # this node can train (GPUs, torch build)
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.heartbeat_dir = tempfile.mkdtemp(prefix=f"forge-trainer-rank{rank}-")
        os.environ[HEARTBEAT_DIR_ENV] = self.heartbeat_dir
        self.dist: Any = None
        self.held = HeldPolicy()

    def free_port(self, address: str) -> int:
        """A free port on this node's `address`, for the group's rendezvous (rank 0 only)."""
        return free_port(address)

    def join(self, master: str, port: int, local_rank: int, placement: dict) -> None:
        """Join the group's process group (every rank at once; blocks until all have joined)."""
        os.environ.update(
            {
                "RANK": str(self.rank),
                "WORLD_SIZE": str(self.world_size),
                "LOCAL_RANK": str(local_rank),
                "MASTER_ADDR": master,
                "MASTER_PORT": str(port),
                PLACEMENT_ENV: json.dumps(placement, sort_keys=True),
                # Collectives time out only after an order's deadline, so the runner's deadline ends a hung order
                # first, naming the rank.
                DEADLINE_ENV: str(self.cfg.launch.grpo.deadline_s),
            }
        )
        self.dist = init_distributed(self.cfg.training.device)
        # A GRPO stage's final optimizer state is written behind its commit on a group of its own, beside the
        # next order's and the weight pushes' collectives on the default group.
        self.held.save_group = new_gloo_group()

    def run(self, spec_uri: str, push: WeightPush | None = None, *, log: LogSink) -> str | None:
        """Run one order: the GRPO stage `spec_uri` names, on this rank, with its part in pushing the policy to the
        engines as it is exported (`push`, ExportPush). Returns why that part failed; None when it did not (or
        there was none)."""
        started = time.perf_counter()
        spec = read_spec(spec_uri, self.cfg.storage)
        if stage_named(spec.stage).flow_runner != TrainerGroupRunner.serves:
            raise ValueError(f"{spec_uri}: a {spec.stage} stage, which the trainer group does not run")
        self.held.push, self.held.push_failed = push, None
        try:
            with _forwarded_records(log, self.rank):
                run_spec(spec, process_group=self.dist, started=started, held=self.held)
        finally:
            self.held.push = None
        return self.held.push_failed

    def held_stage(self) -> str | None:
        """The stage artifact whose policy this rank holds (its last order's), None when it holds none."""
        return self.held.stage_uri

    def push_weights(self, push: WeightPush) -> float:
        """Stream the held policy to the engines of `push` (collective); the seconds it took."""
        return push_held_weights(self.held, push)

    def heartbeat(self) -> Heartbeat | None:
        return read_heartbeats(self.heartbeat_dir).get(self.rank)

    def release(self) -> None:
        """Give back what outlives this process if it is killed now: the shared-memory files of a weight push
        it may be waiting in (a thread of its own; the push may never return)."""
        release_shared_memory()

    def close(self) -> None:
        """Leave the process group once the last stage's state is committed (a failed write is logged: the next
        GRPO stage on that policy trains its stage again to rebuild it)."""
        try:
            self.held.drop()
        except Exception as exc:  # noqa: BLE001 - repaired by the next stage; the rank ends either way
            log.error("trainer rank %d: the last stage's optimizer state was not committed: %s", self.rank, exc)
        destroy_distributed()
        shutil.rmtree(self.heartbeat_dir, ignore_errors=True)


@contextlib.contextmanager
def _forwarded_records(sink: LogSink, rank: int):
    """While the block runs: the process's `forge_core` records go to `sink` (rank 0's from INFO, the other
    ranks' from WARNING, prefixed with their rank)."""
    handler = logging.Handler(logging.INFO if rank == 0 else logging.WARNING)
    prefix = "" if rank == 0 else f"[rank {rank}] "
    handler.setFormatter(logging.Formatter(f"{prefix}%(levelname)s %(name)s: %(message)s"))
    handler.emit = lambda record: sink(handler.format(record))  # type: ignore[method-assign]
    logger = logging.getLogger("forge_core")
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)


# ---- on the flow's side ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GroupShape:
    """What a group was placed for: a later order with other launch settings gets a new group."""

    pool: str | None
    nnodes: int
    nproc_per_node: int
    gpus_per_node: int
    device: str

    @classmethod
    def of(cls, cfg: RunConfig, cluster: ComputeCluster) -> GroupShape:
        resources: ResourceConfig = cfg.launch.grpo
        pool = None if cluster.embedded else resources.pool
        return cls(pool, resources.nnodes, resources.nproc_per_node, resources.gpus_per_node, cfg.training.device)


class TrainerGroup:
    """The run's trainer ranks on their nodes."""

    call_timeout_s = TRAINER_RANK_CALL_S

    def __init__(
        self, shape: GroupShape, group: HostGroup, ranks: list[Hosted], placement: dict, deadline_s: float
    ) -> None:
        self.shape = shape
        self.group = group
        self.ranks = ranks
        self.placement = placement
        # Held by an order and by a weight push: both are collectives of every rank, so one at a time.
        self.busy = threading.Lock()
        # A normal close first waits for the last stage's state to be written (bounded as an order is).
        self.close_s = TRAINER_CLOSE_S + deadline_s

    @classmethod
    def start(cls, cluster: ComputeCluster, cfg: RunConfig, log_line: LogSink) -> TrainerGroup:
        """Place the ranks (PlacementUnavailable after launch.pool_wait_s), build them and join them into one
        process group."""
        shape = GroupShape.of(cfg, cluster)
        nodes, per_node = shape.nnodes, shape.nproc_per_node
        request = HostRequest(shape.pool, gpus=shape.gpus_per_node // per_node)
        log_line(
            f"grpo: placing the run's trainer group, {nodes} node(s) x {per_node} rank(s) (up to "
            f"launch.pool_wait_s={cfg.launch.pool_wait_s:g} s)"
        )
        group = HostGroup.reserve(cluster, request, nodes, per_node, cfg.launch.pool_wait_s, "grpo-trainer")
        ranks: list[Hosted] = []
        try:
            faults = fault_environment()
            world = nodes * per_node
            with ThreadPoolExecutor(world, thread_name_prefix="forge-trainer-start") as pool:
                ranks = list(
                    pool.map(
                        lambda k: group.host(k, TrainerRank, (cfg, k, world), f"trainer rank {k}", env=faults),
                        range(world),
                    )
                )
            placement = _placement_record(cfg, shape, ranks)
            master = ranks[0].place.address
            port = ranks[0].call("free_port", master)
            local_rank = (lambda k: 0) if request.gpus else (lambda k: k % per_node)
            with ThreadPoolExecutor(world, thread_name_prefix="forge-trainer-join") as pool:
                joins = [
                    pool.submit(rank.call, "join", master, port, local_rank(k), placement, timeout=TRAINER_RENDEZVOUS_S)
                    for k, rank in enumerate(ranks)
                ]
                for joined in joins:
                    joined.result()
        except BaseException:
            _end(ranks, group, failing=True)
            raise
        trainer = cls(shape, group, ranks, placement, cfg.launch.grpo.deadline_s)
        log_line(f"grpo: the run's trainer group runs on {trainer.describe()}, rendezvous {master}:{port}")
        return trainer

    def describe(self) -> str:
        return ", ".join(
            f"node {n['node_rank']} on {n['node_id'][:8]} ({n['host']})" for n in self.placement["nodes"]
        )

    def lost(self) -> str | None:
        """Why a rank is gone (its actor or node died), None while all are alive."""
        return next((why for rank in self.ranks if (why := rank.lost()) is not None), None)

    def probe(self) -> tuple[dict[int, Heartbeat], dict[int, str]]:
        """Ask every rank at once (each bounded by TRAINER_RANK_CALL_S): the last heartbeat of each that
        answered, and why each dead one is gone. A rank that is only slow to answer is in neither."""

        def ask(k: int) -> tuple[int, Heartbeat | None, str | None]:
            rank = self.ranks[k]
            if rank.lost() is not None:
                return k, None, rank.lost()
            try:
                return k, rank.call("heartbeat", timeout=TRAINER_RANK_CALL_S), None
            except HostLost as exc:
                return k, None, str(exc)
            except Exception:  # noqa: BLE001 - no answer in time: not known to be gone
                return k, None, None

        with ThreadPoolExecutor(len(self.ranks), thread_name_prefix="forge-trainer-probe") as pool:
            answers = list(pool.map(ask, range(len(self.ranks))))
        beats = {k: beat for k, beat, _ in answers if beat is not None}
        return beats, {k: why for k, _, why in answers if why is not None}

    def stall(self, event: str) -> str:
        """Which rank stopped making progress, from the live ranks' heartbeats."""
        beats, _ = self.probe()
        return stall_note(beats, range(len(self.ranks)), time.time(), event, when_level=False)

    def close(self, failing: bool) -> None:
        """End every rank (at a normal end each first commits the last stage's state and leaves its process
        group) and give the nodes back."""
        _end(self.ranks, self.group, failing, self.close_s)


def _end(ranks: list[Hosted], group: HostGroup, failing: bool, close_s: float = TRAINER_CLOSE_S) -> None:
    """End `ranks` and give `group` back: at once when failing (a rank may sit in a collective that never
    completes), else each first closes (within `close_s`)."""

    def end(rank: Hosted) -> None:
        if failing:
            if rank.lost() is None:
                with contextlib.suppress(Exception):  # bounded; ended below either way
                    rank.call("release", timeout=TRAINER_RANK_CALL_S)
            rank.mark_lost("ended with its group")  # no close call: ended at once
        rank.close(close_s)

    if ranks:
        with ThreadPoolExecutor(len(ranks), thread_name_prefix="forge-trainer-close") as pool:
            list(pool.map(end, ranks))
    group.close()


def _placement_record(cfg: RunConfig, shape: GroupShape, ranks: list[Hosted]) -> dict:
    per_node = shape.nproc_per_node
    nodes = []
    for node_rank in range(shape.nnodes):
        on_node = ranks[node_rank * per_node : (node_rank + 1) * per_node]
        gpus = [gpu for rank in on_node for gpu in rank.place.gpu_ids]
        nodes.append({**on_node[0].place.record(node_rank), "gpus": gpus})
    return {
        "placement": "ray",
        "pool": cfg.launch.grpo.pool or "",
        "served_by": "trainer",
        "nodes": nodes,
        "ranks": [{"rank": k, "node_rank": k // per_node} for k in range(len(ranks))],
        "committed_by": nodes[0],
        "flow_run": cfg.launch.run_id,
    }


def ensure_trainer_group(resources: FlowResources, log_line: LogSink) -> TrainerGroup:
    """The run's live trainer group, placed now when there is none (or it has other launch settings or lost a
    rank). Placed outside the slot's lock: a stop must not wait out the placement wait."""
    cfg = resources.cfg
    cluster = resources.cluster()
    shape = GroupShape.of(cfg, cluster)
    with resources.lock:
        trainer = resources.trainer_group
        if trainer is not None and trainer.shape == shape and trainer.lost() is None:
            return trainer
        resources.trainer_group = None
    if trainer is not None:
        trainer.close(failing=True)
    started = TrainerGroup.start(cluster, cfg, log_line)
    with resources.lock:
        if resources.trainer_group is None:
            resources.trainer_group = started
            return started
        winner = resources.trainer_group
    started.close(failing=False)  # another stage was first
    return winner


def forget_trainer_group(resources: FlowResources, trainer: TrainerGroup) -> None:
    """End `trainer` at once and take it out of the run's slot (a failed, stopped or cancelled order)."""
    with resources.lock:
        if resources.trainer_group is trainer:
            resources.trainer_group = None
    trainer.close(failing=True)


class TrainerGroupRunner(FlowProcessRunner):
    """A GRPO stage as an order to the run's trainer group."""

    serves = "trainer_group"

    @property
    def where(self) -> str:  # type: ignore[override]
        return f"the run's trainer group on pool {self.resources.pool!r}"

    def start(self, plan: StagePlan, log: LogSink) -> Attempt:
        trainer = ensure_trainer_group(self.flow_resources, log)
        return _Order(trainer, plan, log, self.flow_resources)


class _Order:
    """One stage's order to the group: a streamed `run` call on every rank."""

    launch_id = ""

    def __init__(self, trainer: TrainerGroup, plan: StagePlan, log: LogSink, resources: FlowResources) -> None:
        self.trainer = trainer
        self.plan = plan
        self._resources = resources
        self._log = log
        # A weight push in progress ends first (each of its steps is bounded by weight_sync.timeout_s).
        self._holding = trainer.busy.acquire(timeout=4 * resources.cfg.rollout.weight_sync.timeout_s)
        self._started = time.monotonic()
        # In sync mode the engines wait for this policy: they load it while it is exported (ExportPush). Not while
        # a push from the flow may still hold them (the lock was not had).
        pushes = export_push_plan(resources, trainer, plan.output_uri) if self._holding else None
        plan_of_rank = pushes or [(None, [])] * len(trainer.ranks)
        self._pushed_to: dict[int, list] = {k: engines for k, (_, engines) in enumerate(plan_of_rank) if engines}
        self._calls = [
            rank.stream("run", plan.spec_uri, part, log_sink=log) for rank, (part, _) in zip(trainer.ranks, plan_of_rank)
        ]

    def _settle_engines(self, failed: dict[int, str]) -> None:
        """The engines the order pushed to serve what they report now, but those of a rank whose part failed (its
        reason in `failed`; every rank's when the order failed): part of their weights may be new, so they are
        restarted from the store at their next serve."""
        pushed_to, self._pushed_to = self._pushed_to, {}
        for k, engines in pushed_to.items():
            why = failed.get(k)
            for engine in engines:
                if why is None:
                    try:
                        engine.refresh(engine.host.call("describe"))
                    except Exception as exc:  # noqa: BLE001 - gone since: restarted at its next serve
                        engine.failed = f"lost after a weight transfer ({type(exc).__name__})"
                else:
                    engine.failed = engine.failed or f"interrupted weight transfer ({why})"
            how = f"failed ({why}); restarted from the store" if why else "done alongside its export"
            names = ", ".join(f"engine {engine.index}" for engine in engines)
            self._log(f"weight sync of {self.plan.output_uri} from rank {k} to {names}: {how}")

    def _release(self) -> None:
        if self._holding:
            self._holding = False
            self.trainer.busy.release()

    def wait(self, timeout: float) -> LaunchResult | None:
        until = time.monotonic() + timeout
        pending = list(enumerate(self._calls))
        push_failures: dict[int, str] = {}
        while pending:
            k, call = pending[0]
            try:
                done, push_failed = call.wait(max(0.0, until - time.monotonic()))
            except Exception as exc:  # noqa: BLE001 - the rank's loss, or its own error, classified below
                return self._failed(k, exc)
            if not done:
                return self._first_failure()
            if push_failed:
                push_failures[k] = push_failed
            pending.pop(0)
        self._settle_engines(push_failures)
        self._release()
        return LaunchResult(Outcome.SUCCESS, 0, "committed by the run's trainer group")

    def _first_failure(self) -> LaunchResult | None:
        """A rank that already failed while an earlier one still runs (the others may wait for it forever)."""
        for k, call in enumerate(self._calls):
            try:
                call.wait(0.0)
            except Exception as exc:  # noqa: BLE001 - classified in _failed
                return self._failed(k, exc)
        return None

    def _failed(self, k: int, exc: BaseException) -> LaunchResult:
        """The order's result once rank `k`'s call ended with `exc`. The group is probed first, since a rank's
        error may follow from a dead peer: a lost rank makes it RETRYABLE; else `exc` is classified."""
        _, gone = self.trainer.probe()
        self._settle_engines(dict.fromkeys(self._pushed_to, f"the order failed on rank {k}"))
        self._release()
        forget_trainer_group(self._resources, self.trainer)
        if gone:
            names = "; ".join(f"rank {j}: {why}" for j, why in sorted(gone.items()))
            after = "" if k in gone else f" (rank {k} then failed: {type(exc).__name__})"
            reason = f"grpo: the trainer group lost a rank during the order (its actor or node died): {names}{after}"
            return LaunchResult(Outcome.RETRYABLE, None, reason)
        return exception_result(f"grpo (trainer rank {k})", exc, time.monotonic() - self._started)

    def stop(self, reason: str) -> LaunchResult:
        """End the group (a rank may be in a collective that never completes); the result names a stalled rank."""
        stall = self.trainer.stall("the group was stopped")
        self._settle_engines(dict.fromkeys(self._pushed_to, "the order was stopped"))
        self._release()
        forget_trainer_group(self._resources, self.trainer)
        return LaunchResult(Outcome.CANCELLED, None, reason, stall=stall)
