"""bench.harness.interleave: every side once per round, the order rotated, after untimed warm-up rounds."""

from __future__ import annotations

import pytest

from bench.harness import interleave


def test_interleave_rotates_the_order_of_three_sides():
    calls: list[str] = []
    times = interleave({k: (lambda k=k: calls.append(k)) for k in "abc"}, warmup=1, repeats=3)
    assert calls == list("abc" + "abc" + "bca" + "cab")
    assert {k: len(v) for k, v in times.items()} == {"a": 3, "b": 3, "c": 3}
    with pytest.raises(ValueError, match="at least one side"):
        interleave({})
