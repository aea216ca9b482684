"""Group-relative advantages for GRPO.

Each prompt is sampled `group_size` times; the completions of one prompt form a group, and a completion's
advantage is its reward relative to its group:

    GRPO     A_i = (r_i - mean_g) / (std_g + eps)
    Dr.GRPO  A_i =  r_i - mean_g                      (cfg.normalize_std = False)

`std_g` is the sample standard deviation (Bessel-corrected). The returned keep mask marks the completions
that carry loss; a dropped one keeps its row and gets a zero response mask (`RLBatch.keep_rows`).

Once per rollout batch, on every rank, before splitting into mini-batches:

    advantages_B, keep_B, stats = compute_advantages(rewards_B, group_ids_B, cfg.grpo.advantage, truncated_B)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from forge_core.config.schema import AdvantageConfig


@dataclass(frozen=True)
class GroupStats:
    """Per-completion view of its group's reward statistics (float64, shape B)."""

    mean_B: torch.Tensor
    std_B: torch.Tensor
    zero_variance_B: torch.Tensor  # bool: every completion of the group got the same reward


def group_statistics(rewards_B: torch.Tensor, group_ids_B: torch.Tensor) -> GroupStats:
    """Mean, sample std and the zero-variance flag of each completion's group. Group ids may be any integers;
    a group of one completion counts as zero-variance."""
    rewards = rewards_B.to(torch.float64)
    _, group_B = torch.unique(group_ids_B, return_inverse=True)
    num_groups = int(group_B.max()) + 1
    count_G = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group_B, torch.ones_like(rewards))
    mean_G = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group_B, rewards) / count_G
    centred_B = rewards - mean_G[group_B]
    sq_G = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group_B, centred_B.square())
    std_G = (sq_G / (count_G - 1).clamp(min=1)).sqrt()
    # Exact comparison on purpose: a group is zero-variance only when the rewards are identical, and then
    # r - mean must be exactly 0 rather than a rounding residue divided by eps.
    max_G = torch.full((num_groups,), -torch.inf, dtype=torch.float64).scatter_reduce_(
        0, group_B, rewards, reduce="amax"
    )
    min_G = torch.full((num_groups,), torch.inf, dtype=torch.float64).scatter_reduce_(
        0, group_B, rewards, reduce="amin"
    )
    zero_var_G = (max_G == min_G) | (count_G < 2)
    return GroupStats(mean_B=mean_G[group_B], std_B=std_G[group_B], zero_variance_B=zero_var_G[group_B])


def compute_advantages(
    rewards_B: torch.Tensor,
    group_ids_B: torch.Tensor,
    cfg: AdvantageConfig,
    truncated_B: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Advantages (float32, B), the keep mask (bool, B) and rollout-batch statistics for logging.

    Truncated completions stay in their group's baseline but get no loss when `cfg.mask_truncated`. Dropped
    or masked completions have advantage 0. Raises ValueError for mismatched shapes or non-finite rewards.
    """
    if rewards_B.ndim != 1 or group_ids_B.shape != rewards_B.shape:
        raise ValueError(
            f"rewards_B {tuple(rewards_B.shape)} and group_ids_B {tuple(group_ids_B.shape)} must be 1-D and "
            "of the same length (one entry per completion)"
        )
    if not torch.isfinite(rewards_B).all():
        raise ValueError("rewards_B contains NaN or inf; check the reward functions in rollout.rewards")
    truncated = (
        torch.zeros_like(rewards_B, dtype=torch.bool) if truncated_B is None else truncated_B.to(torch.bool)
    )
    groups = group_statistics(rewards_B, group_ids_B)
    centred_B = rewards_B.to(torch.float64) - groups.mean_B
    scale_B = groups.std_B + cfg.eps if cfg.normalize_std else torch.ones_like(centred_B)
    advantages_B = torch.where(groups.zero_variance_B, 0.0, centred_B / scale_B)

    keep_B = torch.ones_like(truncated)
    if cfg.drop_zero_variance_groups:
        keep_B &= ~groups.zero_variance_B
    if cfg.mask_truncated:
        keep_B &= ~truncated
    advantages_B = torch.where(keep_B, advantages_B, 0.0)
    stats = _advantage_stats(rewards_B, advantages_B, keep_B, groups, truncated)
    return advantages_B.to(torch.float32), keep_B, stats


def _advantage_stats(
    rewards_B: torch.Tensor,
    advantages_B: torch.Tensor,
    keep_B: torch.Tensor,
    groups: GroupStats,
    truncated_B: torch.Tensor,
) -> dict[str, float]:
    rewards = rewards_B.to(torch.float64)
    kept_adv = advantages_B[keep_B]
    return {
        "reward/mean": rewards.mean().item(),
        "reward/std": rewards.std(correction=0).item(),
        "reward/group_std_mean": groups.std_B.mean().item(),
        "advantage/mean": kept_adv.mean().item() if kept_adv.numel() else 0.0,
        "advantage/std": kept_adv.std(correction=0).item() if kept_adv.numel() else 0.0,
        "advantage/abs_mean": kept_adv.abs().mean().item() if kept_adv.numel() else 0.0,
        "advantage/min": kept_adv.min().item() if kept_adv.numel() else 0.0,
        "advantage/max": kept_adv.max().item() if kept_adv.numel() else 0.0,
        "advantage/zero_variance_frac": groups.zero_variance_B.to(torch.float64).mean().item(),
        "advantage/truncated_frac": truncated_B.to(torch.float64).mean().item(),
        "advantage/kept_frac": keep_B.to(torch.float64).mean().item(),
    }
