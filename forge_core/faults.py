"""Test-only fault injection for training workers, driven by the environment.

    FORGE_FAULT=kill_rank:1:3     rank 1 SIGKILLs itself right after finishing optimizer step 3
    FORGE_FAULT=raise_rank:0:2    rank 0 raises InjectedFault (a Python error: the launcher calls it fatal)
    FORGE_FAULT=hang_rank:1:2     rank 1 sleeps forever (for deadline / watchdog tests)
    FORGE_FAULT=kill_rank:1:3,raise_rank:0:5    several faults, comma-separated
    FORGE_FAULT_ONCE=<path>       fire at most once: the first fault creates <path>; later attempts that find
                                  it (e.g. a retry after the kill) run clean

Trainers call `maybe_inject_fault(rank, step)` after each optimizer step and before that step's checkpoint,
so a fault at step N loses step N's update and resume restarts from the last checkpoint before N.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass

FAULT_ENV = "FORGE_FAULT"
FAULT_ONCE_ENV = "FORGE_FAULT_ONCE"
_ACTIONS = ("kill_rank", "raise_rank", "hang_rank")


class InjectedFault(RuntimeError):
    """Raised by `raise_rank` faults."""


@dataclass(frozen=True)
class Fault:
    action: str
    rank: int
    step: int


def parse_faults(spec: str) -> list[Fault]:
    """Parse `action:rank:step[,action:rank:step...]`; ValueError naming the bad entry."""
    faults = []
    for entry in filter(None, (part.strip() for part in spec.split(","))):
        parts = entry.split(":")
        if len(parts) != 3 or parts[0] not in _ACTIONS or not all(p.isdigit() for p in parts[1:]):
            raise ValueError(
                f"{FAULT_ENV}={spec!r}: bad entry {entry!r}; expected <action>:<rank>:<step> with action one "
                f"of {list(_ACTIONS)}, e.g. kill_rank:1:3"
            )
        faults.append(Fault(parts[0], int(parts[1]), int(parts[2])))
    return faults


def _claim_once() -> bool:
    """True when the fault may fire: no once-marker configured, or we created it just now."""
    marker = os.environ.get(FAULT_ONCE_ENV)
    if not marker:
        return True
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.close(fd)
    return True


def maybe_inject_fault(rank: int, step: int) -> None:
    """Fire the fault configured for (`rank`, `step`) in FORGE_FAULT, if any."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    for fault in parse_faults(spec):
        if fault.rank != rank or fault.step != step or not _claim_once():
            continue
        print(f"[forge-fault] rank {rank}: {fault.action} after step {step}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        if fault.action == "kill_rank":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault.action == "raise_rank":
            raise InjectedFault(f"injected fault: {FAULT_ENV}={spec!r} (rank {rank}, step {step})")
        while True:  # hang_rank
            time.sleep(3600)
