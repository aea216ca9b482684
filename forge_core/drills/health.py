"""Per-node health over a drill run: whether Ray sees each node alive and, on a simulated cluster, the CPU and
memory of each node's processes, sampled on a thread.

    with HealthSampler(cluster, every_s=1.0) as health:
        ... the run ...
    health.samples            # [{t, node, alive, cpu, rss_mb}], t in wall-clock seconds
"""

from __future__ import annotations

import time

import psutil

from forge_core.compute.simulated import node_table
from forge_core.metrics.sampler import PeriodicSampler


class HealthSampler(PeriodicSampler):
    """Samples the cluster's nodes every `every_s` seconds until the block ends (module docstring)."""

    def __init__(self, cluster, every_s: float) -> None:
        super().__init__(every_s, name="forge-drill-health")
        self.cluster = cluster
        self.samples: list[dict] = []
        self._procs: dict[int, psutil.Process] = {}

    def sample(self) -> None:
        now = time.time()
        trees = self.cluster.node_processes()
        for node_id, alive in node_table():
            cpu, rss = self._usage(trees.get(node_id)) if node_id in trees else (None, None)
            self.samples.append({"t": now, "node": node_id, "alive": alive, "cpu": cpu, "rss_mb": rss})

    def _usage(self, pids: list[int] | None) -> tuple[float, float]:
        """Summed CPU % (since this sampler last looked at each process) and resident MiB of `pids`."""
        cpu = rss = 0.0
        for pid in pids or []:
            try:
                proc = self._procs.setdefault(pid, psutil.Process(pid))
                cpu += proc.cpu_percent(None)
                rss += proc.memory_info().rss / 2**20
            except psutil.Error:
                self._procs.pop(pid, None)
        return round(cpu, 1), round(rss, 1)
