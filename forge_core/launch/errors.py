"""Exception types workers raise, how an exception type maps to fatal/retryable, and `record_errors`.

The mapping is decided from the exception's class hierarchy (MRO), most specific class first:
the first class found in `FATAL_TYPES` or `RETRYABLE_TYPES` wins. Exceptions in neither set are
"unclassified": a Python error in a rank, fatal unless another rank died from a signal (then they are
treated as the collateral damage of that death; see `classify.decide_outcome`).
"""

from __future__ import annotations

import builtins
import enum
import json
import os
from collections.abc import Callable, Sequence
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
    }
)
RETRYABLE_TYPES = frozenset(
    {
        f"{__name__}.RetryableStageError",
        "builtins.OSError",
        "builtins.MemoryError",
        "builtins.KeyboardInterrupt",
        "torch.OutOfMemoryError",
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
        "OutOfMemoryError",
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
    }
)
_FATAL_BARE_NAMES = frozenset({"FatalStageError", "ConfigError"})

# Key added next to torch's own fields in the error file's "extraInfo".
MRO_KEY = "forge_exception_mro"
RANK_KEY = "forge_rank"


def qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def exception_mro(exc: BaseException) -> list[str]:
    return [qualified_name(c) for c in type(exc).__mro__]


def category_of_mro(mro: Sequence[str]) -> Category:
    for name in mro:
        if name in FATAL_TYPES:
            return Category.FATAL
        if name in RETRYABLE_TYPES:
            return Category.RETRYABLE
    return Category.UNCLASSIFIED


def category_of_name(type_name: str) -> Category:
    """Best effort for a bare class name (no MRO recorded): builtins by hierarchy, then known names."""
    bare = type_name.rsplit(".", 1)[-1]
    builtin = getattr(builtins, bare, None)
    if isinstance(builtin, type) and issubclass(builtin, BaseException):
        return category_of_mro([qualified_name(c) for c in builtin.__mro__])
    if bare in _FATAL_BARE_NAMES:
        return Category.FATAL
    if bare in _RETRYABLE_BARE_NAMES:
        return Category.RETRYABLE
    return Category.UNCLASSIFIED


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
    """Decorate a worker's `main` so an exception lands in the rank's error file.

    This is torch's `torch.distributed.elastic.multiprocessing.errors.record` (same file format, same
    behaviour) with a handler that also stores the exception's class hierarchy and the rank, which the
    launcher needs to classify subclasses (e.g. a `ConfigError(ValueError)` is fatal).
    """
    from torch.distributed.elastic.multiprocessing.errors import record

    return record(fn, error_handler=_hierarchy_recording_handler())


def _hierarchy_recording_handler():
    # torch is imported here, not at module level, so the launcher process never pays for it.
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    class HierarchyRecordingErrorHandler(ErrorHandler):
        def record_exception(self, e: BaseException) -> None:
            super().record_exception(e)
            path = self._get_error_file_path()
            if path and os.path.isfile(path):
                _add_extra_info(path, {MRO_KEY: exception_mro(e), RANK_KEY: os.environ.get("RANK")})

    return HierarchyRecordingErrorHandler()


def _add_extra_info(path: str, extra: dict[str, Any]) -> None:
    with open(path) as f:
        data = json.load(f)
    message = data.get("message")
    if isinstance(message, dict):
        message.setdefault("extraInfo", {}).update(extra)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)
