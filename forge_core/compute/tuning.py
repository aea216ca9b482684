"""How the processes a stage runs on a node are tuned: their threads, priority and memory allocator.

Threads. Ray sets OMP_NUM_THREADS=1 in an actor that holds no CPUs of its own. Ours hold theirs through their
placement group's bundle, so that default would leave a trainer rank or an engine one core of a many-core node,
and simply lifting it would let every process on the node take every core. Each of our processes instead takes
an even share of the cores it may use among the processes of its kind on its node: `sharing` ranks of one
launch, trainer ranks or engines (on a node with as many cores as ranks, torchrun's one thread per rank). A flow
that sets OMP_NUM_THREADS itself (to split a node between an engine and a trainer that run at the same time,
say) hands its setting down, and that setting wins.

Priority. Ray starts its workers at niceness 15 (`RAY_worker_niceness`), below every other process of the node;
a rank that any other process preempts stalls its whole group at the next collective. Our processes go back to
normal priority where the node lets them; where it does not, the warning names the fix (start the node's Ray
with `RAY_worker_niceness=0`, as the embedded cluster does).

Allocator. A hosted object works on threads of its own (an actor's main thread is Ray's), and glibc gives each
thread an arena of its own whose heaps it trims back to the system, so a trainer rank faulted its per-step
buffers in afresh at every step (bench/grpo_iteration measures the difference). Our processes start with one
arena (`MALLOC_ARENA_MAX=1`) unless the flow sets MALLOC_ARENA_MAX itself. glibc reads it once, at the start of
a process, so it travels in the variables a process starts with (`process_start_environment`): a launch's, and
a hosted object's Ray runtime environment.
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
    """The variables a stage's process must have from its start: its malloc arenas and the flow's thread
    setting (module docstring)."""
    return {ARENAS_ENV: os.environ.get(ARENAS_ENV) or "1", **flow_thread_setting()}


def core_share(sharing: int) -> int:
    """The cores this process may use divided among `sharing` processes (at least 1)."""
    return max(1, len(os.sched_getaffinity(0)) // max(1, sharing))


def take_cpu_share(sharing: int, handed: Mapping[str, str]) -> str | None:
    """Settle this process (and what it starts) on its node: threads as the module docstring says (set in
    OMP_NUM_THREADS, and in torch when torch is loaded), normal priority.

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
