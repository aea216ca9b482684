"""Stage placement on a work pool's workers: one attempt as node runs on other machines (launch.placement=pool).

    runner = runner_for(cfg, "sft", dispatcher)     # a PoolRunner when launch.placement is "pool"
    result = runner.run(plan, log, cancel)          # -> LaunchResult, supervised like every runner
    result = run_node(order, log, worker)           # on a worker: one node's part (flows/stage_deployment.py)

The flow process plans the stage and writes its spec as always; the `PoolRunner` then starts the attempt as
`nnodes` runs of the pool's stage deployment (`stage-node/<pool>`, made by `forgeflow pools create`), one per
distinct live, free worker, each pinned to its worker through the worker's own work queue. What the runs of one
attempt share is the object store and nothing else. Under `<output_uri>/_placement/<attempt>/`:

    owner.json                  the flow's heartbeat (this runner rewrites it every BEAT_S)
    r<round>/node-<k>.json      node k's heartbeat (its worker and host), rewritten every BEAT_S
    r<round>/rendezvous.json    node 0's c10d endpoint (a free port of its host) and every node's host
    r<round>/progress-<k>.json  the newest progress line node k's ranks printed
    r<round>/node-<k>.result.json   node k's LaunchResult, written when its launch ended
    r<round>/stop.json          written by the runner, or by nobody: every node ends its launch on it
and `<output_uri>/_placement/<attempt>.json`, the attempt's record (nodes, redirects, outcome) that later
attempts and the stage table read.

How the attempt behaves (Prefect 3.7's dispatch behaviour is docs/architecture.md, "Placement on pools"):

- Placement: a worker is live when Prefect says it is ONLINE and its own queue READY, free when that queue holds
  no unfinished run. Fewer live, free workers than the stage needs: it waits, and fails (retryable,
  PlacementUnavailable) after `launch.pool_wait_s` with the pool's state named. A node run its worker has
  not taken `launch.node_start_s` after it was created (a worker that died after its last poll, a full one):
  the round is abandoned, that worker put last, and the nodes placed again (a redirect, recorded). A node run
  its worker took that writes no heartbeat within node_start_s + node_timeout_s is a lost node.
- Rendezvous: node 0 waits for every node's heartbeat, picks a free port of its host and publishes it with
  every node's host; the others read it. torchrun's c10d store runs on node 0 (`is_host` stated, since several
  nodes may share a host name), all nodes under one rendezvous id, the attempt's launch id.
- Liveness: a node run watches the flow's heartbeat, the stop object and its peers' heartbeats and results; the
  runner watches the node runs' Prefect states, heartbeats and results. A heartbeat unchanged for
  `launch.node_timeout_s` on the watcher's own clock (no clocks compared across machines), or a node run that
  ended without a result (Crashed: its process was killed), is a lost node: the attempt ends on every node and
  is RETRYABLE; the retry resumes from the stage's newest committed checkpoint on whichever workers are live
  and free then. A node whose launch failed only because a peer did is collateral; the cause is reported.
- Owner: the flow's heartbeat is the node runs' owner (a pid-based watchdog works on one machine only): when it
  stops (the flow process killed outright) every node ends its launch within node_timeout_s + its kill grace.
- Stop: the runner's deadline, a cancel, or the flow's cancel/SIGTERM (forge_core.launch.terminate_all_live,
  through add_remote_stop) writes the stop object, waits up to kill_grace_s + STOP_MARGIN_S for the nodes'
  results, then cancels the node runs that are still unfinished through Prefect.
- Results: `run_deployment` never raises and persisted Prefect results land on the worker's own disk, so every
  node writes its LaunchResult to the store; the runner combines them into the attempt's one result.

A resident (forge_core.run.resident) is a one-node attempt of this kind that hosts the run's long-lived engines or
trainer job on its worker until the flow ends, its objects under `<storage.root>/_residents/`.

Nothing secret is a node run's parameter: the order holds URIs, names and numbers; credentials come from each
node's own environment (AWS keys, FORGE_SECRET_URLS), like every worker's. This module never imports Prefect:
the dispatcher it is given (tasks/placement.py) speaks to the Prefect API.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Protocol, Self

from forge_core.config import RunConfig
from forge_core.config.schema import StorageConfig
from forge_core.engine.preflight import preflight
from forge_core.faults import FAULT_ENV, FAULT_ONCE_ENV
from forge_core.launch import LaunchResult, Outcome, RetryableStageError, add_remote_stop, start
from forge_core.launch.classify import exception_result
from forge_core.launch.spec import NodeRendezvous
from forge_core.metrics.progress import parse_progress_line
from forge_core.run.plan import StagePlan, launch_spec_for
from forge_core.run.runner import Attempt, LogSink, Runner
from forge_core.run.spec import StageSpec, read_spec
from forge_core.stages import STAGE_MODULES_ENV, is_builtin, stage_named
from forge_core.storage import ObjectStore
from forge_core.storage.manifest import PLACEMENT_ENV, utc_now_iso

log = logging.getLogger(__name__)

PLACEMENT_DIR = "_placement"
BEAT_S = 2.0  # how often a node run and the attempt's owner rewrite their heartbeat objects
POLL_S = 1.0  # how often they look at each other (and the runner at the pool through the Prefect API)
RESULT_POLL_S = 0.2  # how often, in between, the runner reads the results of nodes past their last step
STOP_MARGIN_S = 10.0  # after a stop, beyond the kill grace: how long the runner waits for the nodes' results
PROGRESS_EVERY_S = 1.0  # a node publishes its newest progress line at most this often (the last one always)
TAIL_LINES = 200
# Set on a worker (or its node): the address this node's peers reach it at; default: its host name's address.
NODE_ADDRESS_ENV = "FORGE_NODE_ADDRESS"
# Set in a node run forked by its worker's zygote (flows/warm_start.py): recorded as the node's start, warm or cold.
STARTED_WARM_ENV = "FORGE_STARTED_WARM"
# Test and chaos hooks forwarded from the flow's environment to its node runs (never a secret).
FORWARDED_ENV = (FAULT_ENV, FAULT_ONCE_ENV)


class PlacementUnavailable(RetryableStageError):
    """The pool did not have enough live, free workers for the attempt within launch.pool_wait_s."""


# ---- what the dispatcher (tasks/placement.py: the Prefect API) offers ------------------------------------


@dataclass(frozen=True)
class WorkerSlot:
    """A worker of a pool as placement sees it: live (ONLINE, its own queue polled), busy (its queue holds an
    unfinished run), and why not, for messages."""

    name: str  # the worker's name, which is also its own work queue's name
    live: bool
    busy: bool
    note: str = ""


@dataclass(frozen=True)
class NodeRunState:
    """A node run's Prefect state: its name (Scheduled, Late, Pending, Running, Completed, Crashed, ...), whether
    it is final, and its message."""

    name: str
    final: bool
    message: str = ""

    @property
    def started(self) -> bool:
        """Its worker took it (Pending, Running, ...): no longer waiting in its queue."""
        return self.name not in ("Scheduled", "Late", "AwaitingRetry", "unknown")


class NodeDispatcher(Protocol):
    """Starts and watches node runs on a pool's workers (tasks/placement.py implements it on Prefect)."""

    def workers(self, pool: str) -> list[WorkerSlot]:
        """Every worker of `pool` that has its own work queue."""

    def start_node(self, pool: str, worker: str, order: NodeOrder, env: dict[str, str]) -> str:
        """Start a run of `pool`'s stage deployment on `worker` with `order`; returns its run id."""

    def state(self, run_id: str) -> NodeRunState:
        """The run's current state."""

    def cancel(self, run_id: str, reason: str) -> None:
        """End the run if it is not final (a scheduled run is cancelled, a running one's process ended)."""


@dataclass(frozen=True)
class NodeOrder:
    """What one node run is given: its deployment's only parameter, plain JSON without a secret."""

    stage: str
    spec_uri: str
    attempt: str
    launch_id: str  # the attempt's launch id: torchrun's rendezvous id on every node
    round: int  # placement round within the attempt (a redirect starts the next)
    node_rank: int
    workers: tuple[str, ...]  # the worker of every node rank in this round
    endpoint_url: str | None = None  # a custom S3 endpoint, to read the spec before the config is known
    stage_modules: str = ""  # FORGE_STAGE_MODULES for a stage registered outside forge_core
    history: dict = field(default_factory=dict)  # earlier attempts and redirects, for the manifests
    # "" for a stage's node; else the flow runner (Stage.flow_runner) this run hosts for the whole flow run:
    # a resident (forge_core.run.resident), whose spec only names the run's config
    resident: str = ""

    @property
    def nnodes(self) -> int:
        return len(self.workers)

    def to_params(self) -> dict:
        return {**dataclasses.asdict(self), "workers": list(self.workers)}

    @classmethod
    def from_params(cls, params: dict) -> NodeOrder:
        unknown = sorted(set(params) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"node order: unknown keys {unknown}; it was written by another forgeflow version")
        return cls(**{**params, "workers": tuple(params["workers"])})


# ---- the store objects of one attempt ------------------------------------------------------------------------


class Board:
    """The objects under `<output_uri>/_placement/<attempt>/` (module docstring) and the attempt's record."""

    def __init__(self, store: ObjectStore, output_uri: str, attempt: str) -> None:
        self.store = store
        self.output_uri = output_uri
        self.attempt = attempt
        self.folder = store.join(output_uri, PLACEMENT_DIR)
        self.root = store.join(self.folder, attempt)
        self.owner = store.join(self.root, "owner.json")
        self.record = store.join(self.folder, f"{attempt}.json")

    def in_round(self, round_: int, name: str) -> str:
        return self.store.join(self.root, f"r{round_}", name)

    def node_beat(self, round_: int, rank: int) -> str:
        return self.in_round(round_, f"node-{rank}.json")

    def node_result(self, round_: int, rank: int) -> str:
        return self.in_round(round_, f"node-{rank}.result.json")

    def progress(self, round_: int, rank: int) -> str:
        return self.in_round(round_, f"progress-{rank}.json")

    def rendezvous(self, round_: int) -> str:
        return self.in_round(round_, "rendezvous.json")

    def stop(self, round_: int) -> str:
        return self.in_round(round_, "stop.json")

    def read(self, uri: str) -> dict | None:
        """The JSON object at `uri`, None when there is none (yet)."""
        try:
            return json.loads(self.store.get_bytes(uri))
        except FileNotFoundError:
            return None

    def write(self, uri: str, record: dict) -> None:
        self.store.put_bytes(uri, json.dumps(record, sort_keys=True).encode("utf-8"))

    def earlier_attempts(self) -> list[dict]:
        """The records of the stage's earlier attempts at this output (oldest first: attempt ids start with
        their time), each cut to what a manifest keeps."""
        records = []
        for uri in sorted(self.store.list_files(self.folder)):
            name = uri[len(self.folder) + 1 :]
            if "/" in name or not name.endswith(".json") or uri == self.record:
                continue
            record = self.read(uri) or {}
            records.append({k: record.get(k) for k in ("attempt", "outcome", "reason", "nodes", "redirects")})
        return records


class Heartbeat:
    """Rewrites `{"beat": n, **facts}` at `uri` every BEAT_S on a daemon thread while it is entered."""

    def __init__(self, board: Board, uri: str, facts: dict) -> None:
        self.board = board
        self.uri = uri
        self.facts = facts
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="forge-placement-beat", daemon=True)

    def _beat(self) -> None:
        beat = 0
        while True:
            beat += 1
            try:
                self.board.write(self.uri, {**self.facts, "beat": beat, "at": utc_now_iso()})
            except Exception as exc:  # noqa: BLE001 - a missed beat is what the watchers judge; keep beating
                log.warning("heartbeat %s not written: %s", self.uri, exc)
            if self._stop.wait(BEAT_S):
                return

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join(timeout=BEAT_S + 5.0)


class Liveness:
    """Whether a heartbeat another machine rewrites is still changing, judged on this machine's monotonic clock
    alone: lost once its content stayed the same for `timeout_s` (or, with `appear_within_s`, never appeared
    that long after this watch began)."""

    def __init__(self, board: Board, uri: str, timeout_s: float, appear_within_s: float | None = None) -> None:
        self.board = board
        self.uri = uri
        self.timeout_s = timeout_s
        self.appear_within_s = appear_within_s
        self.record: dict | None = None
        self._changed_at = time.monotonic()

    def poll(self) -> dict | None:
        record = self.board.read(self.uri)
        if record is not None and record != self.record:
            self.record = record
            self._changed_at = time.monotonic()
        return self.record

    @property
    def seen(self) -> bool:
        return self.record is not None

    def lost(self) -> str | None:
        """Why it counts as lost, None while it is alive (or not yet expected)."""
        quiet_s = time.monotonic() - self._changed_at
        if self.record is not None and quiet_s >= self.timeout_s:
            return f"no heartbeat for {quiet_s:.0f} s (launch.node_timeout_s={self.timeout_s:g})"
        if self.record is None and self.appear_within_s is not None and quiet_s >= self.appear_within_s:
            return f"no heartbeat within {quiet_s:.0f} s"
        return None


# ---- the node side: one node's part of an attempt, on a worker -----------------------------------------------


def node_address() -> str:
    """How this node's peers reach it: FORGE_NODE_ADDRESS, else the address its host name resolves to."""
    configured = os.environ.get(NODE_ADDRESS_ENV, "").strip()
    if configured:
        return configured
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return socket.getfqdn()


def node_start() -> str:
    """How this node run's process started: "warm" (forked by its worker's zygote) or "cold" (a new interpreter)."""
    return "warm" if os.environ.get(STARTED_WARM_ENV) else "cold"


def free_port() -> int:
    """A TCP port free on this host now, for torchrun's c10d store (node 0's agent binds it right after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class _StopWhy:
    outcome: Outcome
    reason: str


class NodePart:
    """One node's part of a placed attempt (run_node)."""

    def __init__(
        self, order: NodeOrder, spec: StageSpec, cfg: RunConfig, store: ObjectStore, worker: str, log_sink: LogSink
    ) -> None:
        self.order = order
        self.spec = spec
        self.cfg = cfg
        self.worker = worker
        self.log = log_sink
        self.board = Board(store, self.board_uri(store), order.attempt)
        self.address = node_address()
        timeout_s = cfg.launch.node_timeout_s
        self.owner = Liveness(self.board, self.board.owner, timeout_s, appear_within_s=timeout_s)
        self.peers = {
            rank: Liveness(self.board, self.board.node_beat(order.round, rank), timeout_s)
            for rank in range(order.nnodes)
            if rank != order.node_rank
        }
        self._progress_at = 0.0
        self._progress_pending: str | None = None
        # Whether this node ended because of another's failure or loss (or a stop): the cause is elsewhere.
        self.collateral = False

    def board_uri(self, store: ObjectStore) -> str:
        """Where the attempt's objects are (Board): under the stage's output."""
        return self.spec.output_uri

    def run(self) -> LaunchResult:
        order = self.order
        preflight(self.cfg, [self.spec.stage])  # this host can run its part (GPUs, vLLM build, wandb key)
        facts = {"node_rank": order.node_rank, "worker": self.worker, "host": self.address, "start": node_start()}
        with Heartbeat(self.board, self.board.node_beat(order.round, order.node_rank), facts):
            arranged = self._rendezvous()
            if isinstance(arranged, _StopWhy):
                self.collateral = True
                return LaunchResult(arranged.outcome, None, arranged.reason, launch_id=order.launch_id)
            rendezvous, hosts = arranged
            plan = StagePlan(self.spec.stage, "", self.spec.output_uri, self.spec, dict(self.spec.inputs))
            env = {PLACEMENT_ENV: json.dumps(self._placement_record(hosts), sort_keys=True)}
            handle = start(launch_spec_for(plan, self.cfg, extra_env=env, node=rendezvous), log=self._sink)
            self.log(
                f"node {order.node_rank}/{order.nnodes} of {self.spec.stage} attempt {order.attempt} on worker "
                f"{self.worker} ({self.address}): launch {handle.launch_id}"
                + (f", rendezvous {rendezvous.endpoint}" if rendezvous else "")
            )
            result = self._supervise(handle)
            self._publish_progress(force=True)
            return result

    # -- before the launch: the rendezvous

    def _rendezvous(self) -> tuple[NodeRendezvous | None, dict[int, str]] | _StopWhy:
        """(this node's rendezvous, {node rank: host}), or why to stop before launching."""
        order = self.order
        if order.nnodes == 1:
            return None, {0: self.address}
        uri = self.board.rendezvous(order.round)
        while True:
            why = self._reason_to_stop()
            if why is not None:
                return why
            if order.node_rank == 0:
                if all(peer.seen for peer in self.peers.values()):
                    hosts = {0: self.address, **{rank: peer.record["host"] for rank, peer in self.peers.items()}}
                    endpoint = f"{self.address}:{free_port()}"
                    self.board.write(uri, {"endpoint": endpoint, "hosts": {str(k): v for k, v in hosts.items()}})
                    break
            else:
                published = self.board.read(uri)
                if published is not None:
                    endpoint = published["endpoint"]
                    hosts = {int(k): v for k, v in published["hosts"].items()}
                    break
            time.sleep(POLL_S)
        node = NodeRendezvous(order.nnodes, order.node_rank, endpoint, order.launch_id, local_addr=self.address)
        return node, hosts

    def _placement_record(self, hosts: dict[int, str]) -> dict:
        """What every manifest this node's ranks commit records under `placement`."""
        order = self.order
        return {
            "placement": "pool",
            "pool": self.cfg.launch.for_stage(self.spec.stage).pool,
            "attempt": order.attempt,
            "launch_id": order.launch_id,
            "nodes": [
                {"node_rank": rank, "worker": worker, "host": hosts.get(rank, "")}
                for rank, worker in enumerate(order.workers)
            ],
            "committed_by": {
                "node_rank": order.node_rank, "worker": self.worker, "host": self.address, "start": node_start()
            },
            **order.history,
        }

    # -- while the launch runs

    def _supervise(self, handle) -> LaunchResult:
        while True:
            try:
                result = handle.wait(POLL_S)
                break
            except TimeoutError:
                pass
            self._publish_progress()
            why = self._reason_to_stop()
            if why is not None:
                handle.cancel(why.reason)
                stopped = handle.wait()
                self.collateral = True
                return dataclasses.replace(stopped, outcome=why.outcome, reason=why.reason, launch_id=self.order.launch_id)
        # A launch that failed by itself while a peer was already lost or failed is that failure's collateral
        # (a rank's collective broke because the peer's ranks died).
        self.collateral = not result.ok and self._reason_to_stop() is not None
        return dataclasses.replace(result, launch_id=self.order.launch_id)

    def _reason_to_stop(self) -> _StopWhy | None:
        """The attempt's stop object, the owner's or a peer's loss, or a peer's failure: why this node ends."""
        order = self.order
        stop = self.board.read(self.board.stop(order.round))
        if stop is not None:
            outcome = Outcome(stop.get("outcome", Outcome.CANCELLED.value))
            return _StopWhy(outcome, f"stopped by the attempt: {stop.get('reason', '')}")
        self.owner.poll()
        gone = self.owner.lost()
        if gone is not None:
            return _StopWhy(
                Outcome.CANCELLED,
                f"the flow run that placed this attempt is gone ({gone}): ending node {order.node_rank}",
            )
        for rank, peer in self.peers.items():
            result = self.board.read(self.board.node_result(order.round, rank))
            if result is not None and result.get("outcome") != Outcome.SUCCESS.value:
                why = f"node {rank} ({order.workers[rank]}) failed: {result.get('reason', '')}"
                return _StopWhy(Outcome.RETRYABLE, why)
            if result is None:
                peer.poll()
                lost = peer.lost()
                if lost is not None:
                    return _StopWhy(Outcome.RETRYABLE, f"node {rank} ({order.workers[rank]}) lost: {lost}")
        return None

    # -- output: the node run's log, and progress for the flow's progress artifact

    def _sink(self, line: str) -> None:
        # A progress line becomes the stage's progress artifact through the flow (as a local launch's does), not
        # a log line: an SFT's thousand of them would cost the Prefect API a log record each.
        if parse_progress_line(line) is not None:
            self._progress_pending = line
        else:
            self.log(line)

    def _publish_progress(self, force: bool = False) -> None:
        line = self._progress_pending
        if line is None or (not force and time.monotonic() - self._progress_at < PROGRESS_EVERY_S):
            return
        self._progress_pending = None
        self._progress_at = time.monotonic()
        try:
            self.board.write(self.board.progress(self.order.round, self.order.node_rank), {"line": line})
        except Exception as exc:  # noqa: BLE001 - progress is for the UI; the stage goes on without it
            log.warning("progress not published: %s", exc)


def run_node(
    order: NodeOrder, log_sink: LogSink, worker: str | None = None, node_type: type[NodePart] = NodePart
) -> LaunchResult:
    """One node's part of a placed attempt, on the worker that took the node run (flows/stage_deployment.py):
    rendezvous, this node's launch (torchrun for a distributed stage), watched against the flow, the stop object
    and the peers; its result written to the store for the runner. `worker`: this worker's name (Prefect's);
    `node_type`: what the node does (a resident's is forge_core.run.resident.ResidentNode)."""
    if order.stage_modules:
        os.environ.setdefault(STAGE_MODULES_ENV, order.stage_modules)
    started = time.monotonic()
    storage_cfg = StorageConfig(endpoint_url=order.endpoint_url) if order.endpoint_url else None
    spec = read_spec(order.spec_uri, storage_cfg)
    cfg = spec.run_config()
    store = ObjectStore.from_config(cfg.storage)
    node = node_type(order, spec, cfg, store, worker or order.workers[order.node_rank], log_sink)
    try:
        result = node.run()
    except Exception as exc:  # noqa: BLE001 - classified like a worker's error, and reported through the store
        where = f"{spec.stage} node {order.node_rank} on {node.worker}"
        result = exception_result(where, exc, time.monotonic() - started, launch_id=order.launch_id)
    record = {
        **result.to_dict(),
        "node_rank": order.node_rank,
        "worker": node.worker,
        "host": node.address,
        "start": node_start(),
        "collateral": node.collateral,
    }
    node.board.write(node.board.node_result(order.round, order.node_rank), record)
    return result


# ---- the flow side: the runner --------------------------------------------------------------------------------


class PoolRunner(Runner):
    """Runs a stage's attempts on its pool's workers (module docstring)."""

    def __init__(self, cfg: RunConfig, stage: str, dispatcher: NodeDispatcher) -> None:
        super().__init__(cfg, stage)
        self.dispatcher = dispatcher
        self.pool = self.resources.pool
        self.where = f"pool {self.pool!r}"

    @property
    def nnodes(self) -> int:
        return self.resources.nnodes if stage_named(self.stage).distributed else 1

    def start(self, plan: StagePlan, log_sink: LogSink) -> Attempt:
        return PlacedAttempt(self, plan, log_sink)


@dataclass
class _NodeRun:
    rank: int
    worker: str
    run_id: str
    beat: Liveness
    created: float = field(default_factory=time.monotonic)
    running_since: float | None = None  # when Prefect first said its worker runs it (this machine's clock)
    result: LaunchResult | None = None
    record: dict = field(default_factory=dict)
    lost: str | None = None
    progress: str | None = None
    last_step_done: bool = False  # its newest progress line says the last step is done: its launch is ending

    @property
    def ended(self) -> bool:
        return self.result is not None or self.lost is not None

    def label(self) -> str:
        return f"node {self.rank} ({self.worker})"


class PlacedAttempt:
    """One attempt on the pool: placement rounds, then the nodes watched until each reported or was lost."""

    def __init__(
        self, runner: PoolRunner, plan: StagePlan, log_sink: LogSink, board: Board | None = None, resident: str = ""
    ) -> None:
        self.runner = runner
        self.plan = plan
        self.log = log_sink
        self.cfg = runner.cfg
        self.resident = resident  # NodeOrder.resident: "" for a stage's attempt
        self.launch_id = f"placed-{uuid.uuid4().hex[:12]}"
        self.board = board or Board(ObjectStore.from_config(self.cfg.storage), plan.output_uri, plan.spec.attempt)
        self.earlier = self.board.earlier_attempts()
        self.round = -1
        self.nodes: list[_NodeRun] = []
        self.redirects: list[dict] = []
        self.avoid: dict[str, str] = {}
        self.placing_since = time.monotonic()
        self.stop_written: dict | None = None
        self.stop_deadline: float | None = None
        self.result: LaunchResult | None = None
        self._lock = threading.RLock()
        self._next_step = 0.0
        self._last_wait_note = ""
        self._owner = Heartbeat(self.board, self.board.owner, {"launch_id": self.launch_id, "run_id": self.cfg.launch.run_id})
        self._owner.__enter__()
        self._remove_stop = add_remote_stop(self._stop_from_elsewhere)

    # -- the Attempt interface

    def wait(self, timeout: float) -> LaunchResult | None:
        pause = self._next_step - time.monotonic()
        if pause > 0 and not self._all_reported():
            time.sleep(min(timeout, pause, RESULT_POLL_S))
            return None
        self._next_step = time.monotonic() + POLL_S
        with self._lock:
            if self.result is not None:
                return self.result
            if not self.nodes:
                self._place()
                return None
            self._watch()
            return self._finish_if_ended()

    def stop(
        self, reason: str, wait: bool = True, outcome: Outcome = Outcome.CANCELLED, bound_s: float | None = None
    ) -> LaunchResult | None:
        """Write the stop object (`outcome`: what the nodes end with; a resident's normal end is a SUCCESS);
        with `wait`, give the nodes `bound_s` (default: their kill grace + STOP_MARGIN_S) to end their launches
        and report; then cancel the node runs still unfinished."""
        with self._lock:
            if self.result is not None:
                return self.result
            self._write_stop(outcome, reason)
            bound = self.runner.resources.kill_grace_s + STOP_MARGIN_S if bound_s is None else bound_s
            self.stop_deadline = time.monotonic() + bound
            while wait and self.nodes and not all(node.ended for node in self.nodes):
                self._watch()
                if not all(node.ended for node in self.nodes):
                    time.sleep(POLL_S)
            return self._finish(self._combined() if self.nodes else None, f"stopped: {reason}")

    def _stop_from_elsewhere(self, reason: str) -> None:
        """The flow process is being cancelled or terminated (forge_core.launch.terminate_all_live): it has
        seconds left, so the node runs get the stop object and Prefect's cancel at once, without a wait."""
        self.stop(reason, wait=False)

    # -- placement

    def _place(self) -> None:
        needed = self.runner.nnodes
        pool = self.runner.pool
        slots = self.runner.dispatcher.workers(pool)
        # Workers that did not start a node run in time come last: taken again only when no other live,
        # free worker is left (a slow worker that is live and free again is better than no placement).
        free = sorted((s.name in self.avoid, s.name) for s in slots if s.live and not s.busy)
        if len(free) >= needed:
            self._start_round([name for _, name in free[:needed]])
            return
        waited = time.monotonic() - self.placing_since
        described = self._describe_pool(slots)
        if waited >= self.cfg.launch.pool_wait_s:
            raise PlacementUnavailable(
                f"pool {pool!r}: {self.runner.stage} needs {needed} live, free worker(s) (launch.{self.runner.stage}"
                f".nnodes={self.runner.resources.nnodes}); after waiting {waited:.0f} s (launch.pool_wait_s="
                f"{self.cfg.launch.pool_wait_s:g}) it has {len(free)}: {described}. Start a worker per node with "
                f"its own queue (`forgeflow worker start {pool} --name <node>`), let busy "
                f"ones finish, or lower launch.{self.runner.stage}.nnodes"
            )
        note = f"{self.runner.stage}: waiting for {needed} live, free worker(s) of pool {pool!r}: {described}"
        if note != self._last_wait_note:
            self.log(note)
            self._last_wait_note = note

    def _describe_pool(self, slots: list[WorkerSlot]) -> str:
        if not slots:
            return "no worker with its own work queue"
        parts = []
        for slot in sorted(slots, key=lambda s: s.name):
            state = "live" if slot.live else "not live"
            state += ", busy" if slot.busy else (", free" if slot.live else "")
            if slot.name in self.avoid:
                state += f", avoided ({self.avoid[slot.name]})"
            parts.append(f"{slot.name} ({state}{'; ' + slot.note if slot.note else ''})")
        return ", ".join(parts)

    def _start_round(self, workers: list[str]) -> None:
        self.round += 1
        history = {
            "attempt_number": len(self.earlier) + 1,
            "earlier_attempts": self.earlier,
            "redirects": list(self.redirects),
        }
        record = stage_named(self.plan.stage)
        env = {name: os.environ[name] for name in FORWARDED_ENV if os.environ.get(name)}
        timeout_s = self.cfg.launch.node_timeout_s
        self.nodes = []
        for rank, worker in enumerate(workers):
            order = NodeOrder(
                stage=self.plan.stage,
                spec_uri=self.plan.spec_uri,
                attempt=self.board.attempt,
                launch_id=self.launch_id,
                round=self.round,
                node_rank=rank,
                workers=tuple(workers),
                endpoint_url=self.cfg.storage.endpoint_url,
                stage_modules="" if is_builtin(record) else record.module,
                history=history,
                resident=self.resident,
            )
            run_id = self.runner.dispatcher.start_node(self.runner.pool, worker, order, env)
            beat = Liveness(self.board, self.board.node_beat(self.round, rank), timeout_s)
            self.nodes.append(_NodeRun(rank, worker, run_id, beat))
        placed = ", ".join(f"node {n.rank} -> {n.worker} (run {n.run_id})" for n in self.nodes)
        self.log(f"{self.plan.stage}: attempt {self.board.attempt} round {self.round} on pool {self.runner.pool!r}: {placed}")

    def _redirect(self, late: list[_NodeRun]) -> None:
        """Nodes whose worker did not start them in time: abandon the round, avoid those workers, place again."""
        start_s = self.cfg.launch.node_start_s
        for node in late:
            why = f"did not start node run {node.run_id} within launch.node_start_s={start_s:g}"
            self.avoid[node.worker] = why
            self.redirects.append({"round": self.round, "node_rank": node.rank, "worker": node.worker, "why": why})
        self.log(
            f"{self.plan.stage}: round {self.round} abandoned: {', '.join(n.worker for n in late)} did not start "
            "its node run in time; placing the nodes on other live, free workers"
        )
        self._write_stop(Outcome.CANCELLED, "the round was abandoned: a worker did not start its node run")
        for node in self.nodes:
            self._cancel(node, "the round was abandoned")
        self.nodes = []
        self.stop_written = None

    # -- watching the nodes

    def _watch(self) -> None:
        for node in self.nodes:
            if node.ended:
                continue
            self._read_result(node)
            if node.result is None:
                self._check_alive(node)
            self._relay_progress(node)
        failed = [n for n in self.nodes if n.lost or (n.result is not None and not n.result.ok)]
        if failed and self.stop_written is None:
            first = failed[0]
            why = f"{first.label()} {'was lost: ' + first.lost if first.lost else 'failed: ' + first.result.reason}"
            self._write_stop(Outcome.RETRYABLE if first.lost else first.result.outcome, why)
            self.stop_deadline = time.monotonic() + self.runner.resources.kill_grace_s + STOP_MARGIN_S
        if self.stop_deadline is not None and time.monotonic() > self.stop_deadline:
            for node in self.nodes:
                if not node.ended:
                    node.lost = "did not report within the kill grace after the attempt was stopped"
                    self._cancel(node, node.lost)
            return
        late = [n for n in self.nodes if not n.ended and not n.beat.seen and self._late(n)]
        if late and self.stop_written is None:
            self._redirect(late)

    def _all_reported(self) -> bool:
        """Every node of the round has written its result. Read between the full looks of `_watch` once every
        node's progress says its last step is done, so such a stage ends RESULT_POLL_S after its last node
        reported, not up to POLL_S; not all along (reads every RESULT_POLL_S for the whole stage cost store
        requests, on a small machine the stage's own cores, for nothing until its end)."""
        with self._lock:
            if not self.nodes or not all(node.ended or node.last_step_done for node in self.nodes):
                return False
            for node in self.nodes:
                if not node.ended:
                    self._read_result(node)
            return all(node.ended for node in self.nodes)

    def _late(self, node: _NodeRun) -> bool:
        """Not taken by its worker (still Scheduled or Late) launch.node_start_s after it was created."""
        return node.running_since is None and time.monotonic() - node.created > self.cfg.launch.node_start_s

    def _read_result(self, node: _NodeRun) -> None:
        record = self.board.read(self.board.node_result(self.round, node.rank))
        if record is not None:
            node.record = record
            node.result = LaunchResult.from_dict(record)

    def _check_alive(self, node: _NodeRun) -> None:
        node.beat.poll()
        state = self.runner.dispatcher.state(node.run_id)
        if state.final:
            self._read_result(node)  # it may have written its result just before ending
            if node.result is None:
                detail = f": {state.message}" if state.message else ""
                node.lost = f"its run {node.run_id} ended {state.name} without a result{detail}"
            return
        if node.running_since is None and state.started:
            node.running_since = time.monotonic()
        if node.beat.seen:
            node.lost = node.beat.lost()
        elif node.running_since is not None:
            # Its worker took it but it never beat: the machine died while the run started (Prefect would show
            # it Running forever).
            quiet_s = time.monotonic() - node.running_since
            bound = self.cfg.launch.node_start_s + self.cfg.launch.node_timeout_s
            if quiet_s > bound:
                node.lost = (
                    f"its run {node.run_id} is {state.name} but wrote no heartbeat in {quiet_s:.0f} s "
                    f"(launch.node_start_s + node_timeout_s = {bound:g})"
                )

    def _relay_progress(self, node: _NodeRun) -> None:
        if not node.beat.seen and node.result is None:
            return
        record = self.board.read(self.board.progress(self.round, node.rank))
        line = record.get("line") if record else None
        if line and line != node.progress:
            node.progress = line
            progress = parse_progress_line(line)
            node.last_step_done = progress is not None and progress.fraction >= 1.0
            self.log(line)

    # -- the end

    def _finish_if_ended(self) -> LaunchResult | None:
        if not self.nodes or not all(node.ended for node in self.nodes):
            return None
        for node in self.nodes:
            self._relay_progress(node)
        return self._finish(self._combined())

    def _combined(self) -> LaunchResult:
        """The attempt's one result from its nodes' (module docstring): a lost node makes it RETRYABLE; else
        the failures that were not caused by another node's decide (FATAL over RETRYABLE over CANCELLED)."""
        lost = [n for n in self.nodes if n.lost]
        failed = [n for n in self.nodes if n.result is not None and not n.result.ok]
        causes = [n for n in failed if not n.record.get("collateral")] or failed
        rank_errors = {r: e for n in self.nodes if n.result for r, e in n.result.rank_errors.items()}
        where = f"{self.plan.stage} on pool {self.runner.pool!r}"
        if lost:
            outcome = Outcome.RETRYABLE
            reason = "; ".join(f"{n.label()} was lost: {n.lost}" for n in lost)
            reason = f"{where}: {reason} (the attempt was ended on every node; a retry resumes from the newest checkpoint)"
        elif causes:
            ranked = {Outcome.FATAL: 0, Outcome.RETRYABLE: 1, Outcome.CANCELLED: 2}
            outcome = min((n.result.outcome for n in causes), key=ranked.__getitem__)
            reason = f"{where}: " + "; ".join(f"{n.label()}: {n.result.reason}" for n in causes if n.result.outcome is outcome)
        else:
            outcome = Outcome.SUCCESS
            reason = f"{where}: {len(self.nodes)} node(s) succeeded"
        tail = [f"[{n.label()}] {line}" for n in (causes or self.nodes) if n.result for line in n.result.tail]
        stall = next((n.result.stall for n in causes if n.result.stall), "")
        returncode = 0 if outcome is Outcome.SUCCESS else next((n.result.returncode for n in causes), None)
        return LaunchResult(
            outcome=outcome,
            returncode=returncode,
            reason=reason,
            tail=tuple(tail[-TAIL_LINES:]),
            rank_errors=rank_errors,
            launch_id=self.launch_id,
            stall=stall,
        )

    def _finish(self, result: LaunchResult | None, why: str = "") -> LaunchResult:
        """Record the attempt, cancel what of it is still unfinished, stop the owner's heartbeat."""
        if result is None:  # stopped before any node ran
            result = LaunchResult(Outcome.CANCELLED, None, why, launch_id=self.launch_id)
        for node in self.nodes:
            if node.result is None:
                self._cancel(node, why or "the attempt ended")
        record = {
            "attempt": self.board.attempt,
            "launch_id": self.launch_id,
            "stage": self.plan.stage,
            "pool": self.runner.pool,
            "rounds": self.round + 1,
            "nodes": [
                {"node_rank": n.rank, "worker": n.record.get("worker", n.worker), "host": n.record.get("host", ""),
                 "start": n.record.get("start", ""), "run_id": n.run_id,
                 "outcome": n.result.outcome.value if n.result else "lost"}
                for n in self.nodes
            ],
            "redirects": self.redirects,
            "outcome": result.outcome.value,
            "reason": result.reason[:500],
            "ended_at": utc_now_iso(),
        }
        try:
            self.board.write(self.board.record, record)
        finally:
            self._owner.__exit__(None, None, None)
            self._remove_stop()
        self.result = result
        return result

    def _write_stop(self, outcome: Outcome, reason: str) -> None:
        if self.stop_written is not None or self.round < 0:
            return
        self.stop_written = {"outcome": outcome.value, "reason": reason, "at": utc_now_iso()}
        self.board.write(self.board.stop(self.round), self.stop_written)

    def _cancel(self, node: _NodeRun, reason: str) -> None:
        try:
            self.runner.dispatcher.cancel(node.run_id, reason)
        except Exception as exc:  # noqa: BLE001 - the node also ends on the stop object or its owner's loss
            log.warning("could not cancel node run %s: %s", node.run_id, exc)

