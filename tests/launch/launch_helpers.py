"""Helpers for the launcher tests: a line recorder and pid bookkeeping (imported by the test modules)."""

import os
import threading
import time
from pathlib import Path

import psutil


class LineRecorder:
    """A log sink that keeps every line it receives, in arrival order."""

    def __init__(self):
        self.lines: list[str] = []
        self._lock = threading.Lock()

    def __call__(self, line: str) -> None:
        with self._lock:
            self.lines.append(line)


def wait_for_pid_files(pid_dir: Path, names: list[str], timeout_s: float = 180.0) -> dict[str, int]:
    """Block until every `<name>.pid` exists and is complete; return name -> pid."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = {
            n: (pid_dir / f"{n}.pid").read_text().strip() for n in names if (pid_dir / f"{n}.pid").exists()
        }
        if len(found) == len(names) and all(v.isdigit() for v in found.values()):
            return {n: int(v) for n, v in found.items()}
        time.sleep(0.1)
    raise AssertionError(
        f"pid files {names} not all written within {timeout_s} s: {sorted(os.listdir(pid_dir))}"
    )


def processes_of(pids) -> list[psutil.Process]:
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue
    return procs


def still_running(procs: list[psutil.Process]) -> list[psutil.Process]:
    """Processes that run on (same pid and start time, not a zombie waiting for init to reap it)."""
    alive = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
        except psutil.NoSuchProcess:
            continue
    return alive


class PidCollector:
    """Polls `handle.pids()` (and pid files the workers write) during a launch, keeping every process seen."""

    def __init__(self, handle, pid_dir: Path | None = None):
        self._handle = handle
        self._pid_dir = pid_dir
        self.seen: dict[tuple[int, float], psutil.Process] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def add(self, procs) -> None:
        for proc in procs:
            try:
                self.seen.setdefault((proc.pid, proc.create_time()), proc)
            except psutil.NoSuchProcess:
                continue

    def _run(self) -> None:
        while not self._stop.is_set() and not self._handle.done():
            self.add(processes_of(self._handle.pids()))
            self.add(processes_of(self._pids_from_files()))
            self._stop.wait(0.2)

    def _pids_from_files(self) -> list[int]:
        if self._pid_dir is None:
            return []
        texts = (p.read_text().strip() for p in self._pid_dir.glob("*.pid"))
        return [int(t) for t in texts if t.isdigit()]

    @property
    def processes(self) -> list[psutil.Process]:
        return list(self.seen.values())
