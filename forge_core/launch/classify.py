"""Turning an ended launch into an `Outcome`: error files, torchrun's failure summary, exit statuses.

Sources, most trusted first:
1. each rank's error file (`TORCHELASTIC_ERROR_FILE`, written by `record_errors` / torch's `record`):
   exception type, message, traceback and (with `record_errors`) the class hierarchy and rank;
2. torchrun's failure summary ("rank : 1 (local_rank: 1)", "exitcode : -9 (pid: ...)", "error_file: ..."):
   which ranks failed and how (a negative exit code is a signal);
3. the last exception line a rank printed (workers that do not use `record_errors`);
4. torchrun's own error file (rendezvous/agent failures when no rank reported anything).
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
import signal
import traceback
from collections.abc import Iterable
from dataclasses import dataclass

from forge_core.launch.errors import (
    CATEGORY_KEY,
    FIX_KEY,
    MRO_KEY,
    RANK_KEY,
    Category,
    Classification,
    category_of_exit_code,
    classification_of_mro,
    classification_of_name,
    classify_exception,
    qualified_name,
)
from forge_core.launch.result import LaunchResult, Outcome, RankError

TRACEBACK_LINES = 15
EXCEPTION_TAIL_LINES = 20
_RANK_FIELD = re.compile(r"^\s*rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)")
_EXITCODE_FIELD = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")
_ERROR_FILE_FIELD = re.compile(r"^\s*error_file\s*:\s*(\S+)")


@dataclass
class SummaryEntry:
    rank: int
    local_rank: int
    exitcode: int | None = None
    error_file: str | None = None


@dataclass(frozen=True)
class RecordedError:
    """One parsed error file."""

    exc_type: str
    message: str
    traceback: str
    category: Category
    rank: int | None
    timestamp: float | None
    fix: str | None = None


@dataclass(frozen=True)
class Decision:
    outcome: Outcome
    reason: str


def parse_failure_summary(lines: Iterable[str]) -> list[SummaryEntry]:
    entries: list[SummaryEntry] = []
    for line in lines:
        if m := _RANK_FIELD.match(line):
            entries.append(SummaryEntry(rank=int(m.group(1)), local_rank=int(m.group(2))))
        elif entries and (m := _EXITCODE_FIELD.match(line)):
            entries[-1].exitcode = int(m.group(1))
        elif entries and (m := _ERROR_FILE_FIELD.match(line)):
            path = m.group(1)
            entries[-1].error_file = path if os.path.isfile(path) else None
    return entries


def read_error_file(path: str) -> RecordedError | None:
    """Parse a torch elastic error file; None when it is absent or unreadable."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    message = data.get("message")
    if isinstance(message, str):  # the "new" flat format torch also accepts
        text, extra = message, {}
    elif isinstance(message, dict):
        text, extra = str(message.get("message", "")), message.get("extraInfo", {}) or {}
    else:
        return None
    exc_type, _, exc_message = text.partition(": ")
    found = _recorded_classification(extra, exc_type)
    rank = extra.get(RANK_KEY)
    return RecordedError(
        exc_type=exc_type,
        message=exc_message,
        traceback=_last_lines(str(extra.get("py_callstack", "")), TRACEBACK_LINES),
        category=found.category,
        rank=int(rank) if rank not in (None, "") else None,
        timestamp=_as_float(extra.get("timestamp")),
        fix=found.fix,
    )


def _recorded_classification(extra: dict, exc_type: str) -> Classification:
    """What the rank itself decided (record_errors classifies the instance), else by the recorded class
    hierarchy, else by the bare class name (plain torch `record`)."""
    recorded = extra.get(CATEGORY_KEY)
    if recorded in {c.value for c in Category}:
        fix = extra.get(FIX_KEY)
        return Classification(Category(recorded), fix if isinstance(fix, str) and fix else None)
    mro = extra.get(MRO_KEY)
    return classification_of_mro(mro) if mro else classification_of_name(exc_type)


def torchrun_rank_errors(
    log_dir: str,
    summary_lines: Iterable[str],
    last_exception: dict[int, tuple[str, str]],
    first_global_rank: int,
) -> dict[int, RankError]:
    """Per-rank errors of a torchrun launch from the error files under its --log-dir and its summary;
    `first_global_rank` (node_rank * nproc_per_node) maps a local rank to a global one where neither says."""
    entries = {e.rank: e for e in parse_failure_summary(summary_lines)}
    rank_of_file = {os.path.realpath(e.error_file): e.rank for e in entries.values() if e.error_file}
    errors: dict[int, RankError] = {}
    for path in sorted(glob.glob(os.path.join(log_dir, "*", "attempt_*", "*", "error.json"))):
        recorded = read_error_file(path)
        if recorded is None:
            continue
        local_rank = _int_or_none(os.path.basename(os.path.dirname(path)))
        rank = recorded.rank
        if rank is None:
            rank = rank_of_file.get(os.path.realpath(path), first_global_rank + (local_rank or 0))
        entry = entries.get(rank)
        errors[rank] = _from_recorded(rank, recorded, entry.exitcode if entry else None, local_rank)
    for rank, entry in entries.items():
        if rank not in errors:
            errors[rank] = _from_exit(rank, entry.exitcode, last_exception.get(rank), entry.local_rank)
    return dict(sorted(errors.items()))


def plain_rank_errors(
    error_file: str, returncode: int | None, last_exception: dict[int, tuple[str, str]]
) -> dict[int, RankError]:
    recorded = read_error_file(error_file)
    if recorded is not None:
        return {0: _from_recorded(0, recorded, returncode, None)}
    if returncode in (None, 0):
        return {}
    return {0: _from_exit(0, returncode, last_exception.get(0), None)}


def agent_error_reason(error_file: str) -> tuple[Category, str] | None:
    """torchrun's own failure (e.g. a rendezvous timeout), if it recorded one."""
    recorded = read_error_file(error_file)
    if recorded is None:
        return None
    category = recorded.category if recorded.category is not Category.UNCLASSIFIED else Category.RETRYABLE
    return category, f"torchrun: {recorded.exc_type}: {recorded.message}"


def decide_failure(rank_errors: dict[int, RankError], fallback: str) -> Decision:
    """Outcome of a launch that ended badly on its own (not deadline, not cancel).

    A fatal exception anywhere wins (no retry fixes it). Else anything retryable (a signal death, a
    transient exception) wins over unclassified exceptions, which are then most likely the collateral
    damage of the death (a peer's collective failing). Else an unclassified Python exception is fatal.
    Without any information the failure counts as retryable: the number of retries bounds the cost.
    """
    # torchrun SIGTERMs the surviving peers of a failed rank: their deaths follow from the failure, so they
    # neither decide the outcome nor name the cause unless nothing else failed (the whole group was stopped).
    causes = [e for e in rank_errors.values() if not _terminated_peer(e)] or list(rank_errors.values())
    by_category = {c: [e for e in causes if e.category == c.value] for c in Category}
    fatal, retryable = by_category[Category.FATAL], by_category[Category.RETRYABLE]
    python_errors = [e for e in by_category[Category.UNCLASSIFIED] if e.exc_type]
    if fatal:
        return Decision(Outcome.FATAL, _first(fatal).summary)
    if retryable:
        signalled = [e for e in retryable if e.exitcode is not None and e.exitcode < 0 and not e.exc_type]
        return Decision(Outcome.RETRYABLE, _first(signalled or retryable).summary)
    if python_errors:
        return Decision(Outcome.FATAL, _first(python_errors).summary)
    unexplained = causes
    return Decision(Outcome.RETRYABLE, _first(unexplained).summary if unexplained else fallback)


def exception_result(
    where: str, error: BaseException, duration_s: float, launch_id: str = ""
) -> LaunchResult:
    """The LaunchResult of `error` raised in this process rather than in a launched worker: classified as a
    lone rank's error file would be (unclassified is FATAL), with its message, fix and traceback tail."""
    found = classify_exception(error)
    retryable = found.category is Category.RETRYABLE
    summary = found.explain(f"{type(error).__name__}: {error}")
    tail = tuple("".join(traceback.format_exception(error)).splitlines()[-EXCEPTION_TAIL_LINES:])
    return LaunchResult(
        outcome=Outcome.RETRYABLE if retryable else Outcome.FATAL,
        returncode=None,
        reason=f"{where}: {summary}",
        tail=tail,
        rank_errors={
            0: RankError(
                rank=0,
                category=(Category.RETRYABLE if retryable else Category.FATAL).value,
                summary=summary,
                exc_type=qualified_name(type(error)),
                message=str(error),
                traceback="\n".join(tail),
            )
        },
        duration_s=duration_s,
        launch_id=launch_id,
    )


def _terminated_peer(error: RankError) -> bool:
    return error.exitcode == -signal.SIGTERM and not error.exc_type


def _from_recorded(rank: int, rec: RecordedError, exitcode: int | None, local_rank: int | None) -> RankError:
    return RankError(
        rank=rank,
        category=rec.category.value,
        summary=Classification(rec.category, rec.fix).explain(f"rank {rank}: {rec.exc_type}: {rec.message}"),
        exitcode=exitcode,
        exc_type=rec.exc_type,
        message=rec.message,
        traceback=rec.traceback,
        local_rank=local_rank,
        timestamp=rec.timestamp,
    )


def _from_exit(
    rank: int, exitcode: int | None, printed: tuple[str, str] | None, local_rank: int | None
) -> RankError:
    if exitcode is not None and exitcode < 0:
        return RankError(
            rank=rank,
            category=Category.RETRYABLE.value,
            summary=f"rank {rank}: killed by {_signal_name(-exitcode)} (exit {exitcode})",
            exitcode=exitcode,
            local_rank=local_rank,
        )
    by_code = category_of_exit_code(exitcode) if exitcode is not None else Category.UNCLASSIFIED
    if printed is not None and by_code is Category.UNCLASSIFIED:
        exc_type, message = printed
        found = classification_of_name(exc_type)
        return RankError(
            rank=rank,
            category=found.category.value,
            summary=found.explain(
                f"rank {rank}: {exc_type}: {message} (exit {exitcode}; from its output, no error file)"
            ),
            exitcode=exitcode,
            exc_type=exc_type,
            message=message,
            local_rank=local_rank,
        )
    return RankError(
        rank=rank,
        category=by_code.value,
        summary=f"rank {rank}: exited with code {exitcode} without an error record",
        exitcode=exitcode,
        local_rank=local_rank,
    )


def _first(errors: list[RankError]) -> RankError:
    return min(errors, key=lambda e: (e.timestamp if e.timestamp is not None else math.inf, e.rank))


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _last_lines(text: str, n: int) -> str:
    return "\n".join(text.rstrip().splitlines()[-n:])


def _as_float(value: object) -> float | None:
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def _int_or_none(text: str) -> int | None:
    return int(text) if text.isdigit() else None
