"""bench.harness: interleaved timing, stats, target parsing and the result file."""

from __future__ import annotations

import json
import time

import pytest

from bench.harness import alternate, median, parse_target, summarize, target_met, write_result


def test_alternate_interleaves_after_warmup_and_flips_order():
    calls = []
    a_times, b_times = alternate(lambda: calls.append("a"), lambda: calls.append("b"), warmup=2, repeats=4)
    assert calls == ["a", "b"] * 2 + ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert len(a_times) == len(b_times) == 4 and all(t >= 0 for t in a_times + b_times)


def test_alternate_measures_the_slower_side_as_slower():
    a_times, b_times = alternate(lambda: time.sleep(0.02), lambda: None, warmup=0, repeats=3)
    assert median(a_times) > median(b_times)
    with pytest.raises(ValueError, match="repeats >= 1"):
        alternate(lambda: None, lambda: None, repeats=0)


def test_median_and_summary_are_robust_to_one_outlier():
    values = [1.0, 1.1, 0.9, 1.0, 50.0]
    assert median(values) == 1.0
    stats = summarize(values)
    assert (stats["median"], stats["min"], stats["max"], stats["n"]) == (1.0, 0.9, 50.0, 5)
    assert stats["iqr"] == pytest.approx(0.1)
    with pytest.raises(ValueError):
        median([])


@pytest.mark.parametrize(
    ("ratio", "target", "met"),
    [
        (0.96, ">=0.95", True),
        (0.94, ">=0.95", False),
        (1.10, "<=1.1", True),
        (1.2, " <= 1.1 ", False),
        (2.0, ">1", True),
        (1.0, ">1", False),
        (0.5, "<1e0", True),
        (1.0, "==1.0", True),
    ],
)
def test_target_met(ratio, target, met):
    assert target_met(ratio, target) is met


@pytest.mark.parametrize("target", ["0.95", ">= x", "=>0.9", "", "~1"])
def test_bad_targets_are_rejected_with_the_accepted_forms(target):
    with pytest.raises(ValueError, match="expected a comparison of the ratio"):
        parse_target(target)


def test_write_result_file_and_last_stdout_line(tmp_path, capsys):
    result = write_result("demo_step", 1.5, 1.2, ">=0.9", "s/step", {"repeats": 5}, results_dir=tmp_path)
    assert result["ratio"] == pytest.approx(1.25)
    on_disk = json.loads((tmp_path / "demo_step.json").read_text())
    assert on_disk == result
    assert set(on_disk) == {"name", "value", "baseline", "ratio", "target", "unit", "details"}
    last_line = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last_line) == result


def test_write_result_rejects_bad_input(tmp_path):
    with pytest.raises(ValueError, match="baseline non-zero"):
        write_result("x", 1.0, 0.0, ">=1", "s", {}, results_dir=tmp_path)
    with pytest.raises(ValueError, match="name="):
        write_result("../x", 1.0, 1.0, ">=1", "s", {}, results_dir=tmp_path)
    with pytest.raises(ValueError, match="target="):
        write_result("x", 1.0, 1.0, "fast", "s", {}, results_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []
