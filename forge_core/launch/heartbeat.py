"""Per-rank heartbeats, so that a launch stopped at its deadline (or failed by a collective timeout) names the
rank that hung.

A rank's training loop calls `beat(rank, step, phase)` at fixed points; each beat replaces `rank-<rank>.json`
in the launch's private folder (`FORGE_HEARTBEAT_DIR`) with the rank's beat count, step, phase and wall-clock
time. Ranks of one job pass the same points in the same order (their collectives demand it), so the rank
whose count is behind the others' is the one that stopped making progress:

    rank 1 made no progress since step 1 (last heartbeat 'step 1 done' 56 s before the deadline); rank 0 had
    reached 'checkpoint at step 1'

Outside a launch (no `FORGE_HEARTBEAT_DIR`) `beat` does nothing.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

HEARTBEAT_DIR_ENV = "FORGE_HEARTBEAT_DIR"

_beats_sent = 0


@dataclass(frozen=True)
class Heartbeat:
    """A rank's last beat: how many it sent (`seq`), its optimizer step, where it was, when (time.time())."""

    rank: int
    seq: int
    step: int
    phase: str
    time: float


def beat(rank: int, step: int, phase: str) -> None:
    """Record that `rank` reached `phase` (e.g. "step 3 done") at optimizer step `step`; no-op outside a
    launch. Never raises: a heartbeat must not fail the training it reports on."""
    global _beats_sent
    folder = os.environ.get(HEARTBEAT_DIR_ENV)
    if not folder:
        return
    _beats_sent += 1
    record = {"rank": rank, "seq": _beats_sent, "step": step, "phase": phase, "time": time.time()}
    path = os.path.join(folder, f"rank-{rank}.json")
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, path)
    except OSError:
        pass  # a full or vanished folder: the launch's reason just lacks the note


def read_heartbeats(folder: str | Path) -> dict[int, Heartbeat]:
    """The last beat of every rank that sent one (unreadable files are skipped)."""
    beats = {}
    for path in Path(folder).glob("rank-*.json"):
        try:
            data = json.loads(path.read_text())
            found = Heartbeat(
                int(data["rank"]),
                int(data["seq"]),
                int(data["step"]),
                str(data["phase"]),
                float(data["time"]),
            )
        except (OSError, ValueError, KeyError, TypeError):
            continue
        beats[found.rank] = found
    return beats


def stall_note(
    beats: dict[int, Heartbeat], ranks: Iterable[int], at: float, event: str, when_level: bool = True
) -> str:
    """Which ranks stopped making progress, by their last beats, seen at `at` (time.time()) when `event`
    happened (e.g. "the deadline"). A rank that sent no beat while others did, or whose count is behind the
    furthest rank's, is named. When every rank is equally far the note says where they all stopped, or is
    "" unless `when_level`; it is "" too when no rank sent a beat (not a training stage)."""
    if not beats:
        return ""
    ahead = max(beats.values(), key=lambda b: (b.seq, -b.rank))
    silent = [r for r in sorted(ranks) if r not in beats]
    behind = sorted((b for b in beats.values() if b.seq < ahead.seq), key=lambda b: b.rank)
    notes = [f"rank {r} sent no heartbeat" for r in silent]
    notes += [
        f"rank {b.rank} made no progress since step {b.step} (last heartbeat '{b.phase}' "
        f"{max(0.0, at - b.time):.0f} s before {event})"
        for b in behind
    ]
    if not notes:
        if not when_level:
            return ""
        newest = max(b.time for b in beats.values())
        return (
            f"no rank made progress since '{ahead.phase}' at step {ahead.step} (last heartbeat "
            f"{max(0.0, at - newest):.0f} s before {event})"
        )
    return "; ".join([*notes, f"rank {ahead.rank} had reached '{ahead.phase}'"])
