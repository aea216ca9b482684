"""A gang: one stage attempt as a Ray placement group with a node agent per bundle, each running the launcher.

    gang = Gang(cluster, GangRequest(pool="gpu-a", nnodes=2, gpus_per_node=1), spec, log, wait_s=60)
    gang.start()                         # waits for the placement group, then starts torchrun on every node
    result = gang.wait(timeout=1.0)      # LaunchResult once every node ended, None while it runs
    gang.stop("deadline")                # ends every node's launch and returns the combined result
    gang.placement                       # per node rank: Ray node id, address, GPU ids

- Placement: `nnodes` bundles, one per node (STRICT_SPREAD), all or nothing. A `stop` while waiting ends the
  attempt CANCELLED; not ready within `wait_s`, it fails with the retryable `PlacementUnavailable`.
- Launch: node k's agent (a Ray actor holding its bundle's GPUs) owns node k's launch, so its ranks end when it
  dies; node 0 hosts the c10d rendezvous. Log lines and the LaunchResult come back through Ray.
- Failure: a lost agent or node ends the attempt on every node, RETRYABLE; otherwise the failures not caused by
  another node decide (FATAL over RETRYABLE over CANCELLED). Nothing of the attempt outlives it.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from forge_core.compute.cluster import POOL_LABEL, ComputeCluster
from forge_core.compute.tuning import process_start_environment, take_cpu_share
from forge_core.launch import LaunchResult, LaunchSpec, Outcome, RetryableStageError, start
from forge_core.launch.spec import NodeRendezvous
from forge_core.timings import GANG_STOP_MARGIN_S, PLACEMENT_WAIT_REPORT_S

log = logging.getLogger(__name__)

LogSink = Callable[[str], None]
TAIL_LINES = 60
_END = object()


class PlacementUnavailable(RetryableStageError):
    """The pool had too few free nodes for the attempt's placement group within its wait."""


@dataclass(frozen=True)
class GangRequest:
    """What one attempt asks: `nnodes` nodes of `pool` (any node when None), each with these resources."""

    pool: str | None
    nnodes: int = 1
    gpus_per_node: int = 0
    cpus_per_node: float = 1.0

    def bundles(self) -> list[dict[str, float]]:
        bundle = {"CPU": self.cpus_per_node}
        if self.gpus_per_node:
            bundle["GPU"] = float(self.gpus_per_node)
        return [dict(bundle) for _ in range(self.nnodes)]

    def describe(self) -> str:
        where = f"pool {self.pool!r}" if self.pool else "the cluster"
        return (
            f"{self.nnodes} node(s) of {where} with {self.gpus_per_node} GPU(s) and "
            f"{self.cpus_per_node:g} CPU(s) each, one per node"
        )

    def label_selectors(self) -> list[dict[str, str]] | None:
        return [{POOL_LABEL: self.pool}] * self.nnodes if self.pool else None


def free_port(address: str) -> int:
    """A port free now on this machine's `address` (a rendezvous store's, on the node that hosts it)."""
    with socket.socket() as probe:
        probe.bind((address, 0))
        return probe.getsockname()[1]


@dataclass(frozen=True)
class NodePlace:
    """Where node rank `node_rank` of an attempt ran."""

    node_rank: int
    node_id: str
    address: str
    gpu_ids: tuple[str, ...] = ()

    def record(self, node_rank: int | None = None) -> dict:
        """This node as a manifest's `placement` lists it (`node_rank` overrides its own)."""
        rank = self.node_rank if node_rank is None else node_rank
        return {"node_rank": rank, "node_id": self.node_id, "host": self.address, "gpus": list(self.gpu_ids)}


@ray.remote(max_concurrency=4)
class NodeAgent:
    """Runs one node's part of an attempt on the node Ray placed it on (module docstring)."""

    def __init__(self) -> None:
        self._handle = None
        self._stop_reason: str | None = None

    def place(self) -> NodePlace:
        context = ray.get_runtime_context()
        gpu_ids = tuple(str(g) for g in ray.get_gpu_ids())
        return NodePlace(-1, context.get_node_id(), ray.util.get_node_ip_address(), gpu_ids)

    def free_port(self) -> int:
        return free_port(ray.util.get_node_ip_address())

    def run(self, spec: LaunchSpec) -> Iterator[list[str] | LaunchResult]:
        """Start `spec` with the launcher; yield its log lines in batches, then its LaunchResult."""
        lines: queue.SimpleQueue = queue.SimpleQueue()
        if self._stop_reason is not None:
            yield LaunchResult(Outcome.CANCELLED, None, self._stop_reason)
            return
        if warning := take_cpu_share(spec.nproc_per_node, spec.env):
            lines.put(f"WARNING {warning}")
        self._handle = start(spec, log=lines.put)
        handle = self._handle
        threading.Thread(target=lambda: (handle.wait(), lines.put(_END)), daemon=True).start()
        while True:
            batch = [lines.get()]
            while not lines.empty():
                batch.append(lines.get())
            ended = batch[-1] is _END
            batch = [line for line in batch if line is not _END]
            if batch:
                yield batch
            if ended:
                break
        yield handle.wait()

    def stop(self, reason: str) -> None:
        self._stop_reason = reason
        if self._handle is not None:
            self._handle.cancel(reason)


@dataclass
class _Node:
    rank: int
    agent: object
    place: NodePlace
    result: LaunchResult | None = None
    lost: str = ""
    tail: list[str] = dataclasses.field(default_factory=list)
    relay: threading.Thread | None = None

    @property
    def ended(self) -> bool:
        return self.result is not None or bool(self.lost)

    def label(self) -> str:
        return f"node {self.rank} ({self.place.node_id[:8]} at {self.place.address})"


class Gang:
    """One attempt's nodes on the cluster (module docstring)."""

    def __init__(
        self,
        cluster: ComputeCluster,
        request: GangRequest,
        spec: LaunchSpec,
        log_sink: LogSink,
        wait_s: float,
        name: str = "",
        node_env: Callable[[list[NodePlace], int], dict[str, str]] | None = None,
    ) -> None:
        self.cluster = cluster
        self.node_env = node_env
        self.request = request
        # A node's processes have that node's environment: what the flow decides travels with the spec.
        self.spec = dataclasses.replace(spec, env={**spec.env, **process_start_environment()})
        self.log = log_sink
        self.wait_s = wait_s
        self.name = name or spec.module
        self.nodes: list[_Node] = []
        self.result: LaunchResult | None = None
        self.launch_id = ""  # an attempt's launches are its nodes' (forge_core.run.runner.Attempt)
        self._stopped = threading.Event()
        self._why = ""
        self._pg = None
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)

    @property
    def placement(self) -> list[NodePlace]:
        return [node.place for node in self.nodes]

    def start(self) -> None:
        """Place the attempt and start every node's launch; PlacementUnavailable when not placed within `wait_s`."""
        request = self.request
        self._pg = placement_group(
            request.bundles(),
            strategy="STRICT_SPREAD",
            bundle_label_selector=request.label_selectors(),
            name=f"forgeflow-{self.name}",
        )
        if not self._wait_for_placement():
            return
        agents = [
            NodeAgent.options(
                num_cpus=0,
                num_gpus=request.gpus_per_node,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=k),
            ).remote()
            for k in range(request.nnodes)
        ]
        places = ray.get([agent.place.remote() for agent in agents])
        with self._changed:
            self.nodes = [
                _Node(k, agent, dataclasses.replace(place, node_rank=k))
                for k, (agent, place) in enumerate(zip(agents, places, strict=True))
            ]
            self._changed.notify_all()
        for node, spec in zip(self.nodes, self._node_specs(), strict=True):
            node.relay = threading.Thread(
                target=self._relay, args=(node, spec), name=f"gang-{self.name}-{node.rank}", daemon=True
            )
            node.relay.start()

    def _wait_for_placement(self) -> bool:
        """True once the placement group is ready; False when the attempt was stopped meanwhile (result CANCELLED);
        PlacementUnavailable when not ready within `wait_s`."""
        request, ready_ref = self.request, self._pg.ready()
        started = time.monotonic()
        reported = started
        while not ray.wait([ready_ref], timeout=min(1.0, self.wait_s))[0]:
            waited = time.monotonic() - started
            if self._stopped.is_set():
                self._release()
                with self._changed:
                    self.result = LaunchResult(
                        Outcome.CANCELLED, None, f"{self.name}: stopped while waiting for its placement: {self._why}"
                    )
                    self._changed.notify_all()
                return False
            if waited >= self.wait_s:
                self._release()
                raise PlacementUnavailable(
                    f"{self.name}: the cluster could not give {request.describe()} within {self.wait_s:g} s; "
                    f"{self.cluster.describe_pool(request.pool)}. Fix: add nodes to the pool (ray start --labels "
                    f"{POOL_LABEL}=<pool>), free the busy ones, or lower nnodes/gpus_per_node"
                )
            if time.monotonic() - reported >= PLACEMENT_WAIT_REPORT_S:
                reported = time.monotonic()
                self.log(
                    f"{self.name}: still waiting for {request.describe()} ({waited:.0f} of {self.wait_s:g} s); "
                    f"{self.cluster.describe_pool(request.pool)}"
                )
        return True

    def _node_specs(self) -> list[LaunchSpec]:
        if self.request.nnodes == 1:
            return [self._with_gpus(self.spec, self.nodes[0])]
        host = self.nodes[0]
        port = ray.get(host.agent.free_port.remote())
        specs = []
        for node in self.nodes:
            part = NodeRendezvous(
                nnodes=self.request.nnodes,
                node_rank=node.rank,
                endpoint=f"{host.place.address}:{port}",
                run_id=self.spec.rdzv_id or f"{self.name}-{self._pg.id.hex()[:12]}",
                local_addr=node.place.address,
            )
            specs.append(self._with_gpus(dataclasses.replace(self.spec, **part.launch_fields()), node))
        return specs

    def _with_gpus(self, spec: LaunchSpec, node: _Node) -> LaunchSpec:
        """Node `node`'s launch: the GPUs Ray gave its agent, and what `node_env` adds for it."""
        env = dict(spec.env)
        if self.node_env is not None:
            env.update(self.node_env(self.placement, node.rank))
        if node.place.gpu_ids:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(node.place.gpu_ids)
        return dataclasses.replace(spec, env=env)

    def _relay(self, node: _Node, spec: LaunchSpec) -> None:
        prefix = f"[node{node.rank}] " if self.request.nnodes > 1 else ""
        try:
            for ref in node.agent.run.options(num_returns="streaming").remote(spec):
                item = ray.get(ref)
                if isinstance(item, LaunchResult):
                    self._ended(node, result=item)
                    return
                for line in item:
                    node.tail = (node.tail + [line])[-TAIL_LINES:]
                    self.log(prefix + line)
            self._ended(node, lost="its agent ended without a result")
        except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError) as exc:
            self._ended(node, lost=f"{type(exc).__name__}: {_first_line(exc)}")
        except Exception as exc:  # noqa: BLE001 - any failure to hear from a node is that node lost
            self._ended(node, lost=f"{type(exc).__name__}: {_first_line(exc)}")

    def _ended(self, node: _Node, result: LaunchResult | None = None, lost: str = "") -> None:
        with self._changed:
            node.result, node.lost = result, lost
            self._changed.notify_all()
        if lost:
            self.log(f"{self.name}: {node.label()} was lost ({lost}); ending the attempt on every node")
            self._stop_nodes(f"{node.label()} was lost")

    def wait(self, timeout: float) -> LaunchResult | None:
        """The combined result once every node ended, None while the attempt runs."""
        if self.result is not None:
            return self.result
        deadline = time.monotonic() + timeout
        with self._changed:
            while not all(node.ended for node in self.nodes):
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._changed.wait(left)
        return self._finish()

    def stop(self, reason: str) -> LaunchResult | None:
        """End every node's launch (SIGTERM, kill grace, SIGKILL through the launcher) and return the result; an
        attempt still waiting for its placement ends CANCELLED."""
        self._why = reason
        self._stopped.set()
        with self._changed:  # a start still waiting for its placement notices the stop within a second
            self._changed.wait_for(lambda: self.result is not None or self.nodes, timeout=GANG_STOP_MARGIN_S)
        if not self.nodes:
            return self.result
        self._stop_nodes(reason)
        result = self.wait(self.spec.kill_grace_s + GANG_STOP_MARGIN_S)
        if result is None:
            for node in self.nodes:
                if not node.ended:
                    self._ended(node, lost=f"did not end within {self.spec.kill_grace_s + GANG_STOP_MARGIN_S:g} s")
            result = self._finish()
        return result

    def _stop_nodes(self, reason: str) -> None:
        for node in self.nodes:
            if not node.ended:
                try:
                    node.agent.stop.remote(reason)
                except Exception as exc:  # noqa: BLE001 - a dead agent's launch ends with it (its owner)
                    log.debug("%s: cannot reach its agent to stop it: %s", node.label(), exc)

    def _finish(self) -> LaunchResult:
        with self._lock:
            if self.result is None:
                self.result = self._combined()
        self._release()
        return self.result

    def _release(self) -> None:
        """Kill the agents and remove the placement group: nothing of the attempt outlives it."""
        for node in self.nodes:
            try:
                ray.kill(node.agent)
            except Exception as exc:  # noqa: BLE001 - already dead
                log.debug("%s: agent already gone: %s", node.label(), exc)
        if self._pg is not None:
            try:
                remove_placement_group(self._pg)
            except Exception as exc:  # noqa: BLE001 - already removed
                log.debug("placement group of %s already removed: %s", self.name, exc)
            self._pg = None

    def _combined(self) -> LaunchResult:
        lost = [n for n in self.nodes if n.lost]
        failed = [n for n in self.nodes if n.result is not None and not n.result.ok]
        where = f"{self.name} on " + (f"pool {self.request.pool!r}" if self.request.pool else "the cluster")
        rank_errors = {r: e for n in self.nodes if n.result for r, e in n.result.rank_errors.items()}
        if lost:
            outcome = Outcome.RETRYABLE
            reason = "; ".join(f"{n.label()} was lost: {n.lost}" for n in lost)
            reason = f"{where}: {reason} (the attempt was ended on every node; a retry places it afresh)"
            causes = lost
        elif failed:
            causes = [n for n in failed if not _collateral(n.result)] or failed
            ranked = {Outcome.FATAL: 0, Outcome.RETRYABLE: 1, Outcome.CANCELLED: 2}
            outcome = min((n.result.outcome for n in causes), key=ranked.__getitem__)
            reason = f"{where}: " + "; ".join(
                f"{n.label()}: {n.result.reason}" for n in causes if n.result.outcome is outcome
            )
        else:
            outcome, causes = Outcome.SUCCESS, []
            reason = f"{where}: {len(self.nodes)} node(s) succeeded"
        shown = causes or self.nodes
        tail = [f"[{n.label()}] {line}" for n in shown for line in (n.result.tail if n.result else n.tail)]
        stall = next((n.result.stall for n in causes if n.result and n.result.stall), "")
        returncode = 0 if outcome is Outcome.SUCCESS else next(
            (n.result.returncode for n in causes if n.result), None
        )
        return LaunchResult(
            outcome=outcome,
            returncode=returncode,
            reason=reason,
            tail=tuple(tail[-TAIL_LINES:]),
            rank_errors=rank_errors,
            duration_s=max((n.result.duration_s for n in self.nodes if n.result), default=0.0),
            stall=stall,
        )


def _collateral(result: LaunchResult) -> bool:
    """Whether a node failed only because a peer did: its ranks saw the group or the rendezvous break."""
    text = " ".join([result.reason, *(e.summary for e in result.rank_errors.values())]).lower()
    return result.outcome is not Outcome.FATAL and any(
        mark in text for mark in ("connection reset", "connection closed", "rendezvous", "gloo", "peer")
    )


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:300]
