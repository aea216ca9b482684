"""The one classification of a failure, exception types workers raise, and `record_errors`.

`classify_exception(exc)` is the only place that decides whether a failure is worth a retry. A worker rank
classifies its own exception when it records it (`record_errors`), so facts of the instance such as an
`errno` count, not just its class. It returns a `Classification`: a `Category` and, for a fatal failure a
retry cannot fix, the `fix` the user has to make.

Rules, first match wins (an exception that matches none is classified by its `__cause__`, if any):

1. the exception says so itself: a bool `retryable` attribute (`StorageUnavailable`, `LeaseLost`,
   `LaunchFailed`);
2. fatal with a fix: access denied or a missing bucket (`StorageAccessError`, `PermissionError`, EACCES,
   EPERM), a committed input artifact that fails verification or is missing (`ArtifactCorrupted`,
   `ArtifactNotCommitted`), a full disk or quota (ENOSPC, EDQUOT), a read-only file system (EROFS), a missing
   path or one of the wrong kind (ENOENT, EISDIR, ENOTDIR), and out of memory (`torch.OutOfMemoryError`,
   `MemoryError`: the same settings run out of memory again);
3. retryable: a collective that timed out (gloo's and NCCL's plain RuntimeErrors: a peer rank hung or
   died) and transient storage/network errors (forge_core.storage.retry.is_transient);
4. the class hierarchy (MRO), most specific class first, against `FATAL_TYPES` and `RETRYABLE_TYPES`;
5. an exception that aggregates others (DCP's `CheckpointException.failures`) takes theirs (fatal first);
6. else unclassified: a Python error in a rank is fatal unless another rank died from a signal (then it is
   the collateral damage of that death; see `classify.decide_failure`); raised in the task body, not
   retried.

A rank killed by a signal (the OOM killer, a preemption) is retryable: `category_of_exit_code`.
"""

from __future__ import annotations

import builtins
import enum
import errno
import json
import os
import re
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

# sysexits.h codes, for workers that exit without raising (or are not Python at all).
EXIT_RETRYABLE = 75  # EX_TEMPFAIL: temporary failure, the caller is invited to retry
EXIT_FATAL = 78  # EX_CONFIG: configuration error


class FatalStageError(ValueError):
    """A worker error that no retry can fix (bad config, bad data). Message: field/file, value, fix."""


class RetryableStageError(Exception):
    """A worker error that a retry may fix (storage hiccup, preempted peer, transient network)."""


class Category(enum.Enum):
    FATAL = "fatal"
    RETRYABLE = "retryable"
    UNCLASSIFIED = "unclassified"


@dataclass(frozen=True)
class Classification:
    """What `classify_exception` decided: the category, and for a fatal failure the fix the user must make
    (None when the message already says it, or when nothing better than the message is known)."""

    category: Category
    fix: str | None = None

    def explain(self, text: str) -> str:
        """`text` followed by the fix, when there is one."""
        return f"{text}. Fix: {self.fix}" if self.fix else text


# Qualified class names (module.qualname). A subclass inherits its base's category.
FATAL_TYPES = frozenset(
    {
        f"{__name__}.FatalStageError",
        "builtins.ValueError",
        "builtins.TypeError",
        "builtins.LookupError",
        "builtins.AttributeError",
        "builtins.NameError",
        "builtins.ImportError",
        "builtins.SyntaxError",
        "builtins.AssertionError",
        "builtins.NotImplementedError",
        "builtins.ArithmeticError",
        "builtins.MemoryError",
        "torch.OutOfMemoryError",
    }
)
RETRYABLE_TYPES = frozenset(
    {
        f"{__name__}.RetryableStageError",
        "builtins.OSError",
        "builtins.KeyboardInterrupt",
        "torch.distributed.DistError",
        "torch.distributed.elastic.rendezvous.api.RendezvousError",
        "torch.distributed.elastic.multiprocessing.api.SignalException",
        # A vLLM engine core process died (OOM killer, segfault, SIGKILL): a retry starts a new engine.
        "vllm.v1.engine.exceptions.EngineDeadError",
    }
)
# Files written by plain torch `record` (torchrun's own, or a worker not using record_errors) carry only
# the class name; these non-builtin names are recognised by name alone.
_RETRYABLE_BARE_NAMES = frozenset(
    {
        "RetryableStageError",
        "DistError",
        "DistBackendError",
        "DistNetworkError",
        "DistStoreError",
        "SignalException",
        "RendezvousError",
        "RendezvousClosedError",
        "RendezvousConnectionError",
        "RendezvousStateError",
        "RendezvousTimeoutError",
        "RendezvousGracefulExitError",
        "EngineDeadError",
        "StorageUnavailable",
    }
)
_FATAL_BARE_NAMES = frozenset({"FatalStageError", "ConfigError", "StorageAccessError", "ArtifactCorrupted"})
_OUT_OF_MEMORY_NAMES = frozenset({"builtins.MemoryError", "torch.OutOfMemoryError", "OutOfMemoryError"})

# The settings that bound memory, named by every out-of-memory fix.
OUT_OF_MEMORY_FIX = (
    "the same settings would run out of memory again; lower sft.micro_batch_size / grpo.micro_batch_size, "
    "model.max_seq_len (with data.max_seq_len), or set training.activation_checkpoint=true (on several ranks also "
    "training.parallelism.reshard_after_forward=default); for rollouts "
    "lower rollout.max_num_seqs, and rollout.gpu_memory_utilization on GPU (leaving room for the trainer) or "
    "rollout.kv_cache_gib on CPU"
)
_STORAGE = "forge_core.storage.errors"
# gloo: "Timed out waiting 3000ms for recv operation", then "Application timeout caused pair closure";
# NCCL's watchdog: "Watchdog caught collective operation timeout"; monitored_barrier: "failed to pass".
_COLLECTIVE_TIMEOUT = re.compile(
    r"Timed out waiting \d+ ?ms|Application timeout caused pair closure|collective operation timeout|"
    r"failed to pass monitoredBarrier|timed out in (?:the )?(?:store|barrier|collective)",
    re.IGNORECASE,
)
_DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
_ACCESS_ERRNOS = frozenset({errno.EACCES, errno.EPERM})
# A path that is missing, or of the wrong kind, stays so on a retry.
_MISSING_PATH_ERRNOS = frozenset({errno.ENOENT, errno.EISDIR, errno.ENOTDIR})
_MISSING_PATH_TYPES = (FileNotFoundError, IsADirectoryError, NotADirectoryError)

# Keys added next to torch's own fields in the error file's "extraInfo".
MRO_KEY = "forge_exception_mro"
RANK_KEY = "forge_rank"
CATEGORY_KEY = "forge_category"
FIX_KEY = "forge_fix"


def qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def exception_mro(exc: BaseException) -> list[str]:
    return [qualified_name(c) for c in type(exc).__mro__]


def classify_exception(exc: BaseException) -> Classification:
    """The one classification of a failure (module docstring). The first exception of the `__cause__` chain
    that is not unclassified decides; a fatal one without a fix of its own takes the first fix further down
    (a `ValueError` raised from `ArtifactCorrupted` gets the corrupted artifact's fix)."""
    chain = _cause_chain(exc)
    for index, current in enumerate(chain):
        found = _classify_one(current)
        if found.category is Category.FATAL and found.fix is None:
            fixes = (_classify_one(cause) for cause in chain[index + 1 :])
            return next((c for c in fixes if c.category is Category.FATAL and c.fix), found)
        if found.category is not Category.UNCLASSIFIED:
            return found
    return Classification(Category.UNCLASSIFIED)


def _cause_chain(exc: BaseException) -> list[BaseException]:
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and all(current is not seen for seen in chain):
        chain.append(current)
        current = current.__cause__
    return chain


def _classify_one(exc: BaseException) -> Classification:
    says = getattr(exc, "retryable", None)
    if isinstance(says, bool):
        return Classification(Category.RETRYABLE if says else Category.FATAL)
    mro = exception_mro(exc)
    for rule in (_fatal_with_fix, _transient):
        found = rule(exc, mro)
        if found is not None:
            return found
    by_class = classification_of_mro(mro)
    if by_class.category is Category.UNCLASSIFIED:
        return _of_aggregated(exc)
    return by_class


def _fatal_with_fix(exc: BaseException, mro: list[str]) -> Classification | None:
    if f"{_STORAGE}.StorageAccessError" in mro or f"{_STORAGE}.ArtifactNotCommitted" in mro:
        return Classification(Category.FATAL)  # their messages name the bucket/URI and the fix
    if f"{_STORAGE}.ArtifactCorrupted" in mro:
        uri = getattr(exc, "uri", "the artifact")
        return Classification(
            Category.FATAL,
            f"the committed artifact {uri} no longer matches its manifest and a retry reads the same bytes; "
            f"delete the prefix {uri} so that the stage producing it runs again",
        )
    if isinstance(exc, OSError):
        path = str(exc.filename) if exc.filename else "the file named in the traceback"
        if exc.errno in _DISK_FULL_ERRNOS:
            return Classification(
                Category.FATAL,
                f"the disk or quota holding {path} is full: free space there (or give the job a larger volume), "
                "or keep less: lower storage.keep_checkpoints and clear the policy cache ($FORGE_POLICY_CACHE, "
                "default ~/.cache/forgeflow/policies)",
            )
        if exc.errno in _ACCESS_ERRNOS or isinstance(exc, PermissionError):
            return Classification(
                Category.FATAL,
                f"this process may not access {path}: fix its owner or permissions, or point the setting that "
                "names it at a folder this user can write",
            )
        if exc.errno == errno.EROFS:
            return Classification(
                Category.FATAL, f"{path} is on a read-only file system: point the setting at a writable one"
            )
        if exc.errno in _MISSING_PATH_ERRNOS or isinstance(exc, _MISSING_PATH_TYPES):
            what = {errno.EISDIR: "is a folder where a file is read", errno.ENOTDIR: "has a file where a folder "
                    "is expected"}.get(exc.errno, "does not exist")  # fmt: skip
            return Classification(
                Category.FATAL, f"{path} {what}, and a retry finds the same: fix the setting that names it"
            )
    return None


def _transient(exc: BaseException, mro: list[str]) -> Classification | None:
    if isinstance(exc, RuntimeError) and _COLLECTIVE_TIMEOUT.search(str(exc)):
        return Classification(Category.RETRYABLE)  # a peer rank hung or died: the retry starts a new group
    # Imported here: the launcher process should not load the storage package (fsspec, botocore) to start.
    from forge_core.storage.retry import is_transient

    if is_transient(exc, causes=False):  # the causes get their own turn (classify_exception)
        return Classification(Category.RETRYABLE)
    return None


def _of_aggregated(exc: BaseException) -> Classification:
    """DCP's CheckpointException carries each rank's exception in `failures` ({rank: (exc, traceback)})."""
    failures = getattr(exc, "failures", None)
    if not isinstance(failures, dict):
        return Classification(Category.UNCLASSIFIED)
    inner = [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    found = [classify_exception(e) for e in inner if isinstance(e, BaseException)]
    for category in (Category.FATAL, Category.RETRYABLE):
        if matching := [c for c in found if c.category is category]:
            return matching[0]
    return Classification(Category.UNCLASSIFIED)


def classification_of_mro(mro: Sequence[str]) -> Classification:
    """By class hierarchy alone (rule 4), for error files that recorded the MRO but no category."""
    for name in mro:
        if name in FATAL_TYPES:
            return Classification(Category.FATAL, OUT_OF_MEMORY_FIX if name in _OUT_OF_MEMORY_NAMES else None)
        if name in RETRYABLE_TYPES:
            return Classification(Category.RETRYABLE)
    return Classification(Category.UNCLASSIFIED)


def classification_of_name(type_name: str) -> Classification:
    """Best effort for a bare class name (no MRO recorded): builtins by hierarchy, then known names."""
    bare = type_name.rsplit(".", 1)[-1]
    builtin = getattr(builtins, bare, None)
    if isinstance(builtin, type) and issubclass(builtin, BaseException):
        return classification_of_mro([qualified_name(c) for c in builtin.__mro__])
    if bare in _OUT_OF_MEMORY_NAMES:
        return Classification(Category.FATAL, OUT_OF_MEMORY_FIX)
    if bare in _FATAL_BARE_NAMES:
        return Classification(Category.FATAL)
    if bare in _RETRYABLE_BARE_NAMES:
        return Classification(Category.RETRYABLE)
    return Classification(Category.UNCLASSIFIED)


def category_of_mro(mro: Sequence[str]) -> Category:
    return classification_of_mro(mro).category


def category_of_name(type_name: str) -> Category:
    return classification_of_name(type_name).category


def category_of_exit_code(returncode: int) -> Category:
    if returncode < 0:
        return Category.RETRYABLE  # killed by a signal: OOM killer, preemption, a peer's SIGKILL
    if returncode == EXIT_RETRYABLE:
        return Category.RETRYABLE
    if returncode == EXIT_FATAL:
        return Category.FATAL
    return Category.UNCLASSIFIED


_F = TypeVar("_F", bound=Callable[..., Any])


def record_errors(fn: _F) -> _F:
    """Decorate a worker's `main` so an exception lands in the rank's error file: torch's `record` (same
    file format), also storing the rank, the exception's class hierarchy and its classification."""
    from torch.distributed.elastic.multiprocessing.errors import record

    return record(fn, error_handler=_classification_recording_handler())


def _classification_recording_handler():
    # torch is imported here, not at module level, so the launcher process never pays for it.
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    class ClassificationRecordingErrorHandler(ErrorHandler):
        def record_exception(self, e: BaseException) -> None:
            # torch's own handler writes the file in place: torchrun SIGTERMs the surviving ranks of a failed
            # one, and a rank ended mid-write leaves a truncated file on which torchrun's agent itself crashes
            # (JSONDecodeError), losing which rank failed how. So the whole record is written atomically here.
            path = self._get_error_file_path()
            if not path:
                super().record_exception(e)  # no file configured: torch logs what it would have written
                return
            found = classify_exception(e)
            extra = {
                "py_callstack": traceback.format_exc(),
                "timestamp": str(int(time.time())),
                MRO_KEY: exception_mro(e),
                RANK_KEY: os.environ.get("RANK"),
                CATEGORY_KEY: found.category.value,
                FIX_KEY: found.fix,
            }
            _write_json_atomically(path, {"message": {"message": f"{type(e).__name__}: {e}", "extraInfo": extra}})

    return ClassificationRecordingErrorHandler()


def _write_json_atomically(path: str, data: dict[str, Any]) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)
