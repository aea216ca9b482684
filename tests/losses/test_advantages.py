"""Group-relative advantages against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from forge_core.config.schema import AdvantageConfig
from forge_core.trainers.advantages import compute_advantages

# Three groups with non-contiguous, interleaved ids:
#   id 7: rewards 1, 0, 0, 1 -> mean 0.5, sample std sqrt((4 * 0.25) / 3) = sqrt(1/3)
#   id 3: rewards 1, 1, 1, 1 -> zero variance
#   id -1: rewards 2, 0     -> mean 1,   sample std sqrt(2 / 1) = sqrt(2)
REWARDS = torch.tensor([1.0, 1.0, 0.0, 1.0, 2.0, 0.0, 1.0, 1.0, 0.0, 1.0])
GROUPS = torch.tensor([7, 3, 7, 3, -1, 7, 3, 3, -1, 7])
STD7 = math.sqrt(1.0 / 3.0)
STD_NEG1 = math.sqrt(2.0)


def _approx(values):
    return pytest.approx(values, rel=1e-6, abs=1e-7)


def test_group_normalised_advantages_match_hand_values():
    eps = 1e-3
    cfg = AdvantageConfig(eps=eps, normalize_std=True, drop_zero_variance_groups=False)
    adv, keep, _ = compute_advantages(REWARDS, GROUPS, cfg)
    a7 = 0.5 / (STD7 + eps)
    a1 = 1.0 / (STD_NEG1 + eps)
    expected = [a7, 0.0, -a7, 0.0, a1, -a7, 0.0, 0.0, -a1, a7]
    assert adv.tolist() == _approx(expected)
    assert adv.dtype == torch.float32
    assert keep.all()


def test_epsilon_is_configurable():
    small = compute_advantages(REWARDS, GROUPS, AdvantageConfig(eps=0.0))[0]
    large = compute_advantages(REWARDS, GROUPS, AdvantageConfig(eps=1.0))[0]
    assert small[0].item() == _approx(0.5 / STD7)
    assert large[0].item() == _approx(0.5 / (STD7 + 1.0))


def test_dr_grpo_variant_does_not_divide_by_std():
    cfg = AdvantageConfig(normalize_std=False, drop_zero_variance_groups=False)
    adv, _, _ = compute_advantages(REWARDS, GROUPS, cfg)
    assert adv.tolist() == _approx([0.5, 0.0, -0.5, 0.0, 1.0, -0.5, 0.0, 0.0, -1.0, 0.5])


def test_zero_variance_groups_are_dropped_and_get_exactly_zero_advantage():
    # 0.1 summed four times and divided by 4 is not exactly 0.1 in floating point; the advantage must still be
    # exactly 0 rather than a rounding residue divided by eps.
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.1, 1.0, 0.0], dtype=torch.float32)
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    adv, keep, stats = compute_advantages(rewards, groups, AdvantageConfig(eps=1e-9))
    assert adv[:4].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert keep.tolist() == [False, False, False, False, True, True]
    assert stats["advantage/zero_variance_frac"] == _approx(4 / 6)
    assert stats["advantage/kept_frac"] == _approx(2 / 6)

    kept_all = compute_advantages(rewards, groups, AdvantageConfig(drop_zero_variance_groups=False))[1]
    assert kept_all.all()


def test_single_completion_group_counts_as_zero_variance():
    rewards, groups = torch.tensor([3.0, 1.0, 0.0]), torch.tensor([0, 1, 1])
    adv, keep, _ = compute_advantages(rewards, groups, AdvantageConfig())
    assert keep.tolist() == [False, True, True]
    assert adv[0].item() == 0.0


def test_truncated_completions_masked_but_still_in_the_baseline():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    groups = torch.tensor([0, 0, 0, 0])
    truncated = torch.tensor([False, False, True, True])
    cfg = AdvantageConfig(eps=0.0, mask_truncated=True)
    adv, keep, stats = compute_advantages(rewards, groups, cfg, truncated)
    # Baseline over all four: mean 0.25, sample std sqrt((0.5625 + 3 * 0.0625) / 3) = 0.5.
    assert adv.tolist() == _approx([1.5, -0.5, 0.0, 0.0])
    assert keep.tolist() == [True, True, False, False]
    assert stats["advantage/truncated_frac"] == _approx(0.5)

    unmasked, keep_all, _ = compute_advantages(rewards, groups, AdvantageConfig(eps=0.0), truncated)
    assert unmasked.tolist() == _approx([1.5, -0.5, -0.5, -0.5])
    assert keep_all.all()


def test_stats_report_rewards_and_kept_advantages():
    cfg = AdvantageConfig(eps=0.0, normalize_std=False)
    _, _, stats = compute_advantages(REWARDS, GROUPS, cfg)
    mean = sum(REWARDS.tolist()) / 10
    assert stats["reward/mean"] == _approx(mean)
    assert stats["reward/std"] == _approx(math.sqrt(sum((r - mean) ** 2 for r in REWARDS.tolist()) / 10))
    # Kept: group 7 (+-0.5) and group -1 (+-1); group 3 dropped.
    assert stats["advantage/max"] == _approx(1.0)
    assert stats["advantage/min"] == _approx(-1.0)
    assert stats["advantage/abs_mean"] == _approx((4 * 0.5 + 2 * 1.0) / 6)


def test_bad_inputs_raise_value_errors_naming_the_problem():
    with pytest.raises(ValueError, match="same length"):
        compute_advantages(torch.zeros(3), torch.zeros(4), AdvantageConfig())
    with pytest.raises(ValueError, match="NaN"):
        compute_advantages(torch.tensor([0.0, float("nan")]), torch.zeros(2), AdvantageConfig())
