"""Finding and ending every process of a launch, and reading the root's exit status without reaping it.

torchrun starts each rank in its own session, so killpg(torchrun) misses them: the tree is tracked with
psutil snapshots plus a scan for the launch's FORGE_LAUNCH_ID (finds processes already reparented away).
A descendant that carries ANOTHER launch id belongs to that launch and is left alone.

The root's exit status is read with waitid(WNOWAIT), leaving the zombie for Popen to reap: if anything else
reaps it first, Popen reports returncode 0 for a process that may have been killed. So psutil's
wait()/wait_procs(), which reap children, are never used on the root.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

import psutil

from forge_core.launch.spec import LAUNCH_ID_ENV
from forge_core.timings import PROCESS_TREE_POLL_S


@dataclass(frozen=True)
class ExitStatus:
    """`returncode` as Popen reports it (negative = killed by that signal); None = the status was lost."""

    returncode: int | None

    @property
    def lost(self) -> bool:
        return self.returncode is None


STATUS_LOST = ExitStatus(None)


def peek_exit_status(pid: int) -> ExitStatus | None:
    """The exit status of our child `pid` if it has exited (without reaping it), else None; STATUS_LOST
    when someone other than its Popen object already reaped it."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return STATUS_LOST
    if info is None or info.si_pid == 0:
        return None
    if info.si_code == os.CLD_EXITED:
        return ExitStatus(info.si_status)
    return ExitStatus(-info.si_status)


def is_alive(proc: psutil.Process) -> bool:
    """Running and not a zombie (a zombie holds no resources; only its parent can reap it)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def processes_with_launch_id(launch_id: str, include_ancestors: bool = False) -> list[psutil.Process]:
    """Every process whose environment carries FORGE_LAUNCH_ID=<launch_id>, this one excluded, and its
    ancestors too unless `include_ancestors` (a rank ending its own launch includes torchrun's agent)."""
    own = {os.getpid(), *(() if include_ancestors else (p.pid for p in _ancestors()))}
    found = []
    for proc in psutil.process_iter():
        if proc.pid in own:
            continue
        try:
            if proc.environ().get(LAUNCH_ID_ENV) == launch_id:
                found.append(proc)
        except psutil.Error:
            continue  # gone, or another user's process
    return found


def _ancestors() -> list[psutil.Process]:
    try:
        return psutil.Process().parents()
    except psutil.Error:
        return []


class ProcessTree:
    """The processes of one launch seen so far: the root plus every descendant any snapshot found.
    Thread-safe (the supervisor and callers of `LaunchHandle.pids()` snapshot concurrently)."""

    def __init__(self, root_pid: int, launch_id: str):
        self.root = psutil.Process(root_pid)
        self.launch_id = launch_id
        self._seen: dict[tuple[int, float], psutil.Process] = {}
        self._lock = threading.Lock()

    def snapshot(self, *, include_launch_id_scan: bool = False) -> list[psutil.Process]:
        """Refresh from the live tree (and optionally the environment scan); return what is alive now."""
        found = descendants(self.root.pid) if is_alive(self.root) else []
        if include_launch_id_scan:
            found += processes_with_launch_id(self.launch_id)
        keyed = [(key, proc) for proc in found if (key := _identity(proc)) is not None]
        with self._lock:
            for key, proc in keyed:
                self._seen.setdefault(key, proc)
            seen = list(self._seen.values())
        # Checked on every call, not only when first seen: a child caught between fork and exec still
        # shows its parent's environment.
        return [p for p in seen if is_alive(p) and not _of_another_launch(p, self.launch_id)]

    def live_pids(self) -> list[int]:
        live = self.snapshot()
        root = [self.root.pid] if is_alive(self.root) else []
        return root + sorted(p.pid for p in live if p.pid != self.root.pid)

    def terminate(self, grace_s: float) -> list[int]:
        """SIGTERM the root and every known descendant, wait up to `grace_s`, SIGKILL what is left; returns
        the pids that needed SIGKILL. Never reaps the root."""
        targets = [self.root, *self.snapshot(include_launch_id_scan=True)]
        _send(targets, signal.SIGTERM)
        _wait_gone(targets, grace_s)
        # Anything spawned during the grace period is caught by a second snapshot.
        survivors = [p for p in [self.root, *self.snapshot(include_launch_id_scan=True)] if is_alive(p)]
        _send(survivors, signal.SIGKILL)
        _wait_gone(survivors, timeout_s=5.0)
        return sorted({p.pid for p in survivors})

    def kill_now(self) -> list[int]:
        """SIGKILL the root and every known or findable process of the launch at once (the escalation of a
        terminate that takes too long); returns their pids. Never reaps the root."""
        targets = [p for p in [self.root, *self.snapshot(include_launch_id_scan=True)] if is_alive(p)]
        _send(targets, signal.SIGKILL)
        return sorted({p.pid for p in targets})

    def kill_leftovers(self, grace_s: float) -> list[int]:
        """After the root exited: end whatever of the launch is still running; returns their pids."""
        leftovers = self.snapshot(include_launch_id_scan=True)
        if not leftovers:
            return []
        _send(leftovers, signal.SIGTERM)
        _wait_gone(leftovers, grace_s)
        survivors = [p for p in leftovers if is_alive(p)]
        _send(survivors, signal.SIGKILL)
        _wait_gone(survivors, timeout_s=5.0)
        return sorted(p.pid for p in leftovers)


def end_processes(processes: list[psutil.Process], grace_s: float) -> list[int]:
    """SIGTERM `processes`, wait up to `grace_s`, SIGKILL the survivors; returns the pids that needed SIGKILL.
    For processes that are not our children (orphans of a dead launcher): nothing here reaps anything."""
    _send(processes, signal.SIGTERM)
    _wait_gone(processes, grace_s)
    survivors = [p for p in processes if is_alive(p)]
    _send(survivors, signal.SIGKILL)
    _wait_gone(survivors, timeout_s=5.0)
    return sorted(p.pid for p in survivors)


def _of_another_launch(proc: psutil.Process, launch_id: str) -> bool:
    try:
        other = proc.environ().get(LAUNCH_ID_ENV)
    except psutil.Error:
        return False  # unreadable: keep it, ending too much beats leaking
    return other is not None and other != launch_id


def _identity(proc: psutil.Process) -> tuple[int, float] | None:
    try:
        return proc.pid, proc.create_time()
    except psutil.Error:
        return None


def _send(processes: Iterable[psutil.Process], sig: signal.Signals) -> None:
    for proc in processes:
        if not is_alive(proc):
            continue
        try:
            # psutil checks the pid still belongs to the same process (create time) before signalling.
            proc.send_signal(sig)
        except psutil.Error:
            continue


def _wait_gone(processes: list[psutil.Process], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while any(is_alive(p) for p in processes) and time.monotonic() < deadline:
        time.sleep(PROCESS_TREE_POLL_S)
