"""What a launch ended as: `Outcome`, per-rank `RankError`, `LaunchResult`, `LaunchFailed`."""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field


class Outcome(str, enum.Enum):
    SUCCESS = "success"
    RETRYABLE = "retryable"
    FATAL = "fatal"
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class RankError:
    """Why one rank failed. `exc_type`/`message` come from its error file (or its last printed exception);
    `exitcode` is negative for a signal. `traceback` is the last lines of the Python traceback."""

    rank: int
    category: str
    summary: str
    exitcode: int | None = None
    exc_type: str | None = None
    message: str | None = None
    traceback: str = ""
    local_rank: int | None = None
    timestamp: float | None = None


@dataclass(frozen=True)
class LaunchResult:
    outcome: Outcome
    returncode: int | None
    reason: str
    tail: tuple[str, ...] = ()
    rank_errors: dict[int, RankError] = field(default_factory=dict)
    duration_s: float = 0.0
    launch_id: str = ""
    # Which rank stopped making progress, from the ranks' heartbeats (also at the end of `reason`); "" if none.
    stall: str = ""

    @property
    def ok(self) -> bool:
        return self.outcome is Outcome.SUCCESS

    def raise_for_outcome(self) -> LaunchResult:
        """Return self on SUCCESS, else raise `LaunchFailed` (its `.retryable` tells the caller whether to retry)."""
        if self.outcome is not Outcome.SUCCESS:
            raise LaunchFailed(self)
        return self

    def to_dict(self) -> dict:
        data = asdict(self)
        data["outcome"] = self.outcome.value
        data["tail"] = list(self.tail)
        return data

    @classmethod
    def from_dict(cls, data: dict) -> LaunchResult:
        """The result `to_dict` wrote (through JSON: rank keys come back as strings)."""
        errors = {int(rank): RankError(**error) for rank, error in (data.get("rank_errors") or {}).items()}
        return cls(
            outcome=Outcome(data["outcome"]),
            returncode=data.get("returncode"),
            reason=str(data.get("reason", "")),
            tail=tuple(data.get("tail") or ()),
            rank_errors=errors,
            duration_s=float(data.get("duration_s", 0.0)),
            launch_id=str(data.get("launch_id", "")),
            stall=str(data.get("stall", "")),
        )


class LaunchFailed(RuntimeError):
    """A launch that did not succeed; `.result` has everything, `.retryable` only for RETRYABLE outcomes.

    Its message is the worker's cause and fix (`reason`); the full output went to the task's log, its last
    lines stay in `.result.tail`."""

    def __init__(self, result: LaunchResult):
        self.result = result
        where = f"launch {result.launch_id}, " if result.launch_id else ""
        super().__init__(
            f"{result.reason} [{result.outcome.value}; {where}the worker's output and tracebacks are in the task log]"
        )

    @property
    def outcome(self) -> Outcome:
        return self.result.outcome

    @property
    def retryable(self) -> bool:
        return self.result.outcome is Outcome.RETRYABLE
