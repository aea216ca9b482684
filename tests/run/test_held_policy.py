"""HeldPolicy: a trainer rank's engine between stages, and the save written behind its stage's commit."""

from __future__ import annotations

import threading

import pytest

from forge_core.engine import CheckpointRef
from forge_core.engine.checkpoint import PendingSave
from forge_core.run.scaffold import HeldPolicy

STAGE = "file:///store/grpo/abc"
WRITE_S = 0.5  # how long the write lasts unless the engine is handed out first


def _held_while_writing(order: list[str], handed_out: threading.Event, fails: bool = False) -> HeldPolicy:
    """A HeldPolicy holding an engine whose save behind the commit ends WRITE_S after it starts, or as soon as the
    engine has been handed out: a take or drop that did not wait for it would record itself first."""

    def write() -> None:
        handed_out.wait(WRITE_S)
        order.append("written")
        if fails:
            raise OSError("store unavailable")

    held = HeldPolicy(save_group=object())
    held.keep("engine", STAGE + "/", PendingSave(CheckpointRef(4, STAGE + "/_checkpoints/step-4"), write))
    return held


def test_the_engine_is_handed_out_only_once_its_state_is_written():
    """The save reads the engine's own tensors: taking the engine (the next stage trains it) waits for it."""
    order: list[str] = []
    handed_out = threading.Event()
    held = _held_while_writing(order, handed_out)
    assert held.holds(STAGE) and held.pending is not None
    engine = held.take(STAGE)
    order.append("taken")
    handed_out.set()
    assert (engine, order) == ("engine", ["written", "taken"])
    assert held.engine is None and held.pending is None


def test_dropping_the_engine_waits_too_and_a_failed_write_surfaces_there():
    order: list[str] = []
    handed_out = threading.Event()
    held = _held_while_writing(order, handed_out, fails=True)
    with pytest.raises(OSError, match="store unavailable"):
        held.take("file:///store/grpo/another")  # another policy: the engine is dropped
    order.append("dropped")
    handed_out.set()
    assert order == ["written", "dropped"]
    assert held.engine is None and held.pending is None
