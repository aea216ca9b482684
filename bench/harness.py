"""Helpers every forgeflow benchmark uses: interleaved timing, robust stats, the result file.

A benchmark `bench/<name>.py` compares our implementation (value) against a baseline in ONE process:

    from bench.harness import alternate, median, write_result
    ours_s, base_s = alternate(run_ours, run_baseline, warmup=1, repeats=5)
    write_result("sft_step", median(ours_s), median(base_s), target="<=1.10", unit="s/step",
                 details={"ours_s": ours_s, "baseline_s": base_s})

`write_result` writes `bench/results/<name>.json` and prints it as the last stdout line;
`python -m bench.run_all` runs every benchmark and rebuilds the table in bench/RESULTS.md.
"""

from __future__ import annotations

import gc
import json
import math
import operator
import re
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from forge_core.metrics.sampler import PeriodicSampler

RESULTS_DIR = Path(__file__).resolve().parent / "results"

_COMPARISONS: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge,
    "<=": operator.le,
    ">": operator.gt,
    "<": operator.lt,
    "==": operator.eq,
}
_TARGET_RE = re.compile(r"^\s*(>=|<=|==|>|<)\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*$")


def alternate(
    a_fn: Callable[[], Any], b_fn: Callable[[], Any], warmup: int = 1, repeats: int = 5
) -> tuple[list[float], list[float]]:
    """Time `a_fn` and `b_fn` interleaved in this process; returns (a_seconds, b_seconds), one per repeat.

    Both sides first run `warmup` untimed rounds (imports, caches, allocator). The order flips every round
    (a b, b a, a b, ...) so slow drift of the machine (thermal, other processes) hits both sides alike.
    """
    times = interleave({"a": a_fn, "b": b_fn}, warmup=warmup, repeats=repeats)
    return times["a"], times["b"]


def interleave(fns: dict[str, Callable[[], Any]], warmup: int = 1, repeats: int = 5) -> dict[str, list[float]]:
    """`alternate` for any number of sides: {name: seconds per repeat}. Every round runs each side once, the
    order rotated by one each round (with two sides: a b, b a, ...), after `warmup` untimed rounds."""
    if warmup < 0 or repeats < 1 or not fns:
        raise ValueError(
            f"interleave(warmup={warmup}, repeats={repeats}, {len(fns)} sides): need warmup >= 0, repeats >= 1 "
            "and at least one side"
        )
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    # Objects alive now (models, engines, imported libraries) outlive the benchmark: freezing them keeps
    # the per-call gc.collect() in _timed cheap, so it only sweeps what the sides allocate.
    gc.collect()
    gc.freeze()
    try:
        for round_index in range(repeats):
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                times[name].append(_timed(fns[name]))
    finally:
        gc.unfreeze()
    return times


def _timed(fn: Callable[[], Any]) -> float:
    gc.collect()  # garbage left by the other side must not be collected on this side's clock
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def median(values: Sequence[float]) -> float:
    """Median: robust to the one slow outlier a shared CI machine produces."""
    if not values:
        raise ValueError("median of no measurements; run at least one repeat")
    return float(statistics.median(values))


def summarize(values: Sequence[float]) -> dict[str, float]:
    """Median, min, max and interquartile range of a list of measurements (for `details`)."""
    ordered = sorted(values)
    middle = median(ordered)  # raises on an empty list
    q1, q3 = ordered[0], ordered[0]
    if len(ordered) >= 2:
        q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
    return {"median": middle, "min": ordered[0], "max": ordered[-1], "iqr": q3 - q1, "n": len(ordered)}


def parse_target(target: str) -> tuple[str, float]:
    """`">=0.95"` -> `(">=", 0.95)`; ValueError naming the accepted forms otherwise."""
    match = _TARGET_RE.match(target) if isinstance(target, str) else None
    if not match:
        raise ValueError(
            f"target={target!r}: expected a comparison of the ratio value/baseline, e.g. '>=0.95' or '<=1.1' "
            f"(operators: {', '.join(_COMPARISONS)})"
        )
    return match.group(1), float(match.group(2))


def target_met(ratio: float, target: str) -> bool:
    """Whether `ratio` (= value / baseline) satisfies `target`, e.g. `target_met(1.02, ">=0.95")` is True."""
    op, threshold = parse_target(target)
    return _COMPARISONS[op](ratio, threshold)


def write_result(
    name: str,
    value: float,
    baseline: float,
    target: str,
    unit: str,
    details: dict[str, Any] | None = None,
    results_dir: Path | None = None,
) -> dict[str, Any]:
    """Write `<results_dir>/<name>.json` (default bench/results), print it as the last line, return it.

    `ratio` = value / baseline; `target` is checked against the ratio (see `target_met`).
    """
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name or ""):
        raise ValueError(f"name={name!r}: use letters, digits, '_', '-' or '.' (it becomes the file name)")
    parse_target(target)
    if not (math.isfinite(value) and math.isfinite(baseline)) or baseline == 0:
        raise ValueError(f"value={value}, baseline={baseline}: both must be finite and the baseline non-zero")
    result = {
        "name": name,
        "value": float(value),
        "baseline": float(baseline),
        "ratio": float(value) / float(baseline),
        "target": target,
        "unit": unit,
        "details": details or {},
    }
    text = json.dumps(result, sort_keys=True)  # fails early on details that are not JSON
    folder = Path(results_dir) if results_dir is not None else RESULTS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.json").write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    print(text, flush=True)
    return result


class TreeMemorySampler(PeriodicSampler):
    """Peak over time of the summed RSS of a process and all its descendants."""

    def __init__(self, pid: int, interval_s: float = 0.5) -> None:
        super().__init__(interval_s, name="bench-memory")
        self.pid = pid
        self.peak_bytes = 0

    def sample(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self._tree_rss())

    def _tree_rss(self) -> int:
        import psutil

        try:
            root = psutil.Process(self.pid)
            processes = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return 0
        total = 0
        for process in processes:
            try:
                total += process.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return total
