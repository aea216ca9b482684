"""The flow lifetimes' runners, here or on a pool: the run's long-lived engines and trainer job on the flow's
machine (launch.placement=local), or on a worker of their stage's pool, reached over the network (pool).

    runner = flow_lifetime_runner(cfg, "rollout", resources, dispatcher)   # usually: forge_core.run.runners
    result = runner.run(plan, log, cancel)                                 # the runner interface, as always

Local placement: the flow process's FlowResources hold the engine services and the trainer job
(TaskProcessRunner, TrainerJobRunner). Pool placement: the first stage of a kind (`Stage.flow_runner`:
"task_process" for rollout and evaluate, "trainer_job" for GRPO) starts a **resident** on its pool: one node
run of the pool's stage deployment (flows/stage_deployment.py), placed, watched and stopped like a one-node
attempt (forge_core.run.placement: live and free workers, launch.pool_wait_s, redirects, the flow's heartbeat as
its owner, the stop object), whose objects are under `<storage.root>/_residents/<flow run id>/<name>-<pool>/
_placement/`. On its worker the resident does what the flow process does with local placement: it holds a
FlowResources of its own and runs each order through the same local runner, so the engines and the trainer job
run on the pool's worker and are started, reused, restarted and stopped by exactly the local code. It holds its
worker for the flow run (the worker's queue holds its run, so placement counts the worker busy and places
nothing else there; the pool's GPU limit counts each order's GPUs while it runs, as with local flow lifetimes)
and ends with the flow: a SUCCESS stop at the flow's normal end, a cancel on
failure, and by itself within launch.node_timeout_s once the flow's heartbeat stops.

The channel: the resident listens on a TCP port of its node's address (FORGE_NODE_ADDRESS, else its host name's
address; an ephemeral port, so the pipeline's worker must reach the pool's nodes on any port) and publishes
`{host, port, worker}` as `r<round>/service.json` on its board. Every connection must pass multiprocessing's
HMAC challenge, both ways, with the run's secret: HMAC-SHA256 of the cluster key (FORGE_CLUSTER_KEY, the same
random key in the environment of every worker, the pipeline's included) with the flow run id. The secret is
derived where it is used and is never a parameter, a store object, a log line, a manifest or an artifact; a
client without it (another run, no key) is refused before anything it sent is read. The channel is
authenticated, not encrypted: keep the pools on a private network. Messages (pickles, read only after the
challenge): the flow sends `("run", spec_uri)` and, while it runs, possibly `("stop", reason)`; the resident
answers `("log", line)`* then `("result", LaunchResult dict)`. A dropped connection stops the order; a resident
gone during an order (its run crashed, its heartbeat stopped, the connection broke) makes the attempt
RETRYABLE, and the retry starts a new resident on whichever worker is live and free.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import hmac
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import (
    AuthenticationError,
    Client,
    Connection,
    Listener,
    answer_challenge,
    deliver_challenge,
)

from forge_core.config import RunConfig
from forge_core.engine.preflight import preflight
from forge_core.launch import LaunchResult, Outcome, RetryableStageError
from forge_core.launch.classify import exception_result
from forge_core.run.in_process import TaskProcessRunner
from forge_core.run.placement import (
    POLL_S,
    STOP_MARGIN_S,
    Board,
    Heartbeat,
    NodeDispatcher,
    NodeOrder,
    NodePart,
    PlacedAttempt,
    PoolRunner,
    run_node,
)
from forge_core.run.plan import StagePlan
from forge_core.run.resources import FlowResources
from forge_core.run.runner import Attempt, FlowProcessRunner, LogRelay, LogSink, Runner
from forge_core.run.spec import read_spec
from forge_core.run.trainer_job import TrainerJobRunner
from forge_core.stages import stage_named
from forge_core.storage import ObjectStore
from forge_core.storage.manifest import PLACEMENT_ENV, new_attempt_id

log = logging.getLogger(__name__)

CLUSTER_KEY_ENV = "FORGE_CLUSTER_KEY"
MIN_CLUSTER_KEY_CHARS = 32
RESIDENTS_DIR = "_residents"
SERVICE_OBJECT = "service.json"
# Names for people (run names, logs, store folders) of what a resident hosts, by Stage.flow_runner.
RESIDENT_NAMES = {"task_process": "engines", "trainer_job": "trainer"}
# A resident's normal end: its trainer job finishes its order and its engines shut down before it reports.
NORMAL_STOP_S = 90.0
CONNECT_TIMEOUT_S = 30.0  # the TCP connect and the challenge; a resident that does not answer in this is gone
REPLY_POLL_S = 0.2
_SECRET_CONTEXT = b"forgeflow-resident\0"

FLOW_RUNNERS: dict[str, type[FlowProcessRunner]] = {r.serves: r for r in (TaskProcessRunner, TrainerJobRunner)}


class ResidentGone(RetryableStageError):
    """The resident serving an order ended or could not be reached: the stage's retry starts a new one."""


# ---- the secret ----------------------------------------------------------------------------------------------


def cluster_key_problems(cfg: RunConfig) -> list[str]:
    """With launch.placement=pool and a flow lifetime, this environment needs the cluster key (a preflight check,
    run by the flow's start and by every resident)."""
    if cfg.launch.placement != "pool":
        return []
    settings = {"rollout.engine_lifetime": cfg.rollout.engine_lifetime, "grpo.trainer_lifetime": cfg.grpo.trainer_lifetime}
    flow = [name for name, value in settings.items() if value == "flow"]
    if not flow:
        return []
    key = os.environ.get(CLUSTER_KEY_ENV, "")
    if len(key) >= MIN_CLUSTER_KEY_CHARS:
        return []
    found = "is not set" if not key else f"has {len(key)} characters (at least {MIN_CLUSTER_KEY_CHARS} needed)"
    lifetimes = " and ".join(f"{k}=flow" for k in flow)
    problem = (
        f"{lifetimes} with launch.placement=pool: the flow reaches its long-lived processes on the pools' workers "
        f"with a per-run secret derived from {CLUSTER_KEY_ENV}, which {found} here; set the same random key in "
        "the environment of every worker, the pipeline's included (e.g. `export FORGE_CLUSTER_KEY=$(python -c "
        "'import secrets; print(secrets.token_hex(32))')` before `forgeflow worker start` / `prefect worker "
        "start`), or set those lifetimes to stage"
    )
    return [problem]


def run_secret(cfg: RunConfig) -> bytes:
    """The run's secret: HMAC-SHA256(cluster key, flow run id). ValueError naming the fix without a key."""
    problems = cluster_key_problems(cfg)
    if problems:
        raise ValueError(problems[0])
    key = os.environ[CLUSTER_KEY_ENV].encode()
    return hmac.new(key, _SECRET_CONTEXT + cfg.launch.run_id.encode(), hashlib.sha256).digest()


def resident_uri(store: ObjectStore, cfg: RunConfig, kind: str, pool: str) -> str:
    """`<storage.root>/_residents/<flow run id>/<name>-<pool>`: where a resident's board lives."""
    return store.join(store.root, RESIDENTS_DIR, cfg.launch.run_id, f"{RESIDENT_NAMES[kind]}-{pool}")


def connect(address: tuple[str, int], secret: bytes, timeout_s: float = CONNECT_TIMEOUT_S) -> Connection:
    """An authenticated connection to a resident. AuthenticationError when it refuses `secret`; ResidentGone
    when nothing answers in `timeout_s` (Client has no timeout: the attempt runs on an abandoned daemon thread)."""
    outcome: dict = {}

    def attempt() -> None:
        try:
            outcome["conn"] = Client(address, family="AF_INET", authkey=secret)
        except (OSError, EOFError, AuthenticationError) as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=attempt, name="forge-resident-connect", daemon=True)
    thread.start()
    thread.join(timeout_s)
    error = outcome.get("error")
    if isinstance(error, AuthenticationError):
        raise error
    if "conn" not in outcome:
        how = f"could not be reached ({error!r})" if error else f"did not answer within {timeout_s:g} s"
        raise ResidentGone(f"the resident at {address[0]}:{address[1]} {how}")
    return outcome["conn"]


# ---- the flow side -------------------------------------------------------------------------------------------


def flow_lifetime_runner(
    cfg: RunConfig, stage: str, resources: FlowResources, dispatcher: NodeDispatcher | None
) -> Runner:
    """The runner of a stage whose lifetime setting is "flow": the local flow runner, or with launch.placement=
    pool an order to the run's resident on the stage's pool (module docstring)."""
    kind = stage_named(stage).flow_runner
    assert kind in FLOW_RUNNERS, f"{stage}: no flow runner {kind!r}"
    if cfg.launch.placement != "pool":
        return FLOW_RUNNERS[kind](cfg, stage, resources)
    assert dispatcher is not None, "runner_for checks the dispatcher first"
    return ResidentRunner(cfg, stage, resources, dispatcher)


class Resident:
    """The flow's handle on one resident: its one-node placed attempt, pumped on a daemon thread until it ends."""

    def __init__(self, cfg: RunConfig, kind: str, plan: StagePlan, dispatcher: NodeDispatcher) -> None:
        runner = PoolRunner(cfg, plan.stage, dispatcher)
        store = ObjectStore.from_config(cfg.storage)
        self.pool = runner.pool
        self.name = f"{RESIDENT_NAMES[kind]} on pool {self.pool!r}"
        self.relay = LogRelay(log.info)  # its placement lines: to the stage waiting on it, else this module's log
        self.board = Board(store, resident_uri(store, cfg, kind, self.pool), new_attempt_id())
        self.attempt = PlacedAttempt(runner, plan, self.relay, board=self.board, resident=kind)
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._pump, name=f"forge-resident-{kind}", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        try:
            while self.attempt.wait(POLL_S) is None:
                pass
        except Exception as exc:  # noqa: BLE001 - the next order raises it (PlacementUnavailable, a user error)
            self.error = exc
            self.attempt.stop(f"the resident's placement failed: {exc}", wait=False)

    def ended(self) -> str | None:
        """Why this resident can serve no more orders, None while it can."""
        if self.error is not None:
            return f"{type(self.error).__name__}: {self.error}"
        result = self.attempt.result
        return None if result is None else f"{result.outcome.value}: {result.reason}"

    def address(self) -> tuple[str, int] | None:
        """(host, port) once the resident published them; None while it is being placed or starting. Raises
        the placement's error, or ResidentGone once it ended."""
        if self.error is not None:
            raise self.error
        ended = self.ended()
        if ended is not None:
            raise ResidentGone(f"the run's {self.name} ended before it served: {ended}")
        round_ = self.attempt.round
        published = self.board.read(self.board.in_round(round_, SERVICE_OBJECT)) if round_ >= 0 else None
        return (published["host"], int(published["port"])) if published else None

    def abandon(self, why: str) -> None:
        """Give it up after its channel failed (its node may be gone before its watcher noticed): it is stopped,
        and the stage's retry starts a new resident."""
        if self.error is None:
            self.error = ResidentGone(f"the run's {self.name} was given up: {why}")
        self.attempt.stop(f"given up: {why}", wait=False)

    def close(self, failing: bool) -> None:
        """End it with the flow: a SUCCESS stop at a normal end, a cancel on failure (waits for its report)."""
        if failing:
            self.attempt.stop("the flow run is failing", outcome=Outcome.CANCELLED)
        else:
            self.attempt.stop("the flow run ended", outcome=Outcome.SUCCESS, bound_s=NORMAL_STOP_S)
        self._thread.join(POLL_S * 5)


def ensure_resident(resources: FlowResources, kind: str, plan: StagePlan, dispatcher: NodeDispatcher) -> Resident:
    """The run's resident of `kind` on `plan`'s stage's pool, started now when there is none that can serve."""
    pool = resources.cfg.launch.for_stage(plan.stage).pool
    with resources.lock:
        resident = resources.residents.get((kind, pool))
        if resident is not None and resident.ended() is None:
            return resident
        if resident is not None:
            resident.close(failing=True)
        resident = resources.residents[(kind, pool)] = Resident(resources.cfg, kind, plan, dispatcher)
        return resident


class ResidentRunner(Runner):
    """A flow-lifetime stage as an order to the run's resident on its pool (module docstring)."""

    def __init__(self, cfg: RunConfig, stage: str, resources: FlowResources, dispatcher: NodeDispatcher) -> None:
        super().__init__(cfg, stage)
        self.flow_resources = resources
        self.dispatcher = dispatcher
        self.kind = stage_named(stage).flow_runner
        self.where = f"the run's {RESIDENT_NAMES[self.kind]} on pool {self.resources.pool!r}"

    def start(self, plan: StagePlan, log_sink: LogSink) -> Attempt:
        secret = run_secret(self.cfg)
        resident = ensure_resident(self.flow_resources, self.kind, plan, self.dispatcher)
        return _RemoteOrder(resident, plan, log_sink, secret, self.resources.kill_grace_s + STOP_MARGIN_S)


class _RemoteOrder:
    """One stage's order to a resident: sent once it has published its address, then its log and result read."""

    def __init__(self, resident: Resident, plan: StagePlan, log_sink: LogSink, secret: bytes, stop_bound_s: float):
        self.resident = resident
        self.plan = plan
        self.log = log_sink
        self.launch_id = resident.attempt.launch_id
        self._secret = secret
        self._stop_bound_s = stop_bound_s
        self._conn: Connection | None = None
        resident.relay.target = log_sink

    def wait(self, timeout: float) -> LaunchResult | None:
        until = time.monotonic() + timeout
        if self._conn is None and not self._send():
            time.sleep(max(0.0, min(timeout, POLL_S)))
            return None
        return self._read_until(until)

    def _send(self) -> bool:
        """Connect and send the order once the resident is there; False while it is not yet."""
        address = self.resident.address()
        if address is None:
            return False
        try:
            self._conn = connect(address, self._secret)
        except ResidentGone as exc:
            self.resident.abandon(str(exc))
            raise
        except AuthenticationError:
            raise ValueError(
                f"the run's {self.resident.name} at {address[0]}:{address[1]} refused this flow's secret: "
                f"{CLUSTER_KEY_ENV} differs between the pipeline's worker and the pool's worker; set the same key "
                "on every worker"
            ) from None
        self._conn.send(("run", self.plan.spec_uri))
        self.log(f"{self.plan.stage}: order sent to the run's {self.resident.name} at {address[0]}:{address[1]}")
        return True

    def _read_until(self, until: float) -> LaunchResult | None:
        assert self._conn is not None
        while True:
            try:
                if self._conn.poll(max(0.0, min(REPLY_POLL_S, until - time.monotonic()))):
                    kind, payload = self._conn.recv()
                    if kind == "result":
                        return self._done(LaunchResult.from_dict(payload))
                    self.log(payload)
                    continue
            except (EOFError, OSError) as exc:
                return self._gone(f"its connection broke ({exc!r})")
            ended = self.resident.ended()
            if ended is not None:
                return self._gone(ended)
            if time.monotonic() >= until:
                return None

    def stop(self, reason: str) -> LaunchResult | None:
        if self._conn is None:
            return self._done(LaunchResult(Outcome.CANCELLED, None, f"stopped before the order was sent: {reason}"))
        with contextlib.suppress(OSError):
            self._conn.send(("stop", reason))
        result = self._read_until(time.monotonic() + self._stop_bound_s)
        if result is None:  # the resident did not report in time: dropping the connection stops the order there
            self._done(None)
        return result

    def _gone(self, why: str) -> LaunchResult:
        self.resident.abandon(why)
        reason = f"{self.plan.stage}: the run's {self.resident.name} went away during the order: {why}"
        return self._done(LaunchResult(Outcome.RETRYABLE, None, reason, launch_id=self.launch_id))

    def _done(self, result: LaunchResult | None) -> LaunchResult | None:
        if self._conn is not None:
            with contextlib.suppress(OSError):
                self._conn.close()
        self.resident.relay.target = None
        return dataclasses.replace(result, launch_id=self.launch_id) if result is not None else None


# ---- the worker side -------------------------------------------------------------------------------------------


class ResidentNode(NodePart):
    """A resident's node run (module docstring): serves orders until the stop object or its owner's loss."""

    def board_uri(self, store: ObjectStore) -> str:
        return resident_uri(store, self.cfg, self.order.resident, self.cfg.launch.for_stage(self.spec.stage).pool)

    def run(self) -> LaunchResult:
        order = self.order
        secret = run_secret(self.cfg)  # ValueError (fatal) when this worker has no cluster key
        preflight(self.cfg, [self.spec.stage], checks=())  # this host can run what it hosts (GPUs, vLLM build)
        local = dataclasses.replace(self.cfg, launch=dataclasses.replace(self.cfg.launch, placement="local"))
        record = {**self._placement_record({0: self.address}), "resident": RESIDENT_NAMES[order.resident]}
        # This process runs one resident: what its stages commit (here or in the trainer job) records it.
        os.environ[PLACEMENT_ENV] = json.dumps(record, sort_keys=True)
        resources = FlowResources.of(local, log_line=self.log)
        facts = {"node_rank": 0, "worker": self.worker, "host": self.address, "start": record["committed_by"]["start"]}
        why = None
        with Heartbeat(self.board, self.board.node_beat(order.round, 0), facts):
            server = OrderServer(self.address, secret, local, resources, order.resident, self.log)
            try:
                service = {"host": self.address, "port": server.port, "worker": self.worker, "pid": os.getpid()}
                self.board.write(self.board.in_round(order.round, SERVICE_OBJECT), service)
                self.log(f"resident {RESIDENT_NAMES[order.resident]} of flow run {self.cfg.launch.run_id} on worker "
                         f"{self.worker}: serving on {self.address}:{server.port}")
                while (why := self._reason_to_stop()) is None:
                    time.sleep(POLL_S)
            finally:
                server.close()
                resources.close(failing=why is None or why.outcome is not Outcome.SUCCESS)
        self.collateral = why.outcome is not Outcome.SUCCESS
        return LaunchResult(why.outcome, 0 if why.outcome is Outcome.SUCCESS else None, why.reason, launch_id=order.launch_id)


def run_resident(order: NodeOrder, log_sink: LogSink, worker: str | None = None) -> LaunchResult:
    """A resident's node run on the worker that took it (flows/stage_deployment.py)."""
    return run_node(order, log_sink, worker, node_type=ResidentNode)


class OrderServer:
    """The resident's listener: one thread per connection, each authenticated before anything is read."""

    def __init__(
        self, host: str, secret: bytes, cfg: RunConfig, resources: FlowResources, kind: str, log_line: Callable[[str], None]
    ) -> None:
        self._secret = secret
        self.cfg = cfg
        self.resources = resources
        self.kind = kind
        self.log = log_line
        self._listener = Listener((host, 0), family="AF_INET")  # no authkey here: each connection's thread checks it
        self.port = self._listener.address[1]
        self._closed = threading.Event()
        threading.Thread(target=self._accept, name="forge-resident-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn = self._listener.accept()
            except OSError:
                return  # closed
            peer = self._listener.last_accepted
            threading.Thread(target=self._serve, args=(conn, peer), name="forge-resident-conn", daemon=True).start()

    def _serve(self, conn: Connection, peer) -> None:
        with contextlib.closing(conn):
            try:
                # A client that stalls here holds only this thread.
                deliver_challenge(conn, self._secret)
                answer_challenge(conn, self._secret)
            except (AuthenticationError, EOFError, OSError) as exc:
                self.log(f"refused a connection from {peer} without this run's secret ({type(exc).__name__})")
                return
            try:
                while True:
                    op, payload = conn.recv()
                    if op == "run":
                        self._run_order(conn, payload)
            except (EOFError, OSError):
                return

    def _run_order(self, conn: Connection, spec_uri: str) -> None:
        send_lock = threading.Lock()

        def send(message: tuple) -> None:
            with send_lock:
                conn.send(message)

        def sink(line: str) -> None:
            with contextlib.suppress(OSError, ValueError):  # a dropped flow: the loop below stops the order
                send(("log", line))

        started = time.monotonic()
        attempt: Attempt | None = None
        try:
            spec = read_spec(spec_uri, self.cfg.storage)
            if stage_named(spec.stage).flow_runner != self.kind:
                raise ValueError(f"{spec_uri}: a {spec.stage} stage, which a {RESIDENT_NAMES[self.kind]} resident does not run")
            plan = StagePlan(spec.stage, "", spec.output_uri, spec, dict(spec.inputs))
            attempt = FLOW_RUNNERS[self.kind](self.cfg, spec.stage, self.resources).start(plan, sink)
            result = self._supervise(conn, attempt)
        except Exception as exc:  # noqa: BLE001 - classified as a worker's exception would be
            if attempt is not None:
                attempt.stop(f"the resident failed ({type(exc).__name__})")
            result = exception_result(f"order {spec_uri} (resident)", exc, time.monotonic() - started)
        if result is not None:
            send(("result", dataclasses.replace(result, duration_s=time.monotonic() - started).to_dict()))

    def _supervise(self, conn: Connection, attempt: Attempt) -> LaunchResult | None:
        """The order's result; a stop message or a dropped connection stops it (None: nobody to tell)."""
        while not self._closed.is_set():
            result = attempt.wait(REPLY_POLL_S)
            if result is not None:
                return result
            try:
                message = conn.recv() if conn.poll(0) else None
            except (EOFError, OSError):
                attempt.stop("the flow's connection broke")
                return None
            if message is not None and message[0] == "stop":
                return attempt.stop(message[1]) or LaunchResult(Outcome.CANCELLED, None, f"stopped: {message[1]}")
        return attempt.stop("the resident is ending") or LaunchResult(Outcome.CANCELLED, None, "the resident ended")

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.close()
