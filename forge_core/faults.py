"""Fault injection for tests and chaos runs, driven by the environment; off unless FORGE_FAULT is set.

    FORGE_FAULT=<fault>[,<fault>...]        each fault is `<action>:<args>[@<stage>]`
      kill_rank:<rank>:<step>               the rank SIGKILLs itself right after finishing optimizer step <step>
      raise_rank:<rank>:<step>              the rank raises InjectedFault (a Python error: the launcher calls it
                                            fatal)
      hang_rank:<rank>:<step>               the rank sleeps forever (deadline tests)
      kill_saving:<rank>:<step>             the rank SIGKILLs itself as its thread starts writing step <step>'s
                                            checkpoint behind a stage's commit (a trainer group's final
                                            optimizer state), after the stage committed
      kill_vllm:<samples>                   the worker SIGKILLs its vLLM engine core process(es) once <samples>
                                            samples have completed in it (0: as soon as the first requests are
                                            queued, i.e. mid-generation); an in-process engine dies with the
                                            worker
      kill_vllm_transfer:<buckets>          the vLLM process that receives a weight transfer
                                            (forge_core.rollout.weight_transfer) SIGKILLs itself once it has
                                            loaded <buckets> buckets (@<stage>: the stage that started the
                                            engine)
      hang_engine:<index>                   engine <index> of the run's engine actors
                                            hangs in its first generate request (node-loss drills)
      storage_outage:<seconds>[:<match>]    from the first storage call whose description contains <match>
                                            (default: any call), every storage call of the process fails with a
                                            transient ConnectionError for <seconds>; the store's own retries
                                            (storage.retries) run against it
    @<stage>                                only in that stage's worker (prepare, sft, rollout, grpo, evaluate)
    FORGE_FAULT_ONCE=<path>                 every fault fires at most once, across processes and retries: the
                                            first listed fault claims the file <path>, the n-th (n >= 1)
                                            <path>.<n>; a retry that finds its marker runs clean

Examples: `FORGE_FAULT=kill_rank:1:3@sft`, `FORGE_FAULT=hang_rank:1:2@grpo,kill_vllm:0@rollout`,
`FORGE_FAULT=storage_outage:30:_MANIFEST.json@rollout` (a chaos run of the retry settings on real storage).

Hooks: trainers call `maybe_inject_fault(rank, step)` after each optimizer step and before that step's
checkpoint, so a fault at step N loses step N's update and resume restarts from the last checkpoint before N;
`forge_core.run` names the stage (`set_current_stage`); the vLLM generator passes
`engine_kill_progress(engine_core_processes)` as vLLM's progress callback (the lookup passed in: faults sits
below rollout); `forge_core.storage.retry.Retrier` calls `maybe_fail_storage_call` before every storage call.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

FAULT_ENV = "FORGE_FAULT"
FAULT_ONCE_ENV = "FORGE_FAULT_ONCE"
# Set by `set_current_stage` so that processes a worker starts (vLLM engines, rollout replicas) know it too.
STAGE_ENV = "FORGE_STAGE"
RANK_ACTIONS = ("kill_rank", "raise_rank", "hang_rank")
KILL_SAVING = "kill_saving"
KILL_VLLM = "kill_vllm"
KILL_VLLM_TRANSFER = "kill_vllm_transfer"
HANG_ENGINE = "hang_engine"
STORAGE_OUTAGE = "storage_outage"
_ACTIONS = (*RANK_ACTIONS, KILL_SAVING, KILL_VLLM, KILL_VLLM_TRANSFER, HANG_ENGINE, STORAGE_OUTAGE)
_USAGE = (
    "expected <action>:<rank>:<step> with action one of "
    f"{[*RANK_ACTIONS, KILL_SAVING]} (e.g. kill_rank:1:3), {KILL_VLLM}:<samples>, {KILL_VLLM_TRANSFER}:<buckets>, "
    f"{HANG_ENGINE}:<index> or "
    f"{STORAGE_OUTAGE}:<seconds>[:<match>], each optionally followed by @<stage>"
)

_current_stage: str | None = None


class InjectedFault(RuntimeError):
    """Raised by `raise_rank` faults."""


@dataclass(frozen=True)
class Fault:
    action: str
    rank: int = 0
    step: int = 0
    stage: str | None = None
    samples: int = 0
    seconds: float = 0.0
    match: str = ""

    def applies_to_stage(self, stage: str | None) -> bool:
        return self.stage is None or self.stage == stage


def fault_environment() -> dict[str, str]:
    """The FORGE_FAULT settings of this process, for a process that does not inherit its environment (a Ray
    node's processes have that node's). Both keys are always present, empty when unset (off), so that they
    replace whatever the node's own environment holds."""
    return {name: os.environ.get(name, "") for name in (FAULT_ENV, FAULT_ONCE_ENV)}


def set_current_stage(stage: str) -> None:
    """Called once by a stage worker (`python -m forge_core.run <stage>`): faults with `@<stage>` fire here
    and in the processes it starts."""
    global _current_stage
    _current_stage = stage
    os.environ[STAGE_ENV] = stage


def current_stage() -> str | None:
    return _current_stage or os.environ.get(STAGE_ENV)


def parse_faults(spec: str) -> list[Fault]:
    """Parse FORGE_FAULT (see the module docstring); ValueError naming the bad entry."""
    return list(_parse_cached(spec))


@functools.lru_cache(maxsize=8)
def _parse_cached(spec: str) -> tuple[Fault, ...]:
    return tuple(_parse_entry(spec, entry) for entry in filter(None, (p.strip() for p in spec.split(","))))


def _parse_entry(spec: str, entry: str) -> Fault:
    body, _, stage = entry.partition("@")
    parts = body.split(":", 2 if body.startswith(STORAGE_OUTAGE + ":") else -1)

    def bad(why: str = "") -> ValueError:
        return ValueError(f"{FAULT_ENV}={spec!r}: bad entry {entry!r}{why}; {_USAGE}")

    if "@" in entry and not stage.strip():
        raise bad(": empty stage after '@'")
    stage_name = stage.strip() or None
    from forge_core.stages import is_stage, stage_names  # the registry: a leaf, like this module

    if stage_name is not None and not is_stage(stage_name):
        raise bad(f": unknown stage {stage_name!r} (stages: {', '.join(stage_names())})")
    action = parts[0]
    if action in (*RANK_ACTIONS, KILL_SAVING):
        if len(parts) != 3 or not all(p.isdigit() for p in parts[1:]):
            raise bad()
        return Fault(action, rank=int(parts[1]), step=int(parts[2]), stage=stage_name)
    if action in (KILL_VLLM, KILL_VLLM_TRANSFER):
        if len(parts) != 2 or not parts[1].isdigit():
            raise bad()
        return Fault(action, samples=int(parts[1]), stage=stage_name)
    if action == HANG_ENGINE:
        if len(parts) != 2 or not parts[1].isdigit():
            raise bad()
        return Fault(action, rank=int(parts[1]), stage=stage_name)
    if action == STORAGE_OUTAGE:
        try:
            seconds = float(parts[1]) if len(parts) >= 2 else -1.0
        except ValueError:
            seconds = -1.0
        if seconds <= 0:
            raise bad(": the outage needs a duration in seconds > 0")
        return Fault(action, seconds=seconds, match=parts[2] if len(parts) == 3 else "", stage=stage_name)
    raise bad()


def _active_faults(actions: tuple[str, ...]) -> list[tuple[int, Fault]]:
    """(position in FORGE_FAULT, fault) of the configured faults of these actions for the current stage."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return []
    return [
        (index, fault)
        for index, fault in enumerate(parse_faults(spec))
        if fault.action in actions and fault.applies_to_stage(current_stage())
    ]


def _claim_once(index: int) -> bool:
    """True when fault number `index` may fire: no once-marker configured, or we created its marker now."""
    marker = os.environ.get(FAULT_ONCE_ENV)
    if not marker:
        return True
    if index:
        marker = f"{marker}.{index}"
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.close(fd)
    return True


def _announce(message: str) -> None:
    print(f"[forge-fault] {message}", file=sys.stderr, flush=True)
    sys.stdout.flush()


# ---- rank faults (trainers) ------------------------------------------------------------------------------


def maybe_inject_fault(rank: int, step: int) -> None:
    """Fire the rank fault configured for (`rank`, `step`) in FORGE_FAULT, if any."""
    for index, fault in _active_faults(RANK_ACTIONS):
        if fault.rank != rank or fault.step != step or not _claim_once(index):
            continue
        _announce(f"rank {rank}: {fault.action} after step {step}")
        if fault.action == "kill_rank":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault.action == "raise_rank":
            raise InjectedFault(
                f"injected fault: {FAULT_ENV}={os.environ.get(FAULT_ENV)!r} (rank {rank}, step {step})"
            )
        while True:  # hang_rank
            time.sleep(3600)


def maybe_kill_while_saving(rank: int, step: int) -> None:
    """SIGKILL this process if a kill_saving fault names (`rank`, `step`) (called as a checkpoint written behind
    a stage's commit starts writing)."""
    for index, fault in _active_faults((KILL_SAVING,)):
        if fault.rank == rank and fault.step == step and _claim_once(index):
            _announce(f"rank {rank}: {KILL_SAVING} as step {step}'s checkpoint starts writing behind the commit")
            os.kill(os.getpid(), signal.SIGKILL)


# ---- hang_engine (engine actors) -------------------------------------------------------------------------


def maybe_hang_engine(index: int) -> None:
    """Hang forever if a hang_engine fault names engine `index` (called as an engine actor takes a request)."""
    for position, fault in _active_faults((HANG_ENGINE,)):
        if fault.rank == index and _claim_once(position):
            _announce(f"engine {index}: hang_engine in a generate request")
            while True:
                time.sleep(3600)


# ---- kill_vllm (rollout / evaluate workers) --------------------------------------------------------------

_completed_samples = 0


def engine_kill_progress(find_engines: Callable[[], list]) -> Callable[..., object] | None:
    """A progress-bar factory for vLLM's `LLM.generate(use_tqdm=...)` that SIGKILLs the engine core processes
    (`find_engines()`: psutil processes, the generator's own lookup) when a kill_vllm fault is due; None when
    none is configured for this stage (pass `... or False`)."""
    if not _active_faults((KILL_VLLM,)):
        return None
    return functools.partial(_EngineKillProgress, find_engines=find_engines)


class _EngineKillProgress:
    """The part of tqdm's interface vLLM's offline loop uses; counts completed samples in this process.

    vLLM builds one around the prompts while rendering them (an iterable: passed through untouched) and one
    with `total=` once the requests are queued; the engine is killed only from the latter."""

    def __init__(
        self, iterable=None, total: int | None = None, *, find_engines: Callable[[], list], **_: object
    ) -> None:
        self.iterable = iterable
        self.total = total
        self.find_engines = find_engines
        self.n = 0
        self.postfix = ""
        self._started = time.monotonic()
        if iterable is None:
            _kill_engine_if_due(find_engines)  # the requests are queued: a kill now lands mid-generation

    def __iter__(self):
        return iter(self.iterable)

    @property
    def format_dict(self) -> dict[str, float]:
        return {"elapsed": max(time.monotonic() - self._started, 1e-6)}

    def update(self, n: int = 1) -> None:
        global _completed_samples
        self.n += n
        _completed_samples += n
        _kill_engine_if_due(self.find_engines)

    def refresh(self) -> None:
        return None

    def close(self) -> None:
        return None


def _kill_engine_if_due(find_engines: Callable[[], list]) -> None:
    for index, fault in _active_faults((KILL_VLLM,)):
        if _completed_samples >= fault.samples and _claim_once(index):
            kill_vllm_engine(f"after {_completed_samples} completed samples", find_engines)


def kill_vllm_engine(why: str, find_engines: Callable[[], list]) -> list[int]:
    """SIGKILL this process's vLLM engine core process(es) (`find_engines()`); with none (an in-process
    engine), this process."""
    import psutil

    engines = find_engines()
    if not engines:
        _announce(f"kill_vllm {why}: the engine runs in this process; SIGKILL pid {os.getpid()}")
        os.kill(os.getpid(), signal.SIGKILL)
    pids = [p.pid for p in engines]
    _announce(f"kill_vllm {why}: SIGKILL engine core pids {pids}")
    for proc in engines:
        try:
            proc.kill()
        except psutil.Error:
            continue
    return pids


def maybe_kill_in_transfer(buckets: int) -> None:
    """SIGKILL this process (a vLLM worker receiving a weight transfer) when a kill_vllm_transfer fault is due
    after `buckets` loaded buckets."""
    for index, fault in _active_faults((KILL_VLLM_TRANSFER,)):
        if buckets >= fault.samples and _claim_once(index):
            _announce(f"kill_vllm_transfer after {buckets} bucket(s): SIGKILL pid {os.getpid()}")
            os.kill(os.getpid(), signal.SIGKILL)


# ---- storage_outage (every ObjectStore call) -------------------------------------------------------------

_outage_started: float | None = None
_outage_spent = False  # another process (an earlier attempt) already had this outage


def maybe_fail_storage_call(what: str) -> None:
    """Raise a transient ConnectionError while a storage_outage fault is in force (see module docstring).

    `what` is the store's description of the call, e.g. "put s3://bucket/run/sft/<key>/_MANIFEST.json"."""
    global _outage_started, _outage_spent
    if _outage_spent:
        return
    outages = _active_faults((STORAGE_OUTAGE,))
    if not outages:
        return
    index, fault = outages[0]
    now = time.monotonic()
    if _outage_started is None:
        if fault.match not in what:
            return
        if not _claim_once(index):
            _outage_spent = True
            return
        _outage_started = now
        _announce(f"storage_outage for {fault.seconds:g} s, starting at: {what}")
    if now - _outage_started < fault.seconds:
        raise ConnectionError(f"injected storage outage ({FAULT_ENV}): {what}")
