"""A stage attempt as a gang on the cluster: a placement group over the pool's nodes, one node agent per node
running the launcher (real torchrun, real gloo), results and log lines back through Ray."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import psutil
import pytest
import ray

from forge_core.compute.gang import Gang, GangRequest, PlacementUnavailable
from forge_core.compute.tuning import core_share
from forge_core.launch import LaunchSpec, Outcome
from tests.ray_cluster import POOL, POOL_NODES

pytestmark = pytest.mark.integration
BOUND_S = 300.0  # an upper safety bound for anything to happen; never a measure of speed


class Lines:
    """A log sink that also lets a test wait for a line."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self._changed = threading.Condition()

    def __call__(self, line: str) -> None:
        with self._changed:
            self.lines.append(line)
            self._changed.notify_all()

    def wait_for(self, count: int, text: str) -> None:
        with self._changed:
            ok = self._changed.wait_for(lambda: sum(text in line for line in self.lines) >= count, BOUND_S)
        assert ok, f"never saw {count} line(s) with {text!r}: {self.lines[-20:]}"


def spec(workers_env, mode: str, pid_dir: Path | None = None) -> LaunchSpec:
    """One node's launch; the gang adds each node's part of the rendezvous."""
    args = ["--mode", mode] + (["--pid-dir", str(pid_dir)] if pid_dir else [])
    return LaunchSpec("gang_worker", args, nproc_per_node=1, env=workers_env, deadline_s=BOUND_S, kill_grace_s=5.0)


def wait_result(gang: Gang):
    result = gang.wait(BOUND_S)
    assert result is not None, "the gang did not end within the safety bound"
    return result


def pids_in(pid_dir: Path) -> list[int]:
    return [int(p.read_text()) for p in pid_dir.glob("*.pid")]


def wait_gone(pids: list[int]) -> list[int]:
    deadline = time.monotonic() + BOUND_S
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
        time.sleep(0.2)
    return alive


def test_two_nodes_run_one_torchrun_job_with_ray_s_gpus(ray_cluster, workers_env):
    lines = Lines()
    gang = Gang(ray_cluster.compute, GangRequest(POOL, nnodes=2, gpus_per_node=1), spec(workers_env, "success"),
                lines, wait_s=BOUND_S, name="gang-test")
    gang.start()
    result = wait_result(gang)
    assert result.outcome is Outcome.SUCCESS, result.reason + "\n" + "\n".join(result.tail)
    places = gang.placement
    assert len({p.node_id for p in places}) == 2, "STRICT_SPREAD put two nodes' parts on one node"
    pool_ids = {n.node_id for n in ray_cluster.compute.pool_nodes(POOL)}
    assert {p.node_id for p in places} <= pool_ids
    assert all(len(p.gpu_ids) == 1 for p in places)
    ranks = [line for line in lines.lines if "gang-rank" in line and "sum" in line]
    assert len(ranks) == 2 and all("of 2" in line and "sum 3" in line for line in ranks), ranks
    for place in places:  # each node's ranks see the GPU Ray gave that node's agent
        assert any(f"[node{place.node_rank}]" in line and f"cuda_visible {place.gpu_ids[0]}" in line
                   for line in ranks), ranks
    # A node's one rank has the node's cores (not the one thread Ray gives an actor without CPUs of its own), at
    # normal priority (not Ray's worker niceness), with one malloc arena.
    assert all(line.endswith(f"arenas 1 nice 0 threads {core_share(1)}") for line in ranks), ranks
    assert ray.util.placement_group_table()  # the group existed ...
    assert all(t["state"] == "REMOVED" for t in ray.util.placement_group_table().values())  # ... and is gone


def test_a_pool_with_too_few_nodes_fails_after_the_wait_naming_both(ray_cluster, workers_env):
    request = GangRequest(POOL, nnodes=POOL_NODES + 1, gpus_per_node=1)
    gang = Gang(ray_cluster.compute, request, spec(workers_env, "success"), print,
                wait_s=2.0, name="too-big")
    with pytest.raises(PlacementUnavailable) as failed:
        gang.start()
    message = str(failed.value)
    assert f"{POOL_NODES + 1} node(s) of pool 'gpu-a' with 1 GPU(s)" in message
    assert f"{POOL_NODES} live node(s) in pool 'gpu-a'" in message and "Fix:" in message
    assert all(t["state"] == "REMOVED" for t in ray.util.placement_group_table().values())


def hanging_gang(ray_cluster, workers_env, pid_dir: Path, name: str) -> tuple[Gang, list[int]]:
    """A 2-node gang whose ranks both wait after their all-reduce; with their pids."""
    lines = Lines()
    gang = Gang(ray_cluster.compute, GangRequest(POOL, nnodes=2, gpus_per_node=1),
                spec(workers_env, "hang", pid_dir), lines, wait_s=BOUND_S, name=name)
    gang.start()
    lines.wait_for(2, "waiting")
    ranks = pids_in(pid_dir)
    assert len(ranks) == 2
    return gang, ranks


def test_a_stopped_gang_leaves_no_rank_and_no_actor(ray_cluster, workers_env, tmp_path):
    gang, ranks = hanging_gang(ray_cluster, workers_env, tmp_path, "stopped")
    result = gang.stop("cancelled by the test")
    assert result is not None and result.outcome is Outcome.CANCELLED, result
    assert wait_gone(ranks) == []
    for node in gang.nodes:  # every agent was killed with the attempt
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(node.agent.place.remote(), timeout=BOUND_S)
    assert all(t["state"] == "REMOVED" for t in ray.util.placement_group_table().values())


def test_a_lost_node_ends_the_attempt_everywhere_and_a_retry_places_on_a_spare(ray_cluster, workers_env, tmp_path):
    gang, ranks = hanging_gang(ray_cluster, workers_env, tmp_path, "node-lost")
    lost = gang.placement[1]
    ray_cluster.raylets.remove_node(ray_cluster.node_with_id(lost.node_id), allow_graceful=False)
    result = wait_result(gang)
    assert result.outcome is Outcome.RETRYABLE, result.reason
    assert f"node 1 ({lost.node_id[:8]}" in result.reason and "was lost" in result.reason
    assert wait_gone(ranks) == [], "a rank of the attempt outlived it"

    retry = Gang(ray_cluster.compute, GangRequest(POOL, nnodes=2, gpus_per_node=1),
                 spec(workers_env, "success"), Lines(), wait_s=BOUND_S, name="node-lost-retry")
    retry.start()
    again = wait_result(retry)
    assert again.outcome is Outcome.SUCCESS, again.reason
    assert lost.node_id not in {p.node_id for p in retry.placement}
    ray_cluster.add_pool_node()  # the pool's size for the tests after this one


def test_a_gang_stopped_while_it_waits_for_its_placement_ends_cancelled(ray_cluster, workers_env):
    request = GangRequest(POOL, nnodes=POOL_NODES + 1, gpus_per_node=1)
    gang = Gang(ray_cluster.compute, request, spec(workers_env, "success"), print, wait_s=BOUND_S, name="unplaced")
    waiting = threading.Thread(target=gang.start, daemon=True)
    waiting.start()
    wait_for_group = time.monotonic() + BOUND_S
    while not any(t["name"] == "forgeflow-unplaced" for t in ray.util.placement_group_table().values()):
        assert time.monotonic() < wait_for_group, "the gang never asked for its placement group"
        time.sleep(0.1)
    result = gang.stop("cancelled by the test")
    waiting.join(BOUND_S)
    assert not waiting.is_alive(), "start() went on waiting after the stop"
    assert result is not None and result.outcome is Outcome.CANCELLED, result
    assert "stopped while waiting for its placement" in result.reason
    assert gang.wait(0) is result and gang.nodes == []
    assert all(t["state"] == "REMOVED" for t in ray.util.placement_group_table().values())
