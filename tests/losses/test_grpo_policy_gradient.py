"""The GRPO losses on a real (tiny) policy with autograd: on-policy they are REINFORCE with a group
baseline, off-policy the ratio is against the generator's stored logprobs, and the gradient of a mini-batch
does not depend on how it is cut into micro-batches or ranks."""

from __future__ import annotations

import pytest
import torch
from grpo_batches import BATCH, HORIZON, policy_outputs, tiny_rollout

from forge_core.batch import plan_minibatches
from forge_core.config.schema import LossConfig
from forge_core.losses.base import reduce_metric_dicts
from forge_core.losses.grpo import build_policy_loss
from forge_core.models.logprobs import token_logprobs

LOSS_TYPES = ["clipped_token_mean", "clipped_seq_mean", "clipped_fixed_horizon"]


def _reinforce_weights(loss_type: str, mask: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """Per-token weight of logp in the REINFORCE-with-baseline objective, normalised like each loss type."""
    weights = mask * advantages[:, None]
    active = mask.any(dim=1).sum()
    if loss_type in ("clipped_token_mean", "cispo"):
        return weights / mask.sum()
    if loss_type in ("clipped_seq_mean", "gspo"):
        return weights / mask.sum(dim=1, keepdim=True).clamp(min=1) / active
    return weights / (active * HORIZON)


# On-policy (every ratio 1) GSPO is the sequence-mean and CISPO the token-mean REINFORCE gradient.
@pytest.mark.parametrize("loss_type", [*LOSS_TYPES, "gspo", "cispo"])
def test_on_policy_first_step_is_reinforce_with_group_baseline(loss_type):
    policy, batch = tiny_rollout()
    loss_fn = build_policy_loss(LossConfig(type=loss_type, horizon=_horizon(loss_type)), max_new_tokens=4)
    out = policy_outputs(policy, batch)
    result = loss_fn(out, batch, loss_fn.normalizer(batch))

    # Trainer and generator logprobs agree bit for bit, so every ratio is exactly 1 and nothing is clipped.
    tokens = batch.response_mask_BL.sum().item()
    assert result.metrics["ratio_max"].item() == 1.0
    assert result.metrics["ratio_sum"].item() == tokens
    assert result.metrics["logprob_gap_max"].item() == 0.0
    assert result.metrics["clip_low_count"].item() == result.metrics["clip_high_count"].item() == 0

    params = list(policy.parameters())
    grads = torch.autograd.grad(result.loss, params)
    logp = token_logprobs(policy(batch.input_ids_BL), batch.target_ids_BL)
    weights = _reinforce_weights(loss_type, batch.response_mask_BL, batch.advantages_B)
    reinforce = -(weights * logp).sum()
    expected = torch.autograd.grad(reinforce, params)
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    assert any(g.abs().sum() > 0 for g in grads)


def test_after_an_update_the_ratio_is_against_the_stored_generator_logprobs():
    policy, batch = tiny_rollout()
    loss_fn = build_policy_loss(LossConfig(), max_new_tokens=4)
    first = loss_fn(policy_outputs(policy, batch), batch, loss_fn.normalizer(batch))
    first.loss.backward()
    with torch.no_grad():
        for p in policy.parameters():
            p -= 20.0 * p.grad
    second = loss_fn(policy_outputs(policy, batch), batch, loss_fn.normalizer(batch))
    # A `logp - logp.detach()` ratio would still be exactly 1 here and never clip.
    tokens = second.metrics["tokens"].item()
    assert second.metrics["ratio_sum"].item() != pytest.approx(tokens, rel=1e-3)
    assert second.metrics["logprob_gap_max"].item() > 0.1
    clipped = second.metrics["clip_low_count"].item() + second.metrics["clip_high_count"].item()
    assert clipped > 0


def _horizon(loss_type: str) -> int | None:
    return HORIZON if loss_type == "clipped_fixed_horizon" else None


def _step_gradients(policy, batch, loss_fn, micro_rows):
    """Loss, gradients and reduced metrics of one optimizer step run as the given micro-batches."""
    policy.zero_grad()
    micro = [batch.select(rows) for rows in micro_rows]
    norm = sum(loss_fn.normalizer(mb) for mb in micro)
    total, metrics = 0.0, []
    for mb in micro:
        result = loss_fn(policy_outputs(policy, mb), mb, norm)
        result.loss.backward()
        total += result.loss.item()
        metrics.append(result.metrics)
    grads = [p.grad.clone() for p in policy.parameters()]
    return total, grads, reduce_metric_dicts(metrics, loss_fn.max_reduced_metrics)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_one_micro_batch_of_8_equals_8_shuffled_micro_batches_of_1(loss_type):
    policy, batch = tiny_rollout(off_policy_noise=0.3, with_ref=True)
    cfg = LossConfig(type=loss_type, horizon=_horizon(loss_type), kl_coef=0.1, kl_estimator="k3")
    loss_fn = build_policy_loss(cfg, max_new_tokens=4)

    (whole,) = plan_minibatches(BATCH, BATCH, BATCH, epochs=1, seed=3)
    (split,) = plan_minibatches(BATCH, BATCH, 1, epochs=1, seed=4)
    assert len(whole.micro_rows) == 1 and len(split.micro_rows) == 8
    loss_a, grads_a, metrics_a = _step_gradients(policy, batch, loss_fn, whole.micro_rows)
    loss_b, grads_b, metrics_b = _step_gradients(policy, batch, loss_fn, split.micro_rows)

    assert metrics_a["clip_low_count"] + metrics_a["clip_high_count"] > 0  # the clip is exercised
    assert loss_b == pytest.approx(loss_a, rel=1e-5)
    for a, b in zip(grads_a, grads_b, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
    for key in metrics_a:
        torch.testing.assert_close(metrics_b[key], metrics_a[key], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_two_ranks_of_two_micro_batches_equal_one_rank_of_eight(loss_type):
    """Data parallelism without processes: each rank's normalizer share is summed over ranks (the all-reduce
    SUM in TitanTrainer.global_normalizer) and gradients are summed over ranks (FSDP, division off)."""
    policy, batch = tiny_rollout(off_policy_noise=0.3, with_ref=True)
    cfg = LossConfig(type=loss_type, horizon=_horizon(loss_type), kl_coef=0.1)
    loss_fn = build_policy_loss(cfg, max_new_tokens=4)
    ranks = [plan_minibatches(BATCH, BATCH, 2, epochs=1, seed=5, dp_rank=r, dp_size=2)[0] for r in range(2)]
    micro_per_rank = [[batch.select(rows) for rows in step.micro_rows] for step in ranks]
    norm = sum(loss_fn.normalizer(mb) for micro in micro_per_rank for mb in micro)
    rank_grads = []
    for micro in micro_per_rank:
        policy.zero_grad()
        for mb in micro:
            loss_fn(policy_outputs(policy, mb), mb, norm).loss.backward()
        rank_grads.append([p.grad.clone() for p in policy.parameters()])
    summed = [a + b for a, b in zip(*rank_grads, strict=True)]

    _, single, _ = _step_gradients(policy, batch, loss_fn, [torch.arange(BATCH)])
    assert norm == loss_fn.normalizer(batch)
    for got, want in zip(summed, single, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
