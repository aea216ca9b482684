"""Rollout staleness: how many policy updates lie between the policy that sampled a row and the one it trains.

Policy index: the SFT policy is 0, the policy after GRPO iteration k (0-based) is k+1. Iteration k trains
policy k, so a row for iteration k sampled by policy `policy_iteration` has staleness
`iteration - policy_iteration`. `grpo.mode=sync` means staleness 0; `async` allows up to `grpo.max_staleness`.
A row above the bound is a ValueError, never a silent off-policy update:

    metrics = check_staleness(table, cfg.grpo, source="inputs.rollouts=<uri>/rollouts.parquet")
    # {"rollout/staleness_mean": 0.5, "rollout/staleness_max": 1.0}

The staleness that is allowed is corrected in the loss (`grpo.correction`, forge_core.losses.correction).
"""

from __future__ import annotations

import logging

import numpy as np
import pyarrow as pa

from forge_core.config.schema import GRPOConfig

log = logging.getLogger(__name__)

STALENESS_MEAN = "rollout/staleness_mean"
STALENESS_MAX = "rollout/staleness_max"
ITERATION_COLUMN = "iteration"
POLICY_ITERATION_COLUMN = "policy_iteration"


def sampling_policy_index(iteration: int, mode: str, max_staleness: int) -> int:
    """The policy index that samples iteration `iteration`'s rollouts: k in sync, max(0, k - S) in async."""
    return max(0, iteration - staleness_bound(mode, max_staleness))


def staleness_bound(mode: str, max_staleness: int) -> int:
    """The largest staleness a mode allows: 0 for sync by definition, grpo.max_staleness for async."""
    return 0 if mode == "sync" else max_staleness


def rollouts_to_start(
    trains_next: int, started: int, iterations: int, mode: str, max_staleness: int
) -> list[tuple[int, int]]:
    """The rollouts to start, after the first `started`, when GRPO iteration `trains_next` is about to train:
    (iteration, sampling policy index) for every iteration up to trains_next + bound, each sampled by a
    policy that exists."""
    last = min(iterations - 1, trains_next + staleness_bound(mode, max_staleness))
    return [(j, sampling_policy_index(j, mode, max_staleness)) for j in range(started, last + 1)]


def row_staleness(table: pa.Table, source: str) -> np.ndarray:
    """Per-row staleness, `iteration - policy_iteration` (0 for a table without those columns). Raises
    ValueError for a row sampled by a policy newer than the one it trains."""
    if POLICY_ITERATION_COLUMN not in table.column_names or ITERATION_COLUMN not in table.column_names:
        log.warning("%s: no %s/%s columns; treating its rows as on-policy (staleness 0)",
                    source, ITERATION_COLUMN, POLICY_ITERATION_COLUMN)
        return np.zeros(table.num_rows, dtype=np.int64)
    iteration = np.asarray(table.column(ITERATION_COLUMN).to_pylist(), dtype=np.int64)
    policy = np.asarray(table.column(POLICY_ITERATION_COLUMN).to_pylist(), dtype=np.int64)
    staleness = iteration - policy
    if (staleness < 0).any():
        row = int(np.argmax(staleness < 0))
        raise ValueError(
            f"{source}: row {row} has {POLICY_ITERATION_COLUMN}={policy[row]} > {ITERATION_COLUMN}="
            f"{iteration[row]}: a rollout cannot be sampled by a policy newer than the one it trains; "
            "regenerate the rollouts with the rollout stage's params.policy_iteration <= params.iteration"
        )
    return staleness


def check_staleness(table: pa.Table, grpo: GRPOConfig, source: str) -> dict[str, float]:
    """Staleness metrics of a rollout table; ValueError if any row lags more than the mode allows."""
    staleness = row_staleness(table, source)
    bound = staleness_bound(grpo.mode, grpo.max_staleness)
    if staleness.size and staleness.max() > bound:
        too_stale = int((staleness > bound).sum())
        raise ValueError(
            f"{source}: {too_stale} of {staleness.size} rows have staleness up to {int(staleness.max())} "
            f"({ITERATION_COLUMN} - {POLICY_ITERATION_COLUMN}), above the bound {bound} of grpo.mode="
            f"{grpo.mode}, grpo.max_staleness={grpo.max_staleness}; train on rollouts from a newer policy, or "
            f"set grpo.mode=async and grpo.max_staleness>={int(staleness.max())}"
        )
    return {
        STALENESS_MEAN: float(staleness.mean()) if staleness.size else 0.0,
        STALENESS_MAX: float(staleness.max()) if staleness.size else 0.0,
    }
