"""Where a stage's wall time goes, phase by phase: the manifest's `phase/<name>_s` metrics.

    phases = PhaseClock()
    ...load the model...
    phases.lap("load")
    ...train...
    phases.lap("steps")
    metrics.update(phases.metrics())     # {"phase/load_s": ..., "phase/steps_s": ...}
"""

from __future__ import annotations

import time

PHASE_PREFIX = "phase/"


class PhaseClock:
    """Splits elapsed time into named phases; a phase lapped twice sums both laps."""

    def __init__(self) -> None:
        self._last = time.perf_counter()
        self._seconds: dict[str, float] = {}

    def lap(self, phase: str) -> float:
        """Charge the time since the last lap to `phase`. Returns that lap's seconds."""
        now = time.perf_counter()
        seconds, self._last = now - self._last, now
        self._seconds[phase] = self._seconds.get(phase, 0.0) + seconds
        return seconds

    def metrics(self) -> dict[str, float]:
        """{"phase/<name>_s": seconds}, in the order the phases were first charged."""
        return {f"{PHASE_PREFIX}{name}_s": seconds for name, seconds in self._seconds.items()}


def phase_seconds(metrics: dict) -> dict[str, float]:
    """{name: seconds} of the `phase/<name>_s` entries of a manifest's metrics, in their order."""
    return {
        key[len(PHASE_PREFIX) : -len("_s")]: float(value)
        for key, value in metrics.items()
        if key.startswith(PHASE_PREFIX) and key.endswith("_s") and isinstance(value, (int, float))
    }
