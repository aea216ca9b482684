"""Progress lines: how a worker tells its launcher (and the Prefect UI) how far it is.

A worker prints `FORGE_PROGRESS {"stage": "sft", "step": 30, "total": 300}` on rank 0 and the stage task turns
such stdout lines into a progress artifact: a text protocol keeps forge_core free of Prefect and works under
torchrun, a plain process or a remote node alike.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

PREFIX = "FORGE_PROGRESS "


@dataclass(frozen=True)
class Progress:
    stage: str
    step: int
    total: int

    @property
    def fraction(self) -> float:
        return min(1.0, self.step / self.total) if self.total > 0 else 0.0


def progress_line(stage: str, step: int, total: int) -> str:
    return PREFIX + json.dumps({"stage": stage, "step": int(step), "total": int(total)}, sort_keys=True)


def emit_progress(stage: str, step: int, total: int) -> None:
    print(progress_line(stage, step, total), flush=True)


def parse_progress_line(line: str) -> Progress | None:
    """The Progress in a log line, or None for any other line (torchrun may prefix lines with `[rank]:`)."""
    start = line.find(PREFIX)
    if start < 0:
        return None
    try:
        payload = json.loads(line[start + len(PREFIX) :])
        return Progress(stage=str(payload["stage"]), step=int(payload["step"]), total=int(payload["total"]))
    except (ValueError, KeyError, TypeError):
        return None
