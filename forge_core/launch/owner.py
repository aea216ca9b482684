"""Who owns a launched process, and the watchdog that ends it once its owner is gone.

A launch's owner is the process whose death makes the launch pointless: the launcher (the flow process, for
a stage's torchrun tree or plain worker); for an engine service, the process that bounds its life
(forge_core.rollout.service.supervision); for a reward worker, the stage process that scores with it. The owner
is named by pid AND start time (pids are reused): `Owner(pid, create_time)`, written `<pid>:<create time>`.

- The launcher puts `FORGE_LAUNCH_OWNER=<itself>` into the environment of every launch
  (forge_core.launch.spec.build_env); other processes get theirs as `--owner <pid>:<create time>`.
- Every stage worker rank (and the GRPO trainer job's ranks) runs `guard_launched_worker()` first thing
  (forge_core.launch.guard, called by forge_core.run.__main__): a daemon thread polls the owner every `OWNER_POLL_S` and, once it is gone,
  SIGKILLs every process of the launch (its `FORGE_LAUNCH_ID`: torchrun's agent, which is an ancestor of
  the rank, the other ranks, vLLM or reward processes the rank started) and then itself. So a launch whose
  flow process was SIGKILLed ends by itself within about `OWNER_POLL_S` plus one process scan (~2 s), with no
  later flow needed to reap it (forge_core.launch.registry stays the fallback for anything else).
  Nothing is graceful there on purpose: nobody is left to use a result.
- The commit path asks `check_owner_alive(uri)` right before it publishes a manifest (the worker installs
  it as the storage writer's pre-commit check), so a worker whose owner died never commits, even in the
  second before its watchdog fires.

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

# Set by the launcher in every launch (forge_core.launch.spec.build_env): `<pid>:<create time>` of itself.
OWNER_ENV = "FORGE_LAUNCH_OWNER"
# How often a watchdog checks its owner: a launch outlives its owner by about this plus one process scan.
OWNER_POLL_S = 1.0
# psutil's create time comes from clock ticks since boot: equal for one process, up to a tick off when read
# through different paths.
CREATE_TIME_TOLERANCE_S = 0.01


class OwnerGone(RetryableStageError):
    """The process that owns this launch is gone: nothing may be published on its behalf any more."""


@dataclass(frozen=True)
class Owner:
    """A process by pid and start time (the pair survives pid reuse)."""

    pid: int
    create_time: float

    @classmethod
    def this_process(cls) -> Owner:
        this = psutil.Process()
        return cls(this.pid, this.create_time())

    @classmethod
    def parse(cls, value: str, source: str = OWNER_ENV) -> Owner:
        """`<pid>:<create time>` as `str(owner)` writes it; ValueError naming `source` otherwise."""
        pid, sep, create_time = value.partition(":")
        try:
            if not sep:
                raise ValueError("no ':'")
            return cls(int(pid), float(create_time))
        except ValueError as exc:
            raise ValueError(
                f"{source}={value!r}: expected <pid>:<create time> as the launcher writes it ({exc})"
            ) from exc

    def __str__(self) -> str:
        return f"{self.pid}:{self.create_time!r}"

    def alive(self) -> bool:
        """The same process (pid and start time) still runs and is not a zombie."""
        try:
            proc = psutil.Process(self.pid)
            same = abs(proc.create_time() - self.create_time) < CREATE_TIME_TOLERANCE_S
            return same and proc.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False


def owner_from_environment() -> Owner | None:
    """The owner the launcher named in FORGE_LAUNCH_OWNER; None for a process nobody launched."""
    value = os.environ.get(OWNER_ENV)
    return Owner.parse(value) if value else None


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
    """OwnerGone when this process was launched by an owner that is gone (the pre-commit check).

    A no-op for a process without FORGE_LAUNCH_OWNER.
    """
    owner = owner_from_environment()
    if owner is not None and not owner.alive():
        raise OwnerGone(
            f"not committing {uri or 'the artifact'}: the launch's owner (pid {owner.pid}, the flow process "
            "that launched this worker) is gone; this worker ends itself and a new flow run recomputes the stage"
        )
