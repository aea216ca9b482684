"""Who owns a launched process, and the watchdog that ends it once an owner is gone.

A launch's owner is the process whose death makes the launch pointless: the launcher (the flow process, or on
the Ray cluster the node agent actor that runs the launch); for a reward worker, the stage process that scores
with it. An owner is named by pid AND start time (pids are reused): `Owner(pid, create_time)`, written
`<pid>:<create time>`.

- The launcher puts `FORGE_LAUNCH_OWNER=<itself>` into every launch's environment; other processes get theirs
  as `--owner <pid>:<create time>`. A launch a flow run placed on the Ray cluster also names the flow process
  (`FORGE_FLOW_OWNER`, with the machine's boot id), because the node agent outlives the flow by Ray's
  fate-sharing delay and nothing should commit in that delay; it is watched only on the flow's own machine.
- Every stage worker rank runs `guard_launched_worker()` (forge_core.launch.guard) first: a daemon thread polls
  the owners every `OWNER_POLL_S` and, once one is gone, SIGKILLs every process of the launch (its
  `FORGE_LAUNCH_ID`: torchrun's agent, the other ranks, processes the rank started) and then itself. Nothing is
  graceful, on purpose: nobody is left to use a result.
- The commit path calls `check_owner_alive(uri)` right before it publishes a manifest, so a worker whose owner
  died never commits, even in the second before its watchdog fires.

    owner = Owner.this_process()                       # what a launcher hands down
    watch_owner(owner, on_gone=lambda: ...)            # any process: a daemon thread
    guard_launched_worker()                            # a launched worker: watch + end the launch (guard.py)
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import psutil

from forge_core.launch.errors import RetryableStageError
from forge_core.timings import CREATE_TIME_TOLERANCE_S, OWNER_POLL_S

# Set by the launcher in every launch (forge_core.launch.spec.build_env): `<pid>:<create time>` of itself.
OWNER_ENV = "FORGE_LAUNCH_OWNER"
# Set in a launch's spec by the flow run that placed it (forge_core.run.cluster_runner): `<pid>:<create
# time>@<boot id>` of the flow process.
FLOW_OWNER_ENV = "FORGE_FLOW_OWNER"
BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


class OwnerGone(RetryableStageError):
    """The process that owns this launch is gone: nothing may be published on its behalf any more."""


@dataclass(frozen=True)
class Owner:
    """A process by pid and start time (the pair survives pid reuse)."""

    pid: int
    create_time: float
    boot_id: str = ""  # the machine it runs on, when it may be another's ("": this one)

    @classmethod
    def this_process(cls, with_machine: bool = False) -> Owner:
        this = psutil.Process()
        return cls(this.pid, this.create_time(), machine_boot_id() if with_machine else "")

    @classmethod
    def parse(cls, value: str, source: str = OWNER_ENV) -> Owner:
        """`<pid>:<create time>[@<boot id>]` as `str(owner)` writes it; ValueError naming `source` otherwise."""
        process, _, boot_id = value.partition("@")
        pid, sep, create_time = process.partition(":")
        try:
            if not sep:
                raise ValueError("no ':'")
            return cls(int(pid), float(create_time), boot_id)
        except ValueError as exc:
            raise ValueError(
                f"{source}={value!r}: expected <pid>:<create time>[@<boot id>] as the launcher writes it ({exc})"
            ) from exc

    def __str__(self) -> str:
        return f"{self.pid}:{self.create_time!r}" + (f"@{self.boot_id}" if self.boot_id else "")

    def on_this_machine(self) -> bool:
        return not self.boot_id or self.boot_id == machine_boot_id()

    def alive(self) -> bool:
        """The same process (pid and start time) still runs and is not a zombie."""
        try:
            proc = psutil.Process(self.pid)
            same = abs(proc.create_time() - self.create_time) < CREATE_TIME_TOLERANCE_S
            return same and proc.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False


def machine_boot_id() -> str:
    """This machine's boot id (Linux): what tells whether a pid names a process of this machine."""
    try:
        with open(BOOT_ID_PATH) as boot_id:
            return boot_id.read().strip()
    except OSError:
        return ""


def owners_from_environment() -> list[Owner]:
    """The launch's owners this process can watch: the launcher (FORGE_LAUNCH_OWNER) and the flow process that
    placed the launch (FORGE_FLOW_OWNER) when it runs on this machine; none for a process nobody launched."""
    owners = []
    for name in (OWNER_ENV, FLOW_OWNER_ENV):
        value = os.environ.get(name)
        if value and (owner := Owner.parse(value, source=name)).on_this_machine():
            owners.append(owner)
    return owners


def watch_owner(
    owner: Owner, on_gone: Callable[[], None], poll_s: float = OWNER_POLL_S, name: str = "forge-owner-watch"
) -> threading.Thread:
    """Call `on_gone()` once, on a daemon thread, as soon as `owner` is gone (checked every `poll_s`)."""

    def watch() -> None:
        while owner.alive():
            time.sleep(poll_s)
        on_gone()

    thread = threading.Thread(target=watch, name=name, daemon=True)
    thread.start()
    return thread


def check_owner_alive(uri: str = "") -> None:
    """OwnerGone when an owner of this process's launch is gone (the pre-commit check); a no-op for a process
    nobody launched."""
    for owner in owners_from_environment():
        if not owner.alive():
            raise OwnerGone(
                f"not committing {uri or 'the artifact'}: the launch's owner (pid {owner.pid}: the flow process or "
                "the node agent that launched this worker) is gone; this worker ends itself and a new flow run "
                "recomputes the stage"
            )
