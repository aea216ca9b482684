"""Clusters whose nodes can be added and lost on purpose (fault drills), and what they leave behind.

    cluster = SimulatedCluster.start("drill", cpus=2, gpus=1)  # raylets on this machine, every port on loopback
    cluster = SimulatedCluster.adopt(raylets, compute, "gpu-a", cpus=2, gpus=1)  # an existing cluster_utils one
    cluster = JoinedCluster.join("ray://head:10001", "gpu")    # a real cluster
    cluster.resize(6)                    # simulated: 6 live pool nodes; real: waits until the pool has 6
    cluster.remove_node(node_id)         # the node is gone at once (no graceful drain)
    cluster.node_processes()             # node id -> the pids of its Ray processes and their children
    cluster.close()                      # simulated: shut down (adopted: back to its size); real: disconnect

A simulated node is one raylet of `ray.cluster_utils` labelled `forgeflow.pool=<pool>` with `cpus` logical CPUs
and `gpus` fake GPUs; they share this machine's cores, memory and network namespace.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import psutil

from forge_core.compute.cluster import (
    POOL_LABEL,
    TOKEN_PATH_ENV,
    ComputeCluster,
    apply_environment,
    connect,
    embedded_environment,
    private_token_file,
)
from forge_core.faults import FAULT_ENV, FAULT_ONCE_ENV
from forge_core.timings import DRILL_NODE_START_S, DRILL_POLL_S

# Command-line fragments of the processes Ray workers start for forgeflow (ranks, torchrun, engines, rewards).
STAGE_FRAGMENTS = ("forge_core.run", "forge_core.rollout", "forge_core.rewards", "torch.distributed.run")


def stage_processes(token_path: str | os.PathLike | None) -> list[psutil.Process]:
    """Live processes of this machine that Ray workers of the cluster with this token file started for
    forgeflow, orphans included (found by the token path in their environment)."""
    if token_path is None:
        return []
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if proc.pid == os.getpid() or not any(f in cmdline for f in STAGE_FRAGMENTS):
            continue
        try:
            if proc.environ().get(TOKEN_PATH_ENV) == str(token_path) and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except psutil.Error:
            continue
    return found


def live_actors() -> list[dict]:
    """The connected cluster's actors that are not dead."""
    from ray._private.state import actors

    return [a for a in actors().values() if a.get("State") != "DEAD"]


def node_table() -> list[tuple[str, bool]]:
    """(node id, alive) of every node the connected cluster has known, dead ones included."""
    import ray

    return [(node["NodeID"], bool(node.get("Alive"))) for node in ray.nodes()]


def placed_group(names: tuple[str, ...]) -> tuple[str, list[str]] | None:
    """(placement group id, node of each bundle) of the first placed group named forgeflow-<name>, or None."""
    import ray

    for name in names:
        for group_id, table in ray.util.placement_group_table().items():
            if table["name"] == f"forgeflow-{name}" and table["state"] == "CREATED":
                return group_id, [table["bundles_to_node_id"][k] for k in sorted(table["bundles_to_node_id"])]
    return None


def group_ended(group_id: str) -> bool:
    """Whether placement group `group_id` is no longer placed."""
    import ray

    table = ray.util.placement_group_table().get(group_id)
    return table is None or table["state"] != "CREATED"


def placed_groups() -> list[dict]:
    """The connected cluster's placement groups that are not removed."""
    import ray

    return [t for t in ray.util.placement_group_table().values() if t["state"] != "REMOVED"]


def process_tree(pid: int) -> list[int]:
    """`pid` and its live descendants."""
    try:
        root = psutil.Process(pid)
        return [pid, *(child.pid for child in root.children(recursive=True))]
    except psutil.Error:
        return []


class SimulatedCluster:
    """Raylets of `ray.cluster_utils` on this machine (module docstring)."""

    kind = "simulated"

    def __init__(self, raylets, compute: ComputeCluster, pool: str, cpus: int, gpus: int, owned: bool) -> None:
        self.raylets = raylets
        self.compute = compute
        self.pool = pool
        self.cpus, self.gpus = cpus, gpus
        self.owned = owned
        self._initial_size = len(self.pool_node_ids())

    @classmethod
    def start(cls, pool: str, cpus: int, gpus: int, token_dir: Path | None = None) -> SimulatedCluster:
        """A head node (1 CPU, no pool: the drill's driver side) and no pool node yet; `resize` adds them."""
        from ray.cluster_utils import Cluster

        apply_environment(embedded_environment(private_token_file(token_dir)))
        with _without_faults():
            raylets = Cluster(
                initialize_head=True,
                head_node_args={"num_cpus": 1, "include_dashboard": False, "labels": {POOL_LABEL: "head"}},
            )
        return cls(raylets, connect(raylets.address), pool, cpus, gpus, owned=True)

    @classmethod
    def adopt(cls, raylets, compute: ComputeCluster, pool: str, cpus: int, gpus: int) -> SimulatedCluster:
        """Drive an existing cluster_utils cluster; `close` gives it back at its size."""
        return cls(raylets, compute, pool, cpus, gpus, owned=False)

    @property
    def token_path(self) -> str | None:
        return os.environ.get(TOKEN_PATH_ENV)

    def describe(self) -> str:
        return (
            f"simulated: raylets of ray.cluster_utils on this machine ({os.cpu_count()} cores), one node = "
            f"{self.cpus} logical CPUs + {self.gpus} fake GPU(s), pool {self.pool!r}, every port on "
            "127.0.0.1"
        )

    def pool_node_ids(self) -> list[str]:
        return [node.node_id for node in self.compute.pool_nodes(self.pool)]

    def resize(self, nodes: int) -> None:
        """Add or remove pool nodes until `nodes` are live (removed ones are idle: between runs)."""
        while len(self.pool_node_ids()) < nodes:
            with _without_faults():
                self.raylets.add_node(
                    num_cpus=self.cpus, num_gpus=self.gpus, labels={POOL_LABEL: self.pool}
                )
        for node_id in self.pool_node_ids()[nodes:]:
            self.remove_node(node_id)
        self.raylets.wait_for_nodes()
        _wait_until(lambda: len(self.pool_node_ids()) == nodes, DRILL_NODE_START_S, f"{nodes} live pool nodes")

    def remove_node(self, node_id: str) -> None:
        """The node's raylet and its processes are killed at once, as a lost machine would be."""
        node = next(n for n in self.raylets.list_all_nodes() if n.node_id == node_id)
        self.raylets.remove_node(node, allow_graceful=False)

    def node_processes(self) -> dict[str, list[int]]:
        """Each live node's Ray processes and their children (its workers and what they started)."""
        found = {}
        for node in self.raylets.list_all_nodes():
            pids: list[int] = []
            for infos in node.all_processes.values():
                for info in infos:
                    pids.extend(process_tree(info.process.pid))
            found[node.node_id] = sorted(set(pids))
        return found

    def leftovers(self) -> list[str]:
        """What a finished run left: stage processes, live actors, placed groups (empty: nothing)."""
        left = [f"process {p.pid} ({' '.join(p.cmdline()[:3])})" for p in _alive(stage_processes(self.token_path))]
        left += [f"actor {a.get('ActorClassName', '?')} {a.get('ActorID', '')[:8]}" for a in live_actors()]
        left += [f"placement group {t['name']}" for t in placed_groups()]
        return left

    def close(self) -> None:
        if self.owned:
            self.compute.close()
            self.raylets.shutdown()
        else:
            self.resize(self._initial_size)


class JoinedCluster:
    """A real Ray cluster joined by address; lost nodes come back by its own means (an autoscaler, Kubernetes)."""

    kind = "real"

    def __init__(self, compute: ComputeCluster, pool: str, spare_wait_s: float) -> None:
        self.compute = compute
        self.pool = pool
        self.spare_wait_s = spare_wait_s

    @classmethod
    def join(cls, address: str, pool: str, spare_wait_s: float) -> JoinedCluster:
        return cls(connect(address), pool, spare_wait_s)

    def describe(self) -> str:
        return f"real: the Ray cluster at {self.compute.address}, pool {self.pool!r}"

    def pool_node_ids(self) -> list[str]:
        return [node.node_id for node in self.compute.pool_nodes(self.pool)]

    def resize(self, nodes: int) -> None:
        """Wait until the pool has at least `nodes` live nodes (a real cluster is sized by its operator)."""
        _wait_until(lambda: len(self.pool_node_ids()) >= nodes, self.spare_wait_s,
                    f"{nodes} live nodes in pool {self.pool!r} (the step's size; add nodes or lower it)")

    def remove_node(self, node_id: str) -> None:
        """Kill the node's raylet from a task pinned to it (the task's worker is the raylet's child)."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        @ray.remote(num_cpus=0, max_retries=0)
        def kill_raylet() -> None:
            os.kill(os.getppid(), signal.SIGKILL)

        ref = kill_raylet.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote()
        with contextlib.suppress(Exception):  # the node dies under its own task: the expected way out
            ray.get(ref, timeout=60)

    def node_processes(self) -> dict[str, list[int]]:
        return {}  # the processes of remote machines are not visible from here

    def leftovers(self) -> list[str]:
        left = [f"actor {a.get('ActorClassName', '?')} {a.get('ActorID', '')[:8]}" for a in live_actors()]
        return left + [f"placement group {t['name']}" for t in placed_groups()]

    def close(self) -> None:
        self.compute.close()


def _alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    alive = []
    for proc in processes:
        try:
            proc.cmdline()
            alive.append(proc)
        except psutil.Error:
            continue
    return alive


class _without_faults:
    """A raylet inherits this process's environment: keep a run's fault settings out of new nodes."""

    def __enter__(self) -> None:
        self._stashed = {k: os.environ.pop(k) for k in (FAULT_ENV, FAULT_ONCE_ENV) if k in os.environ}

    def __exit__(self, *exc_info) -> None:
        os.environ.update(self._stashed)


def _wait_until(condition, bound_s: float, what: str) -> None:
    deadline = time.monotonic() + bound_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the cluster never had {what} within {bound_s:g} s")
        time.sleep(DRILL_POLL_S)
