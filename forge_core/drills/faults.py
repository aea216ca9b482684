"""The faults a drill injects into one run: one small class per kind, built by `injector_for`.

An injector contributes entries to FORGE_FAULT (forge_core.faults: a rank or an engine stops or dies at a
chosen point, the store fails for a while) and runs beside the flow on a thread, doing what a process cannot do
to itself: removing the node a stopped rank or engine is on, throttling a node. Whatever it did is in its
`Strike`, in wall-clock seconds (time.time()), so it lines up with manifests' commit times.

    injector = injector_for(fault, cluster, marker)
    injector.unavailable()                               # why it cannot run on this cluster, or None
    os.environ[FAULT_ENV] = injector.fault_entry()       # "" when it needs none
    thread = threading.Thread(target=injector.run, args=(stop,)); thread.start()
    ... the run ...
    stop.set(); thread.join(); injector.strike          # when it struck, on which node
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from forge_core.compute.simulated import group_ended, placed_group
from forge_core.drills.plan import ENGINE_STAGE, DrillFault
from forge_core.timings import DRILL_POLL_S, DRILL_THROTTLE_CYCLE_S


def stage_groups(stage: str) -> tuple[str, ...]:
    """The placement groups (forgeflow-<name>) a stage's work may be placed as: the run's engines, its trainer
    group, or the stage's own attempt."""
    return ("engines",) if stage == ENGINE_STAGE else (f"{stage}-trainer", stage)


@dataclass
class Strike:
    """What an injector did in one run."""

    fault: str
    injected_at: float | None = None  # when the fault struck (None: it never did)
    detected_at: float | None = None  # when the system noticed (the attempt's placement ended), if observable
    node_id: str | None = None  # the node it struck
    nodes_before: list[str] = field(default_factory=list)  # the stage's nodes when it struck
    ended_at: float | None = None  # a fault with a duration: when it was lifted


class FaultInjector:
    """Base: no FORGE_FAULT entry, nothing to do beside the run."""

    def __init__(self, fault: DrillFault, cluster, marker: Path) -> None:
        self.fault = fault
        self.cluster = cluster
        self.marker = marker
        self.strike = Strike(fault.label)

    def fault_entry(self) -> str:
        return ""

    def unavailable(self) -> str | None:
        """Why this fault cannot be injected on this cluster, or None."""
        return None

    def run(self, stop: threading.Event) -> None:
        return None

    def _wait(self, stop: threading.Event, condition):
        """condition()'s first truthy value, or None once `stop` is set."""
        while not stop.is_set():
            value = condition()
            if value:
                return value
            stop.wait(DRILL_POLL_S)
        return None

    def _struck_when_marker_appears(self, stop: threading.Event) -> None:
        """The FORGE_FAULT entry fired in some process: its once-marker's creation time is when."""
        if self._wait(stop, self.marker.exists):
            self.strike.injected_at = self.marker.stat().st_mtime


class NodeLostUnderTrainer(FaultInjector):
    """node_lost on sft or grpo: rank 1 stops after optimizer step `at`, then the node of the stage's second
    bundle is removed outright. Detected when the attempt's placement group ends."""

    def fault_entry(self) -> str:
        return f"hang_rank:1:{self.fault.at}@{self.fault.target}"

    def run(self, stop: threading.Event) -> None:
        if not self._wait(stop, self.marker.exists):
            return
        placed = self._wait(stop, lambda: placed_group(stage_groups(self.fault.target)))
        if placed is None:
            return
        group_id, nodes = placed
        _remove(self, nodes, 1)
        if self._wait(stop, lambda: group_ended(group_id)):
            self.strike.detected_at = time.time()


class NodeLostUnderEngine(FaultInjector):
    """node_lost on rollout: engine 1 stops in its first rollout request, then its node is removed outright.
    Detected when the router drops the engine (the rollout manifest's `engines/first_lost_at`)."""

    def fault_entry(self) -> str:
        return "hang_engine:1@rollout"

    def run(self, stop: threading.Event) -> None:
        if not self._wait(stop, self.marker.exists):
            return
        placed = self._wait(stop, lambda: placed_group(stage_groups(ENGINE_STAGE)))
        if placed is not None:
            _remove(self, placed[1], 1)


class EngineKilled(FaultInjector):
    """engine_killed: a rollout engine's vLLM process is SIGKILLed once `at` samples are done in it."""

    def fault_entry(self) -> str:
        return f"kill_vllm:{self.fault.at}@rollout"

    def run(self, stop: threading.Event) -> None:
        self._struck_when_marker_appears(stop)


class StorageOutage(FaultInjector):
    """storage_outage: from the stage's first storage call, every storage call of that process fails for
    `seconds`; the store's retries have to ride it out."""

    def fault_entry(self) -> str:
        return f"storage_outage:{self.fault.seconds:g}@{self.fault.target}"

    def run(self, stop: threading.Event) -> None:
        self._struck_when_marker_appears(stop)
        if self.strike.injected_at is not None:
            self.strike.ended_at = self.strike.injected_at + self.fault.seconds


class SlowNode(FaultInjector):
    """slow_node: once the stage is placed, the node of its first bundle runs at (1 - slowdown) speed for
    `seconds`: every process of the node is stopped (SIGSTOP) for that share of each short cycle."""

    def unavailable(self) -> str | None:
        if self.cluster.kind != "simulated":
            return "a slow node needs the node's processes on this machine (a simulated cluster)"
        return None

    def run(self, stop: threading.Event) -> None:
        placed = self._wait(stop, lambda: placed_group(stage_groups(self.fault.target)))
        if placed is None:
            return
        node = placed[1][0]
        self.strike.node_id, self.strike.nodes_before = node, list(placed[1])
        self.strike.injected_at = time.time()
        until = time.monotonic() + self.fault.seconds
        stopped_s = DRILL_THROTTLE_CYCLE_S * self.fault.slowdown
        while time.monotonic() < until and not stop.is_set():
            pids = self.cluster.node_processes().get(node, [])
            _signal_all(pids, signal.SIGSTOP)
            time.sleep(stopped_s)
            _signal_all(pids, signal.SIGCONT)
            time.sleep(DRILL_THROTTLE_CYCLE_S - stopped_s)
        self.strike.ended_at = time.time()


class NetDelay(FaultInjector):
    """net_delay: a delayed, lossy link on one node (tc netem in the node's own network namespace)."""

    def unavailable(self) -> str | None:
        return (
            "the nodes share one network namespace (simulated raylets of this machine, or a real cluster's "
            "nodes this process cannot enter), so a delay on one node's link cannot be applied; run it with each "
            "node in its own namespace (tc qdisc add dev <if> root netem delay 100ms loss 1%) by hand"
        )


def injector_for(fault: DrillFault, cluster, marker: Path) -> FaultInjector:
    """The injector of `fault` (module docstring)."""
    if fault.kind == "node_lost":
        kind = NodeLostUnderEngine if fault.target == "rollout" else NodeLostUnderTrainer
    else:
        kind = {"engine_killed": EngineKilled, "storage_outage": StorageOutage, "slow_node": SlowNode,
                "net_delay": NetDelay}[fault.kind]  # fmt: skip
    return kind(fault, cluster, marker)


def _remove(injector: FaultInjector, nodes: list[str], bundle: int) -> None:
    injector.strike.node_id, injector.strike.nodes_before = nodes[bundle], list(nodes)
    injector.strike.injected_at = time.time()
    injector.cluster.remove_node(nodes[bundle])


def _signal_all(pids: list[int], signum: int) -> None:
    for pid in pids:
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            continue
