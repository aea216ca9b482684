"""bench/stage_dispatch.py's arithmetic: per-stage pool - local walls and their medians (the runs themselves
are the benchmark's: the demo pipeline on a simulated Ray cluster and on the embedded default, ~15 min)."""

from __future__ import annotations

import pytest

from bench.stage_dispatch import compare, placement_overrides


def _run(walls: dict[str, tuple[float, float]]) -> dict:
    return {"stages": {label: {"wall_s": wall, "body_s": body, "where": "x"} for label, (wall, body) in walls.items()}}


def test_compare_takes_the_median_of_per_stage_differences():
    pool = _run({"prepare": (5.0, 1.0), "sft": (30.0, 20.0), "eval-sft": (12.0, 6.0)})
    local = _run({"prepare": (2.0, 1.0), "sft": (29.0, 21.0), "eval-sft": (8.0, 5.0)})
    compared = compare(pool, local)
    assert [s["dispatch_s"] for s in compared["stages"].values()] == [3.0, 1.0, 4.0]
    assert compared["median_dispatch_s"] == 3.0
    # wall minus body: prepare 4-1, sft 10-8, eval 6-3
    assert compared["median_non_body_dispatch_s"] == 3.0


def test_compare_refuses_runs_of_different_stages():
    with pytest.raises(RuntimeError, match=r"different stages: \['grpo-1'\]"):
        compare(_run({"prepare": (1.0, 1.0), "grpo-1": (1.0, 1.0)}), _run({"prepare": (1.0, 1.0)}))


def test_only_the_pool_run_names_pools_and_a_cluster():
    assert placement_overrides("local") == []  # the defaults: the flow's embedded Ray
    pool = placement_overrides("pool", "127.0.0.1:6379")
    assert "launch.ray_address=127.0.0.1:6379" in pool
    assert {f"launch.{s}.pool=gpu-a" for s in ("prepare", "sft", "rollout", "grpo", "evaluate")} <= set(pool)
