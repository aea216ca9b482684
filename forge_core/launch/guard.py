"""What a launched worker runs first: end its whole launch once the launch's owner is gone.

    guard_launched_worker()      # first thing in every stage worker rank

The owner and its watchdog are in forge_core.launch.owner; this module adds ending the launch's processes,
kept apart because process_tree sits above owner.py (a launch spec names its owner).
"""

from __future__ import annotations

import os
import signal
import sys

import psutil

from forge_core.launch.owner import Owner, owners_from_environment, watch_owner
from forge_core.launch.process_tree import processes_with_launch_id
from forge_core.launch.spec import LAUNCH_ID_ENV


def end_this_launch(owner: Owner) -> None:
    """SIGKILL every process of this process's launch (FORGE_LAUNCH_ID, torchrun's agent included), then this
    process. Never returns."""
    launch_id = os.environ.get(LAUNCH_ID_ENV)
    others = processes_with_launch_id(launch_id, include_ancestors=True) if launch_id else []
    print(
        f"[forge.owner] owner pid {owner.pid} is gone: ending launch {launch_id or '?'} "
        f"(pids {sorted(p.pid for p in others)} and {os.getpid()})",
        file=sys.stderr,
        flush=True,
    )
    for proc in others:
        try:
            proc.send_signal(signal.SIGKILL)  # psutil checks pid + start time before signalling
        except psutil.Error:
            continue
    os.kill(os.getpid(), signal.SIGKILL)


def guard_launched_worker() -> list[Owner]:
    """End the launch when one of its owners is gone, now or later; returns the owners watched (none when the
    process was not launched by forge_core.launch)."""
    owners = owners_from_environment()
    for owner in owners:
        if not owner.alive():
            end_this_launch(owner)
    for owner in owners:
        watch_owner(owner, lambda owner=owner: end_this_launch(owner), name="forge-launch-owner-watch")
    return owners
