"""One real Ray cluster for the tests that need one (tests/compute, tests/flows), shared by the session: several
raylets on this machine (`ray.cluster_utils.Cluster`), each a node with its own pool label and fake GPU count,
every port on 127.0.0.1, token authentication on."""

from __future__ import annotations

import os
from pathlib import Path

import psutil

from forge_core.compute.cluster import (
    POOL_LABEL,
    ComputeCluster,
    apply_environment,
    connect,
    embedded_environment,
    private_token_file,
)
from forge_core.compute.simulated import stage_processes
from forge_core.faults import FAULT_ENV, FAULT_ONCE_ENV

POOL = "gpu-a"
POOL_NODES = 3
# Room on a node for an engine actor and a trainer rank at once (the flow-lifetime engines hold their nodes while
# GRPO trains).
POOL_NODE_CPUS = 2


class RayTestCluster:
    """The `cluster_utils` cluster and the connection the tests use."""

    def __init__(self, raylets, compute: ComputeCluster, token_path: Path) -> None:
        self.raylets = raylets
        self.compute = compute
        self.token_path = token_path

    def add_pool_node(self):
        """A new pool node. A raylet inherits this process's environment, so the FORGE_FAULT settings of the test
        that adds it are left out: later tests' ranks on that node must not see them."""
        stashed = {name: os.environ.pop(name) for name in (FAULT_ENV, FAULT_ONCE_ENV) if name in os.environ}
        try:
            return self.raylets.add_node(num_cpus=POOL_NODE_CPUS, num_gpus=1, labels={POOL_LABEL: POOL})
        finally:
            os.environ.update(stashed)

    def node_with_id(self, node_id: str):
        return next(n for n in self.raylets.list_all_nodes() if n.node_id == node_id)

    def stage_processes(self) -> list[psutil.Process]:
        """Live processes that Ray workers of this cluster started for forgeflow (ranks, torchrun, engines,
        reward workers), found by the cluster's token path in their environment, orphans included."""
        return stage_processes(self.token_path)

    def live_actors(self) -> list[dict]:
        """The cluster's actors that are not dead (Ray's GCS table)."""
        from ray._private.state import actors

        return [a for a in actors().values() if a.get("State") != "DEAD"]

    def pids(self) -> set[int]:
        """Every process of the cluster: each node's Ray services, their workers, and this driver."""
        pids = {os.getpid()}
        for node in self.raylets.list_all_nodes():
            for infos in node.all_processes.values():
                for info in infos:
                    pids.add(info.process.pid)
        roots = set(pids)
        for pid in roots:
            try:
                pids.update(child.pid for child in psutil.Process(pid).children(recursive=True))
            except psutil.Error:
                continue
        return pids


def ray_client_environment(cluster: RayTestCluster) -> dict[str, str]:
    """What a process of this machine needs in its environment to join the cluster: the token, loopback only."""
    return embedded_environment(cluster.token_path)


def start_ray_cluster(tmp_path_factory):
    """The session's cluster (a generator: the `ray_cluster` fixture of tests/conftest.py drives it)."""
    from ray.cluster_utils import Cluster

    token_path = private_token_file(tmp_path_factory.mktemp("ray") / "token")
    saved = {k: os.environ.get(k) for k in embedded_environment(token_path)}
    apply_environment(embedded_environment(token_path))
    raylets = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "include_dashboard": False, "labels": {POOL_LABEL: "head"}},
    )
    for _ in range(POOL_NODES):
        raylets.add_node(num_cpus=POOL_NODE_CPUS, num_gpus=1, labels={POOL_LABEL: POOL})
    raylets.wait_for_nodes()
    compute = connect(raylets.address)
    try:
        yield RayTestCluster(raylets, compute, token_path)
    finally:
        compute.close()
        raylets.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        apply_environment({})

