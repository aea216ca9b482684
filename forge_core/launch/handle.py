"""Starting a launch, supervising it on a thread, and the registry of live launches."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from forge_core.launch import classify, registry
from forge_core.launch.errors import Category
from forge_core.launch.heartbeat import read_heartbeats, stall_note
from forge_core.launch.output import LogSink, OutputPump
from forge_core.launch.process_tree import ExitStatus, ProcessTree, peek_exit_status
from forge_core.launch.result import LaunchResult, Outcome, RankError
from forge_core.launch.spec import LaunchSpec, build_command, build_env
from forge_core.timings import (
    LAUNCH_KILL_WAIT_S,
    LAUNCH_OUTPUT_DRAIN_S,
    LAUNCH_POLL_S,
    LAUNCH_SHUTDOWN_MARGIN_S,
    LAUNCH_SNAPSHOT_EVERY_S,
)

_logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Stop:
    """Why the launcher itself ended the launch."""

    outcome: Outcome
    reason: str
    at: float = field(default_factory=time.time)  # wall clock, comparable with the ranks' heartbeats


class LaunchHandle:
    """A running launch, created by `start`: `wait()` for its `LaunchResult`, `cancel()` it from any thread,
    `pids()` to inspect. A supervisor thread enforces the deadline and cancellation and ends the whole tree."""

    def __init__(self, spec: LaunchSpec, log: LogSink, cancel_event: threading.Event | None):
        self.spec = spec
        self.launch_id = uuid.uuid4().hex[:16]
        self._external_cancel = cancel_event
        self._cancel = threading.Event()
        self._cancel_reason = "cancelled"
        self._done = threading.Event()
        self._result: LaunchResult | None = None
        self._workdir = tempfile.mkdtemp(prefix=f"forge-launch-{self.launch_id}-")
        self._log_dir = os.path.join(self._workdir, "torchrun-logs")
        self._root_error_file = os.path.join(self._workdir, "root_error.json")
        self._heartbeat_dir = os.path.join(self._workdir, "heartbeats")
        os.mkdir(self._heartbeat_dir)
        self._started = time.monotonic()
        try:
            self._proc = subprocess.Popen(
                build_command(spec, self._log_dir),
                env=build_env(spec, self.launch_id, self._root_error_file, self._heartbeat_dir),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                # Our own session: a terminal's Ctrl-C or the caller's process-group signals do not hit it.
                start_new_session=True,
            )
        except BaseException:
            shutil.rmtree(self._workdir, ignore_errors=True)
            raise
        self._tree = ProcessTree(self._proc.pid, self.launch_id)
        self._note_in_registry()
        self._pump = OutputPump(
            self._proc.stdout,
            log,
            rank0_only=spec.rank0_only_logs,
            tail_lines=spec.tail_lines,
            plain_rank=None if spec.torchrun else 0,
        ).start()
        self._supervisor = threading.Thread(
            target=self._supervise, name=f"forge-launch-{self.launch_id}", daemon=True
        )

    def _note_in_registry(self) -> None:
        """Let a later flow run end this launch if this process dies without doing it (registry.py)."""
        try:
            registry.record_launch(self.launch_id, self._proc.pid, self.spec.module)
        except OSError as exc:  # the launch itself is fine; only the orphan clean-up would miss it
            _logger.warning("launch %s: cannot write its registry record: %s", self.launch_id, exc)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def pids(self) -> list[int]:
        """Live pids of the launch: the root (torchrun or the worker) first, then its descendants."""
        return self._tree.live_pids()

    def cancel(self, reason: str = "cancelled") -> None:
        self._cancel_reason = reason
        self._cancel.set()

    def kill_now(self) -> list[int]:
        """SIGKILL the whole tree at once (the supervisor still reaps and classifies it); returns the pids."""
        if not self._cancel.is_set():
            self.cancel("killed at once")
        return self._tree.kill_now()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> LaunchResult:
        """Block until the launch ended and was cleaned up; TimeoutError if `timeout` passes first."""
        if not self._done.wait(timeout):
            raise TimeoutError(
                f"launch {self.launch_id} ({self.spec.module}) still running after {timeout} s"
            )
        assert self._result is not None
        return self._result

    def _start_supervisor(self) -> LaunchHandle:
        self._supervisor.start()
        return self

    def _supervise(self) -> None:
        stop: _Stop | None = None
        status: ExitStatus | None = None
        try:
            status, stop = self._watch()
            if stop is not None:
                self._pump.emit_own(
                    f"{stop.reason}: ending the process tree (SIGTERM, SIGKILL after {self.spec.kill_grace_s:g} s)"
                )
                killed = self._tree.terminate(self.spec.kill_grace_s)
                self._pump.emit_own(f"process tree ended; SIGKILL was needed for pids {killed}")
            status = self._reap()
            self._end_leftovers()
            if not self._pump.join(LAUNCH_OUTPUT_DRAIN_S):
                self._pump.emit_own("output pipe still open after the launch ended; tail may be incomplete")
            self._result = self._classify(status, stop)
        except BaseException as e:  # a supervisor bug must still end the tree and release the waiter
            _logger.exception("launch %s supervisor failed", self.launch_id)
            self._terminate_after_supervisor_error()
            self._result = LaunchResult(
                outcome=Outcome.RETRYABLE,
                returncode=status.returncode if status else None,
                reason=f"launcher error: {type(e).__name__}: {e}",
                tail=self._pump.snapshot()[0],
                duration_s=time.monotonic() - self._started,
                launch_id=self.launch_id,
            )
        finally:
            shutil.rmtree(self._workdir, ignore_errors=True)
            with contextlib.suppress(OSError):
                registry.forget_launch(self.launch_id)
            _unregister(self)
            self._done.set()

    def _terminate_after_supervisor_error(self) -> None:
        try:
            self._tree.terminate(self.spec.kill_grace_s)
        except Exception:
            _logger.exception("launch %s: could not end its process tree", self.launch_id)

    def _watch(self) -> tuple[ExitStatus | None, _Stop | None]:
        """Poll until the root exits (its status) or the launcher must stop it (the reason)."""
        deadline = self._started + self.spec.deadline_s
        next_snapshot = 0.0
        while True:
            status = peek_exit_status(self._proc.pid)
            if status is not None:
                return status, None
            if self._cancel.is_set() or (
                self._external_cancel is not None and self._external_cancel.is_set()
            ):
                return None, _Stop(Outcome.CANCELLED, self._cancel_reason)
            now = time.monotonic()
            if now >= deadline:
                return None, _Stop(Outcome.RETRYABLE, f"deadline of {self.spec.deadline_s:g} s exceeded")
            if now >= next_snapshot:
                # Remember descendants while the tree is intact: once torchrun dies they are reparented.
                self._tree.snapshot()
                next_snapshot = now + LAUNCH_SNAPSHOT_EVERY_S
            self._cancel.wait(LAUNCH_POLL_S)

    def _reap(self) -> ExitStatus:
        """Read the root's real status, then let Popen (and only Popen) reap it."""
        status = None
        while status is None:
            status = peek_exit_status(self._proc.pid)
            if status is None:
                time.sleep(LAUNCH_POLL_S)
        self._proc.wait()
        if not status.lost and self._proc.returncode != status.returncode:
            # Someone reaped between our peek and Popen's wait; Popen's number is the ECHILD fallback.
            self._pump.emit_own(
                f"root pid {self._proc.pid} was reaped by another waiter; using its real exit status "
                f"{status.returncode} instead of Popen's {self._proc.returncode}"
            )
        return status

    def _end_leftovers(self) -> None:
        leftovers = self._tree.kill_leftovers(grace_s=min(self.spec.kill_grace_s, 2.0))
        if leftovers:
            self._pump.emit_own(f"ended processes left behind by the launch: pids {leftovers}")

    def _classify(self, status: ExitStatus, stop: _Stop | None) -> LaunchResult:
        tail, summary_lines, last_exception = self._pump.snapshot()
        rank_errors = self._rank_errors(status, summary_lines, last_exception)
        if stop is not None:
            outcome, reason = stop.outcome, stop.reason
        elif status.lost:
            decision = classify.decide_failure(rank_errors, "")
            outcome = Outcome.FATAL if decision.outcome is Outcome.FATAL else Outcome.RETRYABLE
            reason = (
                f"exit status of pid {self._proc.pid} lost (reaped by another waiter; Popen would report 0): "
                "not treated as success" + (f"; {decision.reason}" if decision.reason else "")
            )
        elif status.returncode == 0:
            outcome, reason = Outcome.SUCCESS, "exited with code 0"
        else:
            outcome, reason = self._decide_failure(status, rank_errors)
        stall = self._stall(outcome, stop, rank_errors)
        return LaunchResult(
            outcome=outcome,
            returncode=status.returncode,
            reason=f"{reason}; {stall}" if stall else reason,
            tail=tail,
            rank_errors=rank_errors,
            duration_s=time.monotonic() - self._started,
            launch_id=self.launch_id,
            stall=stall,
        )

    def _stall(self, outcome: Outcome, stop: _Stop | None, rank_errors: dict[int, RankError]) -> str:
        """The heartbeat note on which rank stopped making progress, for a launch the launcher stopped or one
        that failed retryably, with no rank killed by a signal, and some rank behind the others."""
        first = self.spec.node_rank * self.spec.nproc_per_node if self.spec.torchrun else 0
        ranks = range(first, first + (self.spec.nproc_per_node if self.spec.torchrun else 1))
        beats = read_heartbeats(self._heartbeat_dir)
        if stop is not None:
            event = "the deadline" if stop.outcome is Outcome.RETRYABLE else "the launch was stopped"
            return stall_note(beats, ranks, stop.at, event)
        if outcome is not Outcome.RETRYABLE or any(map(_killed, rank_errors.values())):
            return ""  # a rank's death explains the failure by itself
        stamps = [e.timestamp for e in rank_errors.values() if e.timestamp is not None]
        return stall_note(beats, ranks, min(stamps, default=time.time()), "the failure", when_level=False)

    def _rank_errors(
        self, status: ExitStatus, summary_lines: list[str], last_exception: dict[int, tuple[str, str]]
    ) -> dict[int, RankError]:
        if not self.spec.torchrun:
            return classify.plain_rank_errors(self._root_error_file, status.returncode, last_exception)
        return classify.torchrun_rank_errors(
            self._log_dir,
            summary_lines,
            last_exception,
            first_global_rank=self.spec.node_rank * self.spec.nproc_per_node,
        )

    def _decide_failure(self, status: ExitStatus, rank_errors: dict[int, RankError]) -> tuple[Outcome, str]:
        what = "torchrun" if self.spec.torchrun else self.spec.module
        fallback = f"{what} exited with code {status.returncode}; no rank reported an error (see tail)"
        if not rank_errors and self.spec.torchrun:
            agent = classify.agent_error_reason(self._root_error_file)
            if agent is not None:
                category, reason = agent
                return (Outcome.FATAL if category is Category.FATAL else Outcome.RETRYABLE), reason
        decision = classify.decide_failure(rank_errors, fallback)
        return decision.outcome, decision.reason


def _killed(error: RankError) -> bool:
    """Killed by a signal other than torchrun's SIGTERM to the survivors of a failed rank."""
    return error.exitcode is not None and error.exitcode < 0 and error.exitcode != -signal.SIGTERM


_live: dict[str, LaunchHandle] = {}
_live_lock = threading.Lock()
# What else this process started that must end with its launches, each as the `stop(reason)` that ends it
# (bounded by itself): terminate_all_live ends them with the launches.
_stops: dict[int, Callable[[str], object]] = {}
_hooks_installed = False
_previous_sigterm = None
_sigterms = 0


def start(
    spec: LaunchSpec, log: LogSink = print, cancel_event: threading.Event | None = None
) -> LaunchHandle:
    """Start `spec` and return its handle at once (outcomes: see the package docstring)."""
    _install_exit_hooks()
    handle = LaunchHandle(spec, log, cancel_event)
    with _live_lock:
        _live[handle.launch_id] = handle
    return handle._start_supervisor()


def launch(
    spec: LaunchSpec, log: LogSink = print, cancel_event: threading.Event | None = None
) -> LaunchResult:
    """Run `spec` to the end and return its `LaunchResult` (never raises for a failed launch)."""
    return start(spec, log, cancel_event).wait()


def live_handles() -> list[LaunchHandle]:
    with _live_lock:
        return list(_live.values())


def terminate_all_live(
    reason: str = "terminated by terminate_all_live", timeout_s: float | None = None
) -> list[LaunchResult]:
    """Cancel every live launch of this process and wait for their trees to be gone, all at once.

    Also runs at interpreter exit and on SIGTERM. Trees end in parallel (SIGTERM, `kill_grace_s`, SIGKILL);
    a tree still there after `timeout_s` (default: the largest kill grace + LAUNCH_SHUTDOWN_MARGIN_S) is
    SIGKILLed and given LAUNCH_KILL_WAIT_S more. So this returns within max(kill_grace_s) + 10 s, inside
    Prefect's 30 s between a cancel's SIGTERM and its SIGKILL.
    """
    handles = live_handles()
    for handle in handles:
        handle.cancel(reason)
    stops = _run_stops(reason)
    if timeout_s is None:
        timeout_s = max((h.spec.kill_grace_s for h in handles), default=0.0) + LAUNCH_SHUTDOWN_MARGIN_S
    deadline = time.monotonic() + timeout_s
    for handle in handles:
        try:
            handle.wait(max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            pids = handle.kill_now()
            _logger.error(
                "launch %s did not end within %.0f s after cancel: SIGKILLed pids %s",
                handle.launch_id, timeout_s, pids,
            )  # fmt: skip
    results = []
    for handle in handles:
        try:
            results.append(handle.wait(LAUNCH_KILL_WAIT_S))
        except TimeoutError:
            _logger.error("launch %s did not end even after SIGKILL", handle.launch_id)
    for thread in stops:
        thread.join(max(0.0, deadline + LAUNCH_KILL_WAIT_S - time.monotonic()))
    return results


def add_stop(stop: Callable[[str], object]) -> Callable[[], None]:
    """Have `terminate_all_live` also call `stop(reason)`, for something else this process started (an attempt
    on other machines, helper processes); returns what removes it again."""
    token = id(stop)
    with _live_lock:
        _stops[token] = stop
    _install_exit_hooks()

    def remove() -> None:
        with _live_lock:
            _stops.pop(token, None)

    return remove


def _run_stops(reason: str) -> list[threading.Thread]:
    """Start every registered stop on a thread of its own (they end in parallel with the launches)."""
    with _live_lock:
        stops = list(_stops.values())
    threads = [threading.Thread(target=stop, args=(reason,), name="forge-remote-stop", daemon=True) for stop in stops]
    for thread in threads:
        thread.start()
    return threads


def kill_all_live() -> list[int]:
    """SIGKILL the trees of every live launch of this process at once (no grace); returns their pids."""
    return sorted({pid for handle in live_handles() for pid in handle.kill_now()})


def install_sigterm_handler() -> bool:
    """Make SIGTERM end all live launches before the previous handler runs; returns whether it is installed.
    Main thread only: a program that launches from worker threads calls it once from its main thread."""
    global _previous_sigterm
    if threading.current_thread() is not threading.main_thread():
        return False
    current = signal.getsignal(signal.SIGTERM)
    if current is _on_sigterm:
        return True
    _previous_sigterm = current
    signal.signal(signal.SIGTERM, _on_sigterm)
    return True


def _on_sigterm(signum: int, frame) -> None:
    """First SIGTERM: end every launch (bounded: terminate_all_live). A second one while that runs: SIGKILL
    every tree at once."""
    global _sigterms
    _sigterms += 1
    if _sigterms == 1:
        terminate_all_live(reason="launching process received SIGTERM")
    else:
        _logger.warning("SIGTERM again: SIGKILL of every launch's process tree, pids %s", kill_all_live())
    previous = _previous_sigterm
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_IGN:
        return
    else:  # SIG_DFL (or unknown): die from the signal as we would have without this handler
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


def _install_exit_hooks() -> None:
    global _hooks_installed
    with _live_lock:
        if not _hooks_installed:
            atexit.register(terminate_all_live, reason="launching process exiting")
            _hooks_installed = True
    install_sigterm_handler()


def _unregister(handle: LaunchHandle) -> None:
    with _live_lock:
        _live.pop(handle.launch_id, None)
