"""PhaseClock: a stage's wall time split into named phases, as manifests record it (`phase/<name>_s`)."""

from __future__ import annotations

import itertools

from flows.report import phase_text
from forge_core.metrics import phases
from forge_core.metrics.phases import PhaseClock, phase_seconds


def test_laps_charge_the_time_since_the_previous_lap_and_a_repeated_phase_sums(monkeypatch):
    ticks = itertools.chain([10.0, 11.5, 14.0, 14.25, 20.0])
    monkeypatch.setattr(phases.time, "perf_counter", lambda: next(ticks))
    clock = PhaseClock()  # starts at 10.0
    assert clock.lap("load") == 1.5
    assert clock.lap("steps") == 2.5
    clock.lap("load")  # 0.25 more
    assert clock.lap("export") == 5.75
    assert clock.metrics() == {"phase/load_s": 1.75, "phase/steps_s": 2.5, "phase/export_s": 5.75}


def test_a_manifest_s_phases_read_back_in_order_and_the_table_shows_the_measurable_ones():
    metrics = {"reward/mean": 0.5, "phase/load_s": 0.8, "phase/score_s": 0.0, "phase/steps_s": 8.62, "wall_s": 11.0}
    assert phase_seconds(metrics) == {"load": 0.8, "score": 0.0, "steps": 8.62}
    assert phase_text(metrics) == "load 0.8s, steps 8.6s"
    assert phase_text({"rows": 3}) == ""
