"""In-stage checkpoints: DCP (model + optimizer + LR schedule + step + data cursor + per-rank RNG) written
through fsspec straight into the object store, each committed as its own artifact by a manifest.

Layout: `<output_uri>/_checkpoints/step-<N>/` holds `_MANIFEST.json` and, under `_attempts/<attempt>/`, DCP's
files; each save has its own attempt prefix, so a zombie or concurrent writer of the same step never mixes
shards with it. A checkpoint without a manifest does not exist; one whose files do not match their manifest is
refused, and resume falls back to the previous committed one. Retention keeps the newest
`storage.keep_checkpoints` plus those a kept checkpoint pins (`save(..., pins=[step])`). A save holds the
components it is given (a GRPO stage's final optimizer state, saved behind its commit, leaves the weights out);
loading asks for components a checkpoint holds, else it is refused by name.

    ckpt = Checkpointer(store, output_uri, dist_ctx, stage="sft", config=cfg_dict, inputs={"data": data_uri})
    ckpt.save(step, {"model": ModelState(model), "optimizer": opt, "lr_scheduler": sched}, data_cursor)
    ckpt.save(step, components, data_cursor, pins=[best_step])     # retention keeps step-<best_step> too
    resume = ckpt.load_latest(same_components)      # ResumeState(step, data_cursor, uri) or None

    pending = ckpt.save_behind(step, components, data_cursor, group)   # group = new_gloo_group()
    pending.start()                                 # written and committed on a thread of its own, on `group`
    pending.wait()                                  # before the components change, the next save on `group`,
                                                    # and the process's end
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

from forge_core.engine.distributed import DistContext, barrier, broadcast_object, gather_objects
from forge_core.engine.hashing_dcp import HashingFsspecWriter
from forge_core.engine.rng import capture_rng_state, restore_rng_state
from forge_core.engine.safe_dcp import SafeFsspecReader, SafeLoadPlanner
from forge_core.faults import maybe_kill_while_saving
from forge_core.launch.errors import RetryableStageError
from forge_core.storage import (
    CHECKPOINTS_DIR,
    ArtifactAlreadyCommitted,
    ArtifactCorrupted,
    ArtifactWriter,
    FileEntry,
    ObjectStore,
    StorageError,
    StorageUnavailable,
)
from forge_core.storage.retry import is_transient

log = logging.getLogger(__name__)

CHECKPOINT_KIND = "checkpoint"
PINS_METRIC = "pins"  # manifest metric: steps whose checkpoints retention must keep while this one is kept
_STEP_DIR = re.compile(r"step-(\d+)$")
_VERIFY_CHUNK_BYTES = 8 * 2**20
# A save behind its stage's commit yields the CPU to what the flow runs meanwhile on the same host (the weight
# push, the engines' generation): its thread's niceness is raised by this much. It still gets every idle cycle.
BEHIND_NICENESS = 10


class CheckpointCorrupted(ValueError):
    """Every committed checkpoint of a run failed verification: resuming would silently restart from step 0."""


@dataclass(frozen=True)
class CheckpointRef:
    step: int
    uri: str


@dataclass(frozen=True)
class ResumeState:
    """What a trainer continues from: the last completed optimizer step and the sampler's cursor."""

    step: int
    data_cursor: dict
    uri: str


@dataclass(frozen=True)
class _Attempt:
    """One save's attempt: rank 0's writer (None on the other ranks) and the prefix every rank writes under."""

    writer: ArtifactWriter | None
    files_uri: str


class PendingSave:
    """A checkpoint taken and ready to be written (`Checkpointer.save_behind`): `start()` writes and commits it on
    a thread of its own, `wait()` blocks until that has ended."""

    def __init__(self, ref: CheckpointRef, work: Callable[[], None] | None) -> None:
        self.ref = ref
        self._work = work  # None: the step was committed already
        self._done: Future | None = None

    def start(self) -> None:
        """Start the write on a thread of its own, at BEHIND_NICENESS lower priority than the caller's."""
        assert self._done is None, "a save starts once"
        if self._work is None:
            self._done = _finished()
            return
        work = self._work

        def write_in_background() -> None:
            lower_thread_priority(BEHIND_NICENESS)
            work()

        pool = ThreadPoolExecutor(1, thread_name_prefix="forge-save-behind")
        self._done = pool.submit(write_in_background)
        pool.shutdown(wait=False)  # returns now; the thread ends with the work

    def wait(self) -> CheckpointRef:
        """Block until the checkpoint is committed; raises what failed the save."""
        assert self._done is not None, "start() the save first"
        self._done.result()
        return self.ref


def lower_thread_priority(niceness: int) -> None:
    """Raise the calling thread's niceness by `niceness` (at most to 19), leaving the process's other threads as
    they are. Only on Linux, where a thread's niceness is its own; elsewhere a no-op."""
    if not sys.platform.startswith("linux"):
        return
    thread = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, thread, min(19, os.getpriority(os.PRIO_PROCESS, thread) + niceness))
    except OSError as exc:  # a sandbox may refuse it: the save only runs at normal priority
        log.warning("could not lower the priority of a save written behind its stage: %s", exc)


def _finished() -> Future:
    done: Future = Future()
    done.set_result(None)
    return done


def _state_now(state: dict[str, Any]) -> dict[str, Any]:
    """`state` as DCP would save it, each Stateful's `state_dict()` called now: values such as the RNG streams are
    captured, tensors are the live ones."""
    return {name: value.state_dict() if isinstance(value, Stateful) else value for name, value in state.items()}


def _storage_may_recover(exc: BaseException) -> bool:
    """A store outage (retries exhausted) or a transient network error, not a denial or a bug."""
    return isinstance(exc, StorageUnavailable) or is_transient(exc)


def checkpoint_uri(store: ObjectStore, output_uri: str, step: int) -> str:
    return store.join(output_uri, CHECKPOINTS_DIR, f"step-{step}")


def committed_checkpoints(store: ObjectStore, output_uri: str) -> list[CheckpointRef]:
    """Committed checkpoints of the run at `output_uri`, newest step first."""
    base = store.join(output_uri, CHECKPOINTS_DIR)
    refs = []
    for uri in store.list_committed(CHECKPOINT_KIND, under=base):
        match = _STEP_DIR.search(uri.rstrip("/"))
        if match:
            refs.append(CheckpointRef(step=int(match.group(1)), uri=uri.rstrip("/")))
    return sorted(refs, key=lambda ref: ref.step, reverse=True)


def latest_committed_checkpoint(store: ObjectStore, output_uri: str) -> CheckpointRef | None:
    """The newest committed checkpoint of the run at `output_uri` (not verified), or None."""
    refs = committed_checkpoints(store, output_uri)
    return refs[0] if refs else None


def pinned_steps(store: ObjectStore, ref: CheckpointRef) -> list[int]:
    """The steps a checkpoint pins (`Checkpointer.save(..., pins=...)`), from its manifest."""
    return [int(step) for step in store.read_manifest(ref.uri).metrics.get(PINS_METRIC, [])]


def prune_checkpoints(store: ObjectStore, output_uri: str, keep: int) -> list[CheckpointRef]:
    """Delete the committed checkpoints of `output_uri` beyond the newest `keep` (>= 1), except those a kept one
    pins; returns those deleted. Each loses its manifest first, so nothing half-deleted looks committed."""
    assert keep >= 1, f"keep={keep}: the newest checkpoint always stays"
    refs = committed_checkpoints(store, output_uri)
    pinned = {step for ref in refs[:keep] for step in pinned_steps(store, ref)}
    doomed = [ref for ref in refs[keep:] if ref.step not in pinned]
    for ref in doomed:
        store.delete_artifact(ref.uri)
    return doomed


def verify_checkpoint(store: ObjectStore, ref: CheckpointRef) -> None:
    """Read every file of the checkpoint against its manifest; raises ArtifactCorrupted naming the file."""
    reader = store.reader(ref.uri)
    for rel in reader.files():
        with reader.open(rel) as stream:
            while stream.read(_VERIFY_CHUNK_BYTES):
                pass


class ModelState(Stateful):
    """DCP view of a (possibly FSDP/TP-sharded) model through its own `state_dict`/`load_state_dict`.

    Not `get_model_state_dict`: torchtitan modules keep canonical keys through state-dict hooks, which it
    cannot follow."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return self.model.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.model.load_state_dict(state_dict)


class _TrainState(Stateful):
    """Step and data cursor (identical on every rank, so DCP stores them once)."""

    def __init__(self, step: int = 0, data_cursor: dict | None = None) -> None:
        self.step = step
        self.data_cursor = data_cursor or {}

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "data_cursor": json.dumps(self.data_cursor, sort_keys=True)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        self.data_cursor = json.loads(state_dict["data_cursor"])


class _RankRngState(Stateful):
    """This rank's RNG streams under a rank-specific key, so every rank saves and restores its own."""

    def __init__(self, rank: int, device: torch.device) -> None:
        self.key = f"rank{rank}"
        self.device = device
        self.loaded: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return {self.key: capture_rng_state(self.device)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loaded = state_dict[self.key]


def _shard_reader(store: ObjectStore, ref: CheckpointRef) -> SafeFsspecReader:
    """DCP's reader of a committed checkpoint's shards. Storage is not trusted with code: no plain unpickling of
    what it returns (safe_dcp.py)."""
    files_uri = store.reader(ref.uri).files_uri  # the committed attempt's shards
    return SafeFsspecReader(store.fsspec_path(files_uri), **store.storage_options)


def load_components(store: ObjectStore, ref: CheckpointRef, components: dict[str, Stateful], dist: DistContext) -> None:
    """Collective: restore `components` alone (e.g. another stage's `optimizer`) from the committed checkpoint
    `ref`, verified on rank 0 first; its step, data cursor and RNG streams are not touched. DCP reshards to this
    run's ranks. Raises CheckpointCorrupted when `ref` is not committed or does not verify."""
    problem = broadcast_object(_verify_problem(store, ref) if dist.is_rank0 else None)
    if problem:
        raise CheckpointCorrupted(problem)
    dcp.load(dict(components), storage_reader=_shard_reader(store, ref), planner=SafeLoadPlanner())
    log.info("loaded %s from %s", sorted(components), ref.uri)


def _verify_problem(store: ObjectStore, ref: CheckpointRef) -> str | None:
    """Rank 0: why `ref` cannot be loaded, or None."""
    if not store.is_committed(ref.uri):
        return f"checkpoint {ref.uri} is not committed"
    try:
        verify_checkpoint(store, ref)
    except ArtifactCorrupted as exc:
        return f"checkpoint {ref.uri} is corrupt: {exc}"
    return None


class Checkpointer:
    """Saves and restores a run's checkpoints under `<output_uri>/_checkpoints/` (see the module docstring)."""

    def __init__(
        self,
        store: ObjectStore,
        output_uri: str,
        dist_ctx: DistContext,
        *,
        stage: str,
        config: dict,
        inputs: dict[str, str],
    ) -> None:
        self.store = store
        self.output_uri = output_uri.rstrip("/")
        self.dist = dist_ctx
        self.stage = stage
        self.config = config
        self.inputs = inputs

    # ---- save ---------------------------------------------------------------------------------------------

    def save(
        self, step: int, components: dict[str, Stateful], data_cursor: dict, pins: Sequence[int] = ()
    ) -> CheckpointRef:
        """Collective: every rank writes its shards, then rank 0 commits the manifest; a step already committed
        is left as it is. `pins`: earlier steps retention keeps while this one is kept. Raises
        RetryableStageError when a storage outage fails the write or the commit."""
        ref = self._ref(step)
        if self._is_committed(ref, group=None):
            return ref
        attempt = self._open_attempt(ref, group=None)
        written = self._write(ref, attempt, self._state(components, _TrainState(step, data_cursor)), group=None)
        self._commit_everywhere(ref, attempt, written, pins, group=None)
        return ref

    def save_behind(
        self, step: int, components: dict[str, Stateful], data_cursor: dict, group: ProcessGroup
    ) -> PendingSave:
        """Collective over `group`, a gloo process group of this run's ranks that nothing else uses while the save
        runs: take this rank's state now, its tensors as they are (not copied: a checkpoint is as large as the
        weights and both AdamW moments). The returned save's `start()` (every rank's) writes and commits it as
        `save` does, on a thread of its own whose collectives are `group`'s alone. Until its `wait()` returns,
        nothing may change the components' tensors (the weights, the optimizer's state); the RNG streams, step,
        cursor and LR schedule are taken as values now. It must be waited for before the next save on `group` and
        before the process ends; its `wait` raises what `save` would."""
        ref = self._ref(step)
        if self._is_committed(ref, group):
            return PendingSave(ref, None)
        attempt = self._open_attempt(ref, group)
        staged = _state_now(self._state(components, _TrainState(step, data_cursor)))

        def write_and_commit() -> None:
            if self.dist.device.type == "cuda":  # a thread starts on cuda:0; DCP copies shards to host on its device
                torch.cuda.set_device(self.dist.device)
            maybe_kill_while_saving(self.dist.rank, step)
            started = time.perf_counter()
            written = self._write(ref, attempt, staged, group)
            self._commit_everywhere(ref, attempt, written, (), group, {"write_s": time.perf_counter() - started})

        return PendingSave(ref, write_and_commit)

    def _ref(self, step: int) -> CheckpointRef:
        return CheckpointRef(step=step, uri=checkpoint_uri(self.store, self.output_uri, step))

    def _is_committed(self, ref: CheckpointRef, group: ProcessGroup | None) -> bool:
        return bool(broadcast_object(self.store.is_committed(ref.uri) if self.dist.is_rank0 else None, group=group))

    def _open_attempt(self, ref: CheckpointRef, group: ProcessGroup | None) -> _Attempt:
        """Collective: rank 0's writer is this save's attempt; every rank writes its shards under its prefix."""
        writer = None
        if self.dist.is_rank0:
            writer = ArtifactWriter(self.store, ref.uri, kind=CHECKPOINT_KIND, stage=self.stage)
        files_uri = broadcast_object(writer.files_uri if writer is not None else None, group=group)
        return _Attempt(writer, str(files_uri))

    def _write(
        self, ref: CheckpointRef, attempt: _Attempt, state: dict[str, Any], group: ProcessGroup | None
    ) -> dict[str, FileEntry]:
        """Collective: DCP writes this rank's shards, hashing each as it goes (nothing is read back to commit)."""
        writer = HashingFsspecWriter(self.store.fsspec_path(attempt.files_uri), **self.store.storage_options)
        try:
            dcp.save(state, storage_writer=writer, process_group=group)
        except CheckpointException as exc:
            if any(_storage_may_recover(failure) for failure, _ in exc.failures.values()):
                raise RetryableStageError(f"checkpoint {ref.uri}: writing shards failed: {exc}") from exc
            raise
        return writer.written_files

    def _commit_everywhere(
        self,
        ref: CheckpointRef,
        attempt: _Attempt,
        written: dict[str, FileEntry],
        pins: Sequence[int],
        group: ProcessGroup | None,
        metrics: dict | None = None,
    ) -> None:
        """Collective: rank 0 commits every rank's hashed files (plus `metrics` in the manifest) and applies
        retention; each rank raises a failure of the commit."""
        per_rank = gather_objects(written, group)
        failure = broadcast_object(
            self._commit(ref, attempt, per_rank, pins, metrics or {}) if self.dist.is_rank0 else None, group=group
        )
        if failure:
            message, retryable = failure
            # A storage outage at the commit point is worth a retry (it resumes from the previous checkpoint).
            raise (RetryableStageError if retryable else RuntimeError)(
                f"checkpoint {ref.uri}: commit failed on rank 0: {message}"
            )
        if self.dist.is_rank0:
            self._prune()
        barrier(group)

    def _commit(
        self,
        ref: CheckpointRef,
        attempt: _Attempt,
        per_rank: list[dict[str, FileEntry]],
        pins: Sequence[int],
        extra: dict,
    ) -> tuple[str, bool] | None:
        """Rank 0: commit the hashed files; None, or (what failed, whether a retry may succeed)."""
        writer = attempt.writer
        assert writer is not None, "rank 0 opens the attempt"
        metrics = {"step": ref.step, **({PINS_METRIC: sorted(set(pins))} if pins else {}), **extra}
        try:
            writer.adopt_hashed({rel: entry for files in per_rank for rel, entry in files.items()})
            writer.commit(config=self.config, inputs=self.inputs, metrics=metrics)
        except ArtifactAlreadyCommitted as exc:
            # Another attempt (a zombie or concurrent run) committed this step first: its checkpoint is as good.
            log.warning("checkpoint %s: %s; using that one", ref.uri, exc)
            self._abort_quietly(writer)
        except Exception as exc:  # noqa: BLE001 - reported to every rank, which then all raise
            return f"{type(exc).__name__}: {exc}", _storage_may_recover(exc)
        return None

    @staticmethod
    def _abort_quietly(writer: ArtifactWriter) -> None:
        try:
            writer.abort()
        except StorageError as exc:
            log.warning("checkpoint %s: could not delete this attempt's shards (%s)", writer.files_uri, exc)

    def _prune(self) -> None:
        """Rank 0: retention after a commit. Best effort: a failure leaves extra checkpoints for the next save."""
        try:
            for ref in prune_checkpoints(self.store, self.output_uri, self.store.keep_checkpoints):
                log.info(
                    "checkpoint %s deleted (storage.keep_checkpoints=%d)",
                    ref.uri,
                    self.store.keep_checkpoints,
                )
        except StorageError as exc:
            log.warning(
                "checkpoint retention under %s failed (%s); will try again after the next save",
                self.output_uri,
                exc,
            )

    def _state(self, components: dict[str, Stateful], train_state: _TrainState) -> dict[str, Stateful]:
        reserved = {"train_state", "rng"} & set(components)
        assert not reserved, f"component names {reserved} are reserved by the checkpointer"
        return {
            **components,
            "train_state": train_state,
            "rng": _RankRngState(self.dist.rank, self.dist.device),
        }

    # ---- load ---------------------------------------------------------------------------------------------

    def load_latest(self, components: dict[str, Stateful]) -> ResumeState | None:
        """Collective: restore the newest checkpoint that verifies, or return None when there is none.
        Raises CheckpointCorrupted when checkpoints exist but none of them verifies."""
        chosen = broadcast_object(self._choose_checkpoint() if self.dist.is_rank0 else None)
        if isinstance(chosen, str):
            raise CheckpointCorrupted(chosen)
        if chosen is None:
            return None
        return self.load(chosen, components)

    def load(self, ref: CheckpointRef, components: dict[str, Stateful]) -> ResumeState:
        """Collective: restore `ref` (already verified) into `components` and this rank's RNG streams. Raises
        ValueError when `ref` was written by fewer ranks, or saved without one of `components`."""
        train_state = _TrainState()
        state = self._state(components, train_state)
        reader = _shard_reader(self.store, ref)
        held = reader.read_metadata().state_dict_metadata
        missing = sorted(name for name in components if not any(key.startswith(f"{name}.") for key in held))
        if missing:
            raise ValueError(
                f"checkpoint {ref.uri} holds no {', '.join(missing)} state (it holds "
                f"{', '.join(sorted({key.split('.')[0] for key in held}))}): it was saved without them (a GRPO "
                "stage's final optimizer state, written behind its commit, holds no weights) and resumes no stage"
            )
        rng_prefix = f"rng.{state['rng'].key}."
        if not any(key.startswith(rng_prefix) for key in held):
            raise ValueError(
                f"checkpoint {ref.uri} has no RNG state for rank {self.dist.rank}: it was written by a run with "
                "fewer ranks; resume with the world size it was written with"
            )
        dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner())
        restore_rng_state(state["rng"].loaded, self.dist.device)
        log.info("resumed from %s (step %d)", ref.uri, train_state.step)
        return ResumeState(step=train_state.step, data_cursor=train_state.data_cursor, uri=ref.uri)

    def load_step(self, step: int, components: dict[str, Stateful]) -> ResumeState:
        """Collective: restore the committed checkpoint of `step`, verified first, into `components`.
        Raises CheckpointCorrupted when it is not committed or does not verify."""
        ref = CheckpointRef(step=step, uri=checkpoint_uri(self.store, self.output_uri, step))
        problem = broadcast_object(_verify_problem(self.store, ref) if self.dist.is_rank0 else None)
        if problem:
            raise CheckpointCorrupted(
                f"{problem}; delete the stage's output prefix {self.output_uri} to run the stage afresh"
            )
        return self.load(ref, components)

    def _choose_checkpoint(self) -> CheckpointRef | str | None:
        """Rank 0: newest verifying checkpoint, None when there is none, or an error message when all fail."""
        failures = []
        for ref in committed_checkpoints(self.store, self.output_uri):
            try:
                verify_checkpoint(self.store, ref)
            except ArtifactCorrupted as exc:
                log.warning("checkpoint %s is corrupt, falling back to an older one: %s", ref.uri, exc)
                failures.append(str(exc))
                continue
            return ref
        if failures:
            return (
                f"every committed checkpoint under {self.output_uri}/{CHECKPOINTS_DIR} is corrupt: "
                + "; ".join(failures)
                + ". Delete the corrupt step-<N> folders (or the whole output prefix) to start the stage afresh"
            )
        return None
