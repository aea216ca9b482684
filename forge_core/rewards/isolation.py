"""Reward functions run in worker processes, each call bounded in time, so user code cannot hang or crash the
calling process.

    rewards = RewardSet.from_config(cfg.rollout.rewards, isolation=RewardIsolation.from_config(cfg.rollout))
    scored = rewards.score(completions, ground_truths, refs)     # scored in the workers of this process's pool
    scored.failures       # {"reward/timeouts": 0, "reward/crashes": 0, "reward/zeroed": 0}

The samples are split into `workers` contiguous slices, each scored by one reused worker process. A sample's
values are bit for bit those of in-process scoring; an exception or non-finite value is a RewardFunctionError
(fatal). On a timeout or a dead worker, a fresh worker rescores the slice from that sample; a sample failing
MAX_ATTEMPTS times scores 0 and is counted, and more zeroed samples than `failure_limit` fail the stage with a
RewardFunctionError: a reward failing on everything is a bug, not a worse policy.

Workers run user code, so they get an allow-listed environment (`worker_environment`), never the parent's
credentials unless `rollout.worker_env_allow` names them. A call result (a tool's) over `max_result_bytes`
pickled never leaves its worker: it is an outcome of kind CALL_TOO_LARGE.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Protocol

from forge_core.launch import add_stop
from forge_core.launch.errors import RetryableStageError
from forge_core.launch.owner import Owner
from forge_core.rewards.registry import RewardFunctionError
from forge_core.timings import REWARD_WORKER_STARTUP_S

if TYPE_CHECKING:
    from forge_core.config.schema import RewardComponentConfig, RolloutConfig

log = logging.getLogger(__name__)

WORKER_MODULE = "forge_core.rewards.worker"
MAX_ATTEMPTS = 2
FAILURE_FRACTION = 0.1
FAILURE_FLOOR = 3
TIMEOUTS, CRASHES, ZEROED = "reward/timeouts", "reward/crashes", "reward/zeroed"
# What a worker keeps of its parent's environment besides LC_* and PYTHONPATH: what Python, locales and temp
# files need, and FORGE_LAUNCH_ID, by which a launch's process tree is found and ended.
WORKER_ENV = (
    "PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TMPDIR", "TEMP", "TMP", "LD_LIBRARY_PATH",
    "PYTHONHASHSEED", "OMP_NUM_THREADS", "FORGE_LAUNCH_ID", "FORGE_STAGE",
)  # fmt: skip
DEFAULT_MAX_RESULT_BYTES = 64 * 1024


def no_failures() -> dict[str, int]:
    return {TIMEOUTS: 0, CRASHES: 0, ZEROED: 0}


def worker_environment(allow: Sequence[str] = ()) -> dict[str, str]:
    """This process's variables in WORKER_ENV, LC_* or `allow`, and its import path as PYTHONPATH (so a worker
    imports the same reward modules the parent resolved)."""
    keep = set(WORKER_ENV) | set(allow)
    env = {name: value for name, value in os.environ.items() if name in keep or name.startswith("LC_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return env


def failure_limit(samples: int) -> int:
    """The most samples a batch may score 0 (after MAX_ATTEMPTS each) before the stage fails."""
    return max(FAILURE_FLOOR, math.floor(FAILURE_FRACTION * samples))


@dataclass(frozen=True)
class RewardIsolation:
    """Per-sample timeout, worker count and extra environment variables of the reward workers."""

    timeout_s: float = 30.0
    workers: int = 1
    env_allow: tuple[str, ...] = ()

    @classmethod
    def from_config(cls, rollout: RolloutConfig) -> RewardIsolation:
        return cls(
            timeout_s=float(rollout.reward_timeout_s),
            workers=int(rollout.reward_workers),
            env_allow=tuple(rollout.worker_env_allow),
        )


class IsolatedRewards(Protocol):
    """What the pool needs of a RewardSet: the configs a worker rebuilds it from, its components, versions."""

    configs: list[RewardComponentConfig] | None
    section: str
    components: tuple

    def versions(self) -> dict[str, str]: ...


CALL_RAISED, CALL_TIMEOUT, CALL_CRASHED, CALL_TOO_LARGE = "raised", "timeout", "crashed", "too_large"


@dataclass(frozen=True)
class CallOutcome:
    """One isolated call's `value`, or its `kind` (a CALL_* constant) and `error`; `latency_s` is the call's
    time, or the wait for one that never answered."""

    value: object = None
    error: str = ""
    kind: str = ""
    latency_s: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.kind


class RewardWorkerError(RetryableStageError):
    """A reward worker could not start (or build the rewards) in time: the machine, not the samples."""


class _Failed(Exception):
    """One attempt at a sample failed: the worker timed out or died."""

    def __init__(self, kind: str, detail: str):
        super().__init__(detail)
        self.kind = kind


class SampleProgress:
    """Which sample of its score request a worker is scoring, and since when: a record in memory the pool and
    its worker share (a memfd the worker gets as an inherited descriptor). The worker writes it before each
    sample; the pool reads it when the worker is silent or dead, to charge the hang or crash to that sample
    although the worker sends its answers in batches. Times are CLOCK_MONOTONIC, one clock for every process
    of the host."""

    _RECORD = struct.Struct("=qd")  # position in the request (-1: none started), start time

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._map = mmap.mmap(fd, self._RECORD.size)

    @classmethod
    def create(cls) -> SampleProgress:
        fd = os.memfd_create("forge-reward-progress")
        os.ftruncate(fd, cls._RECORD.size)
        return cls(fd)

    def start(self, position: int) -> None:
        """Record that sample `position` of the request starts now (`-1`: a request is on its way)."""
        self._RECORD.pack_into(self._map, 0, position, time.monotonic())

    def read(self) -> tuple[int, float]:
        """(position, monotonic start time) of the sample last started."""
        position, since = self._RECORD.unpack_from(self._map, 0)
        return position, since

    def close(self) -> None:
        self._map.close()
        os.close(self.fd)


class _Worker:
    """One reward worker process (environment: `worker_environment(env_allow)`), our end of its channel and the
    record of the sample it scores."""

    def __init__(self, env_allow: tuple[str, ...]) -> None:
        self.env_allow = env_allow
        ours, theirs = socket.socketpair()
        self.progress = SampleProgress.create()
        env = worker_environment(env_allow)
        owner = str(Owner.this_process())
        command = [
            sys.executable, "-m", WORKER_MODULE, "--fd", str(theirs.fileno()),
            "--progress", str(self.progress.fd), "--owner", owner,
        ]  # fmt: skip
        try:
            self.proc = subprocess.Popen(
                command, pass_fds=[theirs.fileno(), self.progress.fd], stdin=subprocess.DEVNULL, env=env
            )
        except BaseException:
            self.progress.close()
            ours.close()
            raise
        finally:
            theirs.close()
        self.conn = Connection(ours.detach())

    def request(self, message: dict) -> None:
        """Send a score request and wait until the worker has its rewards built (imports included)."""
        self.progress.start(-1)
        self.conn.send(("score", message))
        kind, _, payload = self.next_answer(REWARD_WORKER_STARTUP_S, "to build the rewards")
        if kind == "error":
            raise RewardFunctionError(payload)
        assert kind == "ready", kind

    def next_answer(self, timeout_s: float, what: str = "per sample (rollout.reward_timeout_s)") -> tuple:
        """The worker's next message; _Failed when none comes within `timeout_s` or the worker died."""
        try:
            if not self.conn.poll(timeout_s):
                raise _Failed(TIMEOUTS, f"no answer within {timeout_s:g} s {what}")
            return self.conn.recv()
        except (EOFError, OSError) as exc:
            self.proc.wait()
            raise _Failed(CRASHES, f"the reward worker died ({_exit_text(self.proc.returncode)})") from exc

    def next_score_answer(self, timeout_s: float) -> tuple:
        """The worker's next message about a score request; _Failed when the sample it scores has run for
        `timeout_s` with no message, or the worker died (`scoring_position` names that sample)."""
        deadline = time.monotonic() + timeout_s
        while not self._poll_until(deadline):
            _, since = self.progress.read()
            deadline = max(deadline, since + timeout_s)  # each sample has timeout_s from its own start
            if time.monotonic() >= deadline:
                raise _Failed(TIMEOUTS, f"no answer within {timeout_s:g} s per sample (rollout.reward_timeout_s)")
        return self.next_answer(0.0)

    def _poll_until(self, deadline: float) -> bool:
        try:
            return self.conn.poll(max(0.0, deadline - time.monotonic()))
        except (EOFError, OSError):
            return True  # the next read raises _Failed for the dead worker

    def scoring_position(self) -> int:
        """The position in the current request of the sample the worker started last (-1: none)."""
        return self.progress.read()[0]

    def end(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.conn.close()
        self.progress.close()


def _exit_text(returncode: int | None) -> str:
    if returncode is not None and returncode < 0:
        return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


class RewardPool:
    """This process's reward workers (one slot per worker; a slot's process is replaced when it fails)."""

    def __init__(self) -> None:
        self._slots: list[_Worker | None] = []
        self._lock = threading.Lock()  # one scoring at a time: the workers are not shared between batches

    def score(
        self, rewards: IsolatedRewards, items: Sequence[tuple], isolation: RewardIsolation
    ) -> tuple[list[list[float]], dict[str, int]]:
        """Per-sample component values (in `rewards.components` order) and the failure counts; `items` holds
        `RewardSet.score_sample`'s arguments per sample. Raises RewardFunctionError or RewardWorkerError."""
        assert rewards.configs is not None, "isolated scoring needs a RewardSet built by from_config"
        with self._lock:
            slots = max(1, min(isolation.workers, len(items)))
            self._slots += [None] * (slots - len(self._slots))
            batch = _Batch(rewards, items, isolation, failure_limit(len(items)))
            bounds = [len(items) * k // slots for k in range(slots + 1)]
            jobs = [(slot, list(range(bounds[slot], bounds[slot + 1]))) for slot in range(slots)]
            if slots == 1:
                self._score_slice(batch, *jobs[0])
            else:
                threads = [
                    threading.Thread(
                        target=self._score_slice_safely, args=(batch, *job), name=f"forge-reward-{job[0]}"
                    )
                    for job in jobs
                ]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
            if batch.error is not None:
                raise batch.error
            return batch.values, batch.failures

    def _score_slice_safely(self, batch: _Batch, slot: int, indices: list[int]) -> None:
        try:
            self._score_slice(batch, slot, indices)
        except BaseException as exc:  # noqa: BLE001 - re-raised by score() on the caller's thread
            batch.fail(exc)

    def _score_slice(self, batch: _Batch, slot: int, indices: list[int]) -> None:
        todo = indices
        while todo and batch.error is None:
            worker = self._worker(slot, batch.isolation.env_allow)
            try:
                worker.request(batch.request(todo))
            except _Failed as failure:  # the worker could not even start: not the samples' fault
                self._replace(slot)
                raise RewardWorkerError(
                    f"reward worker pid {worker.proc.pid} did not start: {failure}"
                ) from None
            todo = self._collect(batch, slot, worker, todo)

    def _collect(self, batch: _Batch, slot: int, worker: _Worker, todo: list[int]) -> list[int]:
        """Read the answers to one request; returns what is left to score (empty when done). A sample that hung
        or crashed its worker is charged an attempt; the samples the worker scored but had not yet sent are
        scored again, uncharged."""
        received = 0
        while received < len(todo):
            try:
                kind, first, payload = worker.next_score_answer(batch.isolation.timeout_s)
            except _Failed as failure:
                failed = max(received, worker.scoring_position())
                self._replace(slot)
                retry = batch.attempt_failed(todo[failed], failure, worker.proc.pid)
                return todo[received:failed] + (todo[failed:] if retry else todo[failed + 1 :])
            assert first == received, f"reward worker answered from sample {first}, expected {received}"
            if kind == "error":
                batch.fail(RewardFunctionError(payload))
                return []
            for values in payload:
                batch.values[todo[received]] = values
                received += 1
        try:
            assert worker.next_score_answer(batch.isolation.timeout_s)[0] == "done"
        except _Failed:  # every sample was answered; only the worker is lost
            self._replace(slot)
        return []

    def call_each(
        self,
        fn: str,
        calls: Sequence[tuple[tuple, dict]],
        timeout_s: float,
        what: str = "per call",
        *,
        max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES,
        env_allow: Sequence[str] = (),
    ) -> list[CallOutcome]:
        """Run `fn` ('package.module:function') once per `(args, kwargs)` in a worker, each call bounded by
        `timeout_s`. A call that raises, hangs, kills its worker or returns more than `max_result_bytes`
        (pickled) is an outcome with an `error`, never an exception here; a fresh worker takes the next call.
        `env_allow` extends the worker's environment (`worker_environment`).

        Raises:
            ValueError: `fn` cannot be imported (a config mistake).
            RewardWorkerError: a worker cannot start.
        """
        outcomes: list[CallOutcome | None] = [None] * len(calls)
        with self._lock:
            if not self._slots:
                self._slots.append(None)
            todo = list(range(len(calls)))
            while todo:
                request = {"fn": fn, "max_result_bytes": max_result_bytes}
                todo = self._call_slice(request, calls, todo, outcomes, timeout_s, what, tuple(env_allow))
        assert all(o is not None for o in outcomes)
        return outcomes  # type: ignore[return-value]

    def _call_slice(
        self, request: dict, calls, todo: list[int], outcomes: list, timeout_s: float, what: str, env_allow
    ) -> list[int]:
        """One request for the calls `todo` to slot 0's worker; returns the calls left after a failure."""
        fn = request["fn"]
        worker = self._worker(0, env_allow)
        try:
            worker.conn.send(("call", {**request, "calls": [calls[i] for i in todo]}))
            kind, _, payload = worker.next_answer(REWARD_WORKER_STARTUP_S, f"to import {fn}")
        except _Failed as failure:
            self._replace(0)
            raise RewardWorkerError(f"worker pid {worker.proc.pid} did not start {fn}: {failure}") from None
        if kind == "error":
            raise ValueError(payload)
        for position, index in enumerate(todo):
            started = time.perf_counter()
            try:
                kind, answered, (value, seconds) = worker.next_answer(timeout_s, f"{what}")
            except _Failed as failure:
                self._replace(0)
                outcomes[index] = CallOutcome(
                    error=str(failure),
                    kind=CALL_TIMEOUT if failure.kind == TIMEOUTS else CALL_CRASHED,
                    latency_s=time.perf_counter() - started,
                )
                log.warning("%s call %d of %d: %s; the next call goes to a fresh worker", fn, index, len(calls), failure)
                return todo[position + 1 :]
            assert answered == position, f"worker answered call {answered}, expected {position}"
            if kind in (CALL_RAISED, CALL_TOO_LARGE):
                outcomes[index] = CallOutcome(error=value, kind=kind, latency_s=seconds)
            else:
                outcomes[index] = CallOutcome(value=value, latency_s=seconds)
        try:
            assert worker.next_answer(timeout_s)[0] == "done"
        except _Failed:  # every call was answered; only the worker is lost
            self._replace(0)
        return []

    def _worker(self, slot: int, env_allow: tuple[str, ...]) -> _Worker:
        """Slot `slot`'s live worker with exactly the environment `env_allow` asks for (else a fresh one)."""
        worker = self._slots[slot]
        if worker is not None and worker.env_allow != env_allow:
            self._replace(slot)
            worker = None
        if worker is None or worker.proc.poll() is not None:
            worker = self._slots[slot] = _Worker(env_allow)
        return worker

    def _replace(self, slot: int) -> None:
        worker, self._slots[slot] = self._slots[slot], None
        if worker is not None:
            worker.end()

    def close(self) -> None:
        """End every worker (they would also exit when this process does)."""
        for slot in range(len(self._slots)):
            self._replace(slot)


class _Batch:
    """One scoring call's shared state (slices may run on threads of their own)."""

    def __init__(self, rewards: IsolatedRewards, items, isolation: RewardIsolation, limit: int) -> None:
        self.rewards = rewards
        self.items = items
        self.isolation = isolation
        self.limit = limit
        self.values: list[list[float] | None] = [None] * len(items)
        self.failures = no_failures()
        self.error: BaseException | None = None
        self._attempts: dict[int, int] = {}
        self._lock = threading.Lock()

    def request(self, indices: list[int]) -> dict:
        return {
            "configs": self.rewards.configs,
            "section": self.rewards.section,
            "items": [self.items[i] for i in indices],
        }

    def fail(self, error: BaseException) -> None:
        with self._lock:
            self.error = self.error or error

    def attempt_failed(self, index: int, failure: _Failed, pid: int) -> bool:
        """Count a failed attempt at sample `index`; True when it gets another one, False when it is scored 0."""
        ref = self.items[index][2]
        with self._lock:
            self.failures[failure.kind] += 1
            attempts = self._attempts[index] = self._attempts.get(index, 0) + 1
            retry = attempts < MAX_ATTEMPTS
            if not retry:
                self.values[index] = [0.0] * len(self.rewards.components)
                self.failures[ZEROED] += 1
            zeroed = self.failures[ZEROED]
        log.warning(
            "reward scoring of sample %s (attempt %d of %d, worker pid %d): %s; %s",
            ref, attempts, MAX_ATTEMPTS, pid, failure, "retrying in a fresh worker" if retry else "scored 0",
        )  # fmt: skip
        if zeroed > self.limit:
            self.fail(
                RewardFunctionError(
                    f"rewards {list(self.rewards.versions())}: {zeroed} of {len(self.items)} samples could not be "
                    f"scored (each timed out or crashed its worker {MAX_ATTEMPTS} times; the last: sample {ref}, "
                    f"{failure}); more than the {self.limit} allowed. Fix the reward function, or raise "
                    f"rollout.reward_timeout_s (now {self.isolation.timeout_s:g}) if it is merely slow"
                )
            )
        return retry


_pool: RewardPool | None = None
_pool_lock = threading.Lock()


def process_pool() -> RewardPool:
    """This process's reward pool, started on first use; its workers end with this process's launches, so
    none outlives a flow that is told to stop."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = RewardPool()
            add_stop(lambda reason: _pool.close())
        return _pool
