"""Turning a dead vLLM engine core into an error instead of a hang.

vLLM's synchronous client waits on its output queue with no timeout, and when the engine core process dies
nothing wakes that waiter, so `LLM.generate` would block until the stage deadline. `EngineDeathWatch` puts
vLLM's `EngineDeadError` into that queue when a watched engine process dies: `generate` raises it, and the
launcher retries the stage. Interpreter teardown then hangs too (the dead client's ZMQ context), so after an
engine death the process leaves with `os._exit` from an exit handler registered by the first watch; handlers
registered after it still run first, so the error is recorded by then. A killed engine core cannot remove the
shared-memory queues its executor made for its workers (160 MiB each in /dev/shm): the watch removes the ones it
saw the dead processes map and this process does not.

    watch = EngineDeathWatch(llm, engine_pids).start()
    ...
    watch.stop()            # before shutting the engine down on purpose
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading

import psutil

from forge_core.timings import ENGINE_WATCH_POLL_S

log = logging.getLogger(__name__)

ENGINE_PROCESS_NAME = "VLLM::EngineCore"
_EXIT_RETRYABLE = 75  # forge_core.launch.EXIT_RETRYABLE (EX_TEMPFAIL), when no exception was recorded
_engine_died = threading.Event()
_exit_hook_lock = threading.Lock()
_exit_hook_installed = False


def engine_core_processes() -> list[psutil.Process]:
    """This process's vLLM engine core processes (vLLM retitles them; comm keeps 15 characters)."""
    found = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if proc.name().startswith(ENGINE_PROCESS_NAME[:15]) or proc.cmdline()[:1] == [
                ENGINE_PROCESS_NAME
            ]:
                found.append(proc)
        except psutil.Error:
            continue
    return found


class EngineDeathWatch:
    """Daemon thread: when one of `engine_pids` dies, fail the engine's pending and future outputs."""

    def __init__(self, llm, engine_pids: list[int]) -> None:
        self._client = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        self._processes = [p for p in (_process(pid) for pid in engine_pids) if p is not None]
        self._segments: dict[int, set[str]] = {p.pid: set() for p in self._processes}
        self._record_segments()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="forge-vllm-engine-watch", daemon=True)

    def start(self) -> EngineDeathWatch:
        if self._processes:  # an in-process engine has no process to watch
            _install_exit_hook()
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(ENGINE_WATCH_POLL_S):
            dead = [p for p in self._processes if not _alive(p)]
            if dead:
                self._fail_outputs(dead)
                self._remove_segments(dead)
                return
            self._record_segments()

    def _record_segments(self) -> None:
        """Add what the engine processes map now: an engine maps its queues one by one after it starts."""
        for proc in self._processes:
            self._segments[proc.pid] |= shared_memory_of([proc, *_children(proc)])

    def _remove_segments(self, dead: list[psutil.Process]) -> None:
        ours = shared_memory_of([psutil.Process()])
        for path in sorted({path for p in dead for path in self._segments.get(p.pid, ())} - ours):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                log.info("removed %s, a shared-memory queue of the dead vLLM engine", path)

    def _fail_outputs(self, dead: list[psutil.Process]) -> None:
        from vllm.v1.engine.exceptions import EngineDeadError

        what = f"vLLM engine core process(es) {[p.pid for p in dead]} died"
        print(f"[forge.rollout] {what}; failing the pending generation", file=sys.stderr, flush=True)
        _engine_died.set()
        outputs = getattr(self._client, "outputs_queue", None)
        if outputs is None:
            log.error(
                "%s, and this vLLM client has no output queue to fail: the stage deadline will end it", what
            )
            return
        outputs.put_nowait(EngineDeadError())


def _install_exit_hook() -> None:
    global _exit_hook_installed
    with _exit_hook_lock:
        if not _exit_hook_installed:
            atexit.register(_exit_without_finalizing_after_engine_death)
            _exit_hook_installed = True


def _exit_without_finalizing_after_engine_death() -> None:
    if not _engine_died.is_set():
        return
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_EXIT_RETRYABLE)


SHARED_MEMORY_PREFIX = "/dev/shm/psm_"  # Python's multiprocessing.shared_memory, as vLLM's queues use it


def shared_memory_of(processes: list[psutil.Process]) -> set[str]:
    """The shared-memory segments `processes` map (a process gone or unreadable maps none)."""
    found = set()
    for proc in processes:
        try:  # /proc/<pid>/maps, not psutil's memory_maps (smaps): cheap enough for every poll
            with open(f"/proc/{proc.pid}/maps") as maps:
                found.update(line.split(None, 5)[-1].strip() for line in maps if SHARED_MEMORY_PREFIX in line)
        except OSError:  # gone, unreadable, or no /proc (macOS)
            continue
    return found


def _children(proc: psutil.Process) -> list[psutil.Process]:
    try:
        return proc.children(recursive=True)
    except psutil.Error:
        return []


def _process(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.Error:
        return None


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
