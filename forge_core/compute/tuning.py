"""How the processes a stage runs on a node are tuned: their threads, priority and memory allocator.

Threads. Ray sets OMP_NUM_THREADS=1 in an actor that holds no CPUs of its own; ours hold theirs through their
placement-group bundle, so each process instead takes an even share of its usable cores among the `sharing`
processes of its kind on its node. A flow that sets OMP_NUM_THREADS itself hands it down, and it wins.

Priority. Ray starts workers at niceness 15, where a preempted rank stalls its whole group at the next
collective; processes go back to normal priority where allowed, else a warning names the fix.

Allocator. glibc's per-thread arenas trim their heaps, so a hosted object's threads would fault per-step buffers
in afresh every step: processes start with `MALLOC_ARENA_MAX=1` unless the flow sets it (read only at process
start, so it travels in `process_start_environment`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

THREADS_ENV = "OMP_NUM_THREADS"
ARENAS_ENV = "MALLOC_ARENA_MAX"


def flow_thread_setting() -> dict[str, str]:
    """This process's own OMP_NUM_THREADS, to hand to the processes it has the cluster start ({} when unset)."""
    value = os.environ.get(THREADS_ENV, "")
    return {THREADS_ENV: value} if value else {}


def process_start_environment() -> dict[str, str]:
    """The variables a stage's process must have from its start: malloc arenas and the flow's thread setting."""
    return {ARENAS_ENV: os.environ.get(ARENAS_ENV) or "1", **flow_thread_setting()}


def core_share(sharing: int) -> int:
    """The cores this process may use divided among `sharing` processes (at least 1)."""
    return max(1, len(os.sched_getaffinity(0)) // max(1, sharing))


def take_cpu_share(sharing: int, handed: Mapping[str, str]) -> str | None:
    """Set this process's thread share (OMP_NUM_THREADS, and torch's when loaded) and normal priority.

    Returns:
        A warning when the process runs below normal priority and may not change that, else None.
    """
    threads = handed.get(THREADS_ENV) or str(core_share(sharing))
    os.environ[THREADS_ENV] = threads
    torch = sys.modules.get("torch")
    if torch is not None and threads.isdigit():
        torch.set_num_threads(int(threads))
    return _restore_priority()


def _restore_priority() -> str | None:
    niceness = os.getpriority(os.PRIO_PROCESS, 0)
    if niceness <= 0:
        return None
    try:
        os.setpriority(os.PRIO_PROCESS, 0, 0)
    except PermissionError:
        return (
            f"this Ray worker runs at niceness {niceness} and may not lower it, so every other process of the "
            "node preempts it; Fix: start the node's Ray with RAY_worker_niceness=0"
        )
    return None
