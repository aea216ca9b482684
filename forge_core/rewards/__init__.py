"""Reward functions for rollouts and evaluation: a registry with versions, user functions by import path,
and weighted sums with one column per component.

    from forge_core.rewards import RewardSet, resolve_reward
    rewards = RewardSet.from_config(cfg.rollout.rewards)      # [{name: exact_answer, weight: 1.0}, ...]
    scored = rewards.score(completions, ground_truths, refs)  # .columns["reward_exact_answer"], .total
    resolve_reward("my_pkg.scoring:brevity").fn(text, truth)  # fn(completion, ground_truth, **kwargs)

Built-ins are listed in forge_core.rewards.builtin.
"""

from forge_core.rewards.answers import final_number, parse_number, tagged_answer
from forge_core.rewards.registry import RewardFn, RewardFunctionError, RewardSpec, register_reward
from forge_core.rewards.resolve import builtin_reward_names, resolve_reward
from forge_core.rewards.scoring import (
    COLUMN_PREFIX,
    TOTAL_COLUMN,
    RewardComponent,
    RewardSet,
    ScoredRewards,
    column_key,
    sample_context,
)

__all__ = [
    "COLUMN_PREFIX",
    "TOTAL_COLUMN",
    "RewardComponent",
    "RewardFn",
    "RewardFunctionError",
    "RewardSet",
    "RewardSpec",
    "ScoredRewards",
    "builtin_reward_names",
    "column_key",
    "final_number",
    "parse_number",
    "register_reward",
    "resolve_reward",
    "sample_context",
    "tagged_answer",
]
