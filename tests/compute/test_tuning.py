"""How the objects hosted on a node (engines, trainer ranks) run: an even share of the node's cores among the
objects of their bundle, or the flow's own OMP_NUM_THREADS when it set one; normal priority; one malloc arena."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from forge_core.compute.actors import HostGroup, HostRequest
from forge_core.compute.tuning import ARENAS_ENV, THREADS_ENV, core_share
from tests.ray_cluster import POOL

pytestmark = pytest.mark.integration
BOUND_S = 300.0  # an upper safety bound for placement; never a measure of speed


def hosted_threads(ray_cluster, name: str, per_node: int) -> list[tuple[str, int, int, str]]:
    """(OMP_NUM_THREADS, torch's thread count, niceness, MALLOC_ARENA_MAX) of each of `per_node` objects hosted in
    one bundle."""

    class Probe:  # defined here so that Ray ships it by value to the worker
        def threads(self) -> tuple[str, int, int, str]:
            import os

            import torch

            threads, niceness = os.environ.get(THREADS_ENV, ""), os.getpriority(os.PRIO_PROCESS, 0)
            return threads, torch.get_num_threads(), niceness, os.environ.get(ARENAS_ENV, "")

        def close(self) -> None:
            return None  # nothing to release

    group = HostGroup.reserve(ray_cluster.compute, HostRequest(POOL), nodes=1, per_node=per_node, wait_s=BOUND_S,
                               name=name)
    hosts = []
    try:
        hosts = [group.host(k, Probe, (), f"{name}-{k}") for k in range(per_node)]
        assert len({host.place.node_id for host in hosts}) == 1
        return [host.call("threads") for host in hosts]
    finally:
        for host in hosts:
            host.close(5.0)
        group.close()


def test_objects_of_one_bundle_share_its_node_s_cores(ray_cluster, monkeypatch):
    monkeypatch.delenv(THREADS_ENV, raising=False)
    monkeypatch.delenv(ARENAS_ENV, raising=False)
    share = core_share(2)
    assert hosted_threads(ray_cluster, "share", per_node=2) == [(str(share), share, 0, "1")] * 2


def test_the_flow_s_own_thread_setting_wins(ray_cluster, monkeypatch):
    # One object alone would take every core (more than 1 on a machine with several).
    monkeypatch.setenv(THREADS_ENV, "1")
    assert hosted_threads(ray_cluster, "flow-setting", per_node=1) == [("1", 1, 0, "1")]


def test_a_niced_process_goes_back_to_normal_priority_or_says_how():
    script = (
        "import os; from forge_core.compute.tuning import take_cpu_share; "
        "warning = take_cpu_share(1, {}); print(os.getpriority(os.PRIO_PROCESS, 0), repr(warning))"
    )
    out = subprocess.run(["nice", "-n", "15", sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).parents[2]).stdout.split(maxsplit=1)  # fmt: skip
    niceness, warning = int(out[0]), out[1].strip()
    if niceness == 0:
        assert warning == "None"
    else:  # a user without the right to lower niceness: the warning names the node setting that avoids it
        assert niceness == 15 and "RAY_worker_niceness=0" in warning, (niceness, warning)
