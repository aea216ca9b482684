"""DAPO's dynamic sampling: generate more rounds of prompts until the batch holds enough informative groups.

A group (one prompt's `group_size` samples) is informative when its rewards are not all equal; an
uninformative group has zero advantage and teaches GRPO nothing. Round 0 generates P = prompts_per_iteration
prompts; while fewer than `target_groups` groups are informative, another round of P fresh prompts runs, at
most `max_extra_rounds` times. Then P groups are kept, informative ones first, each in generation order, so the
GRPO batch always holds P groups (kept uninformative groups carry no loss).

Every generated row stays in the rollout table; `sampling_round` says which round made it and `kept` whether
GRPO trains on it. Iteration k owns prompt-stream slots k*(1+R) .. k*(1+R)+R (R = max_extra_rounds; R = 0 when
disabled), one per round, so rounds draw disjoint prompts and the stage is deterministic per seed.

    rounds = DynamicSampling(cfg.rollout.dynamic_sampling, groups_per_round=P)
    table, metrics = rounds.run(iteration, lambda slot, round_index: <generate + score that slot's prompts>)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from forge_core.config.schema import DynamicSamplingConfig
from forge_core.rewards import TOTAL_COLUMN
from forge_core.rollout.table import KEPT_COLUMN


def groups_in_order(table: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    """(group ids in order of first appearance, each row's index into that list)."""
    groups = np.asarray(table.column("group_id").to_pylist())
    ordered, first, codes = np.unique(groups, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    return ordered[order], rank[codes]


def informative_groups(table: pa.Table) -> list[int]:
    """Group ids whose rewards are not exactly all equal (as forge_core.trainers.advantages compares), in order
    of first appearance."""
    ids, codes = groups_in_order(table)
    rewards = np.asarray(table.column(TOTAL_COLUMN).to_pylist(), dtype=np.float64)
    low, high = np.full(len(ids), np.inf), np.full(len(ids), -np.inf)
    np.minimum.at(low, codes, rewards)
    np.maximum.at(high, codes, rewards)
    return [int(g) for g in ids[high != low]]


def kept_groups(table: pa.Table, keep: int) -> set[int]:
    """The `keep` groups GRPO trains on: informative ones first, then the rest, each in generation order."""
    informative = informative_groups(table)
    chosen = set(informative)
    rest = [int(g) for g in groups_in_order(table)[0] if int(g) not in chosen]
    return set((informative + rest)[:keep])


def with_kept(table: pa.Table, kept: set[int]) -> pa.Table:
    """`table` with its `kept` column set from the kept group ids."""
    flags = pa.array([g in kept for g in table.column("group_id").to_pylist()], type=pa.bool_())
    index = table.column_names.index(KEPT_COLUMN)
    return table.set_column(index, table.schema.field(KEPT_COLUMN), flags)


@dataclass(frozen=True)
class DynamicSampling:
    """The rounds of one rollout stage (see the module docstring)."""

    cfg: DynamicSamplingConfig
    groups_per_round: int

    @property
    def max_rounds(self) -> int:
        return 1 + (self.cfg.max_extra_rounds if self.cfg.enabled else 0)

    @property
    def target(self) -> int:
        return self.cfg.target_groups if self.cfg.target_groups is not None else self.groups_per_round

    def slot(self, iteration: int, round_index: int) -> int:
        """The prompt-stream slot (of groups_per_round prompts) that `round_index` of `iteration` samples."""
        assert 0 <= round_index < self.max_rounds, f"round {round_index} outside [0, {self.max_rounds})"
        return iteration * self.max_rounds + round_index

    def run(self, iteration: int, generate: Callable[[int, int], pa.Table]) -> tuple[pa.Table, dict[str, float]]:
        """Run rounds of `generate(slot, round_index)` (a scored rollout table) until the target is met or the
        rounds run out; returns every row with `kept` set, and the `dynamic_sampling/*` metrics."""
        tables: list[pa.Table] = []
        informative = 0
        while len(tables) < self.max_rounds and (not tables or informative < self.target):
            round_table = generate(self.slot(iteration, len(tables)), len(tables))
            tables.append(round_table)
            informative += len(informative_groups(round_table))
        table = pa.concat_tables(tables)
        kept = kept_groups(table, self.groups_per_round)
        table = with_kept(table, kept)
        kept_informative = len(kept & set(informative_groups(table)))
        metrics = {
            "dynamic_sampling/enabled": float(self.cfg.enabled),
            "dynamic_sampling/rounds": float(len(tables)),
            "dynamic_sampling/target_groups": float(self.target),
            "dynamic_sampling/groups_generated": float(len(groups_in_order(table)[0])),
            "dynamic_sampling/groups_kept": float(len(kept)),
            "dynamic_sampling/informative_generated": float(informative),
            "dynamic_sampling/informative_kept": float(kept_informative),
            "dynamic_sampling/target_reached": float(informative >= self.target),
        }
        return table, metrics
