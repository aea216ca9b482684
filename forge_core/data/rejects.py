"""Rejected rows: why a source row did not make it into a split, kept as a table instead of dropped.

The prepare stage writes rejects to `rejects.parquet`, counts them per reason, and fails when their share
passes `data.max_reject_fraction` (`check_reject_share`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum


class RejectReason(str, Enum):
    MISSING_FIELD = "missing_field"  # the field is absent or null
    EMPTY_FIELD = "empty_field"  # the field is an empty or whitespace-only string
    WRONG_TYPE = "wrong_type"  # the field is not a string (or a number, for ground truth)
    INVALID_UTF8 = "invalid_utf8"  # the bytes of the row are not valid UTF-8
    INVALID_JSON = "invalid_json"  # a JSONL line that does not parse to an object
    MALFORMED_ROW = "malformed_row"  # a CSV row with the wrong number of columns
    FIELD_TOO_LARGE = "field_too_large"  # a CSV field over 1 MiB (forge_core.data.sources.CSV_MAX_FIELD_BYTES)
    LINE_TOO_LARGE = "line_too_large"  # a JSONL line over data.max_line_bytes (never parsed)
    INVALID_MESSAGES = "invalid_messages"  # a chat record that is not user/.../assistant messages
    UNPARSABLE_GROUND_TRUTH = "unparsable_ground_truth"  # e.g. a GSM8K answer without "#### <number>"
    TOO_LONG = "too_long"  # prompt + completion + EOS exceed data.max_seq_len tokens


class RejectThresholdExceeded(ValueError):
    """More rows were rejected than `data.max_reject_fraction` allows."""


@dataclass(frozen=True)
class Reject:
    source: str  # the file (URI) or generator the row came from
    source_row: int  # 1-based: the line number (JSONL, CSV) or row number (Parquet, save_to_disk) in that source
    reason: RejectReason
    detail: str
    raw: str  # the row as read, for inspection with any Parquet tool


def raw_text(values: dict) -> str:
    """A readable JSON rendering of a row's fields (bytes and odd types shown with repr)."""
    return json.dumps(values, ensure_ascii=False, sort_keys=True, default=repr)


class RejectCounter:
    """Counts of rows read and rejected, per reason, plus the first few rejects for error messages."""

    def __init__(self, keep_examples: int = 5) -> None:
        self.rows_read = 0
        self.by_reason: dict[str, int] = {}
        self.examples: list[Reject] = []
        self._keep_examples = keep_examples

    @property
    def rejected(self) -> int:
        return sum(self.by_reason.values())

    def add(self, rejects: list[Reject]) -> None:
        for reject in rejects:
            self.by_reason[reject.reason.value] = self.by_reason.get(reject.reason.value, 0) + 1
            if len(self.examples) < self._keep_examples:
                self.examples.append(reject)

    def share(self) -> float:
        return self.rejected / self.rows_read if self.rows_read else 0.0

    def summary(self) -> str:
        counts = ", ".join(f"{reason}={n}" for reason, n in sorted(self.by_reason.items())) or "none"
        return f"{self.rejected} of {self.rows_read} rows rejected ({self.share():.1%}): {counts}"


def check_reject_share(counter: RejectCounter, max_fraction: float, source: str) -> None:
    """Raise RejectThresholdExceeded, naming counts, examples and fixes, when too many rows were rejected or
    none were read."""

    if counter.rows_read == 0:
        raise RejectThresholdExceeded(f"data.source={source!r}: no rows read; the source is empty")
    if counter.share() <= max_fraction:
        return
    examples = "; ".join(
        f"{r.source} row {r.source_row}: {r.reason.value} ({r.detail})" for r in counter.examples
    )
    raise RejectThresholdExceeded(
        f"data.source={source!r}: {counter.summary()}, above data.max_reject_fraction={max_fraction}. "
        f"Examples: {examples}. Fix the rows, adjust the column mapping (data.prompt_field, ...) or "
        "data.max_seq_len, or raise data.max_reject_fraction to accept the loss"
    )
