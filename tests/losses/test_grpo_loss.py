"""GRPO policy losses against hand-computed values on small tensors.

Trainer log-probabilities are built as `generator + log(ratio)` so every token's ratio is a round number and
the expected losses can be worked out by hand (clip range [0.8, 1.28] unless a test says otherwise).
"""

from __future__ import annotations

import math

import pytest
import torch
from grpo_batches import make_rl_batch

from forge_core.config.schema import CorrectionConfig, LossConfig
from forge_core.losses.base import ModelOutputs
from forge_core.losses.correction import IcePop, NoCorrection
from forge_core.losses.grpo import (
    CISPOLoss,
    ClipRange,
    FixedHorizonLoss,
    GSPOLoss,
    KLPenalty,
    SequenceMeanLoss,
    TokenMeanLoss,
    build_policy_loss,
    k1_estimate,
    k3_estimate,
)

CLIP = ClipRange(low=0.2, high=0.28)
MAX_LOG_RATIO = 10.0

# Sequence 0: A = +1, ratios 1.5 (clipped high), 0.5 (below the low bound, but A > 0: unclipped), 1.1.
# Sequence 1: A = -2, ratios 0.5 (clipped low), 1.5 (above the high bound, but A < 0: unclipped), masked.
RATIOS = [[1.5, 0.5, 1.1], [0.5, 1.5, 0.7]]
MASK = [[True, True, True], [True, True, False]]
ADVANTAGES = [1.0, -2.0]
# Per-token losses -min(r * A, clip(r) * A):
#   seq 0: -1.28, -0.5, -1.1            (sum -2.88, 3 tokens)
#   seq 1: -(-1.6) = 1.6, -(-3.0) = 3.0 (sum  4.6, 2 tokens)
TOKEN_MEAN = (-2.88 + 4.6) / 5
SEQ_MEAN = (-2.88 / 3 + 4.6 / 2) / 2
FIXED_H4 = (-2.88 + 4.6) / (2 * 4)


def _inputs(ratios=RATIOS, advantages=ADVANTAGES, mask=MASK, ref=None):
    rows, cols = len(ratios), len(ratios[0])
    generator = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.25, -3.0]])[:rows, :cols]
    logprobs = (generator + torch.tensor(ratios).log()).requires_grad_(True)
    batch = make_rl_batch(
        advantages=torch.tensor(advantages),
        generator_logprobs=generator,
        response_mask=torch.tensor(mask),
        ref_logprobs=ref,
    )
    return ModelOutputs(target_logprobs_BL=logprobs), batch


def _run(loss_fn, out, batch):
    return loss_fn(out, batch, loss_fn.normalizer(batch))


@pytest.mark.parametrize(
    ("loss_fn", "normalizer", "expected"),
    [
        (TokenMeanLoss(CLIP, MAX_LOG_RATIO), 5.0, TOKEN_MEAN),
        (SequenceMeanLoss(CLIP, MAX_LOG_RATIO), 2.0, SEQ_MEAN),
        (FixedHorizonLoss(CLIP, MAX_LOG_RATIO, horizon=4), 8.0, FIXED_H4),
    ],
    ids=["token_mean", "seq_mean", "fixed_horizon"],
)
def test_each_aggregation_matches_hand_computed_value(loss_fn, normalizer, expected):
    out, batch = _inputs()
    assert loss_fn.normalizer(batch) == normalizer
    result = _run(loss_fn, out, batch)
    assert result.loss.item() == pytest.approx(expected, rel=1e-6)
    assert result.metrics["clip_low_count"].item() == 1
    assert result.metrics["clip_high_count"].item() == 1


def test_gradient_is_zero_exactly_where_a_clip_bound_is_active():
    out, batch = _inputs()
    _run(TokenMeanLoss(CLIP, MAX_LOG_RATIO), out, batch).loss.backward()
    # d/dlogp of -r * A is -r * A; divided by the 5 tokens. Clipped and masked tokens get nothing.
    expected = torch.tensor([[0.0, -0.5, -1.1], [0.0, 2.0 * 1.5, 0.0]]) / 5
    torch.testing.assert_close(out.target_logprobs_BL.grad, expected)


@pytest.mark.parametrize(
    ("clip", "loss", "clip_high"),
    [(ClipRange(0.2, 0.28), -1.25, 0), (ClipRange(0.2, 0.2), -1.2, 1)],
    ids=["clip_higher_0.28_leaves_1.25", "symmetric_0.2_clips_1.25"],
)
def test_high_clip_side(clip, loss, clip_high):
    out, batch = _inputs(ratios=[[1.25]], advantages=[1.0], mask=[[True]])
    result = _run(TokenMeanLoss(clip, MAX_LOG_RATIO), out, batch)
    assert result.loss.item() == pytest.approx(loss, rel=1e-6)
    assert result.metrics["clip_high_count"].item() == clip_high
    assert result.metrics["clip_low_count"].item() == 0


@pytest.mark.parametrize(
    ("clip", "loss", "clip_low"),
    [(ClipRange(0.2, 0.28), 0.8, 1), (ClipRange(0.3, 0.28), 0.75, 0)],
    ids=["low_0.2_clips_0.75", "low_0.3_leaves_0.75"],
)
def test_low_clip_side(clip, loss, clip_low):
    # A = -1, ratio 0.75: -min(-0.75, -max(0.75, 1 - low)).
    out, batch = _inputs(ratios=[[0.75]], advantages=[-1.0], mask=[[True]])
    result = _run(TokenMeanLoss(clip, MAX_LOG_RATIO), out, batch)
    assert result.loss.item() == pytest.approx(loss, rel=1e-6)
    assert result.metrics["clip_low_count"].item() == clip_low
    assert result.metrics["clip_high_count"].item() == 0


def test_log_ratio_is_clamped_before_exp():
    # log ratio 50 would overflow float32's exp; clamped to 2 it is e^2, and with A < 0 the unclipped side
    # -(e^2 * -1) is the loss. The clamp also stops the gradient (the token is past the safety bound).
    out, batch = _inputs(ratios=[[math.exp(50.0)]], advantages=[-1.0], mask=[[True]])
    result = _run(TokenMeanLoss(CLIP, max_log_ratio=2.0), out, batch)
    assert result.loss.item() == pytest.approx(math.exp(2.0), rel=1e-6)
    assert result.metrics["ratio_max"].item() == pytest.approx(math.exp(2.0), rel=1e-6)
    result.loss.backward()
    assert out.target_logprobs_BL.grad.item() == 0.0


def test_kl_estimators_match_hand_values():
    logp = torch.tensor([-1.0, -2.0])
    ref = torch.tensor([-1.5, -1.0])
    # k1 = logp - ref = [0.5, -1]; k3 = e^(ref - logp) - (ref - logp) - 1.
    torch.testing.assert_close(k1_estimate(logp - ref), torch.tensor([0.5, -1.0]))
    k3 = [math.exp(-0.5) + 0.5 - 1.0, math.exp(1.0) - 1.0 - 1.0]
    torch.testing.assert_close(k3_estimate(logp - ref), torch.tensor(k3))


def test_kl_log_ratio_is_clamped_so_k3_cannot_overflow():
    # ref 200 nats above the policy: unclamped k3 = e^200 overflows float32; clamped to 10 it is e^10 - 11.
    ref = torch.tensor([[198.0]])
    out, batch = _inputs(ratios=[[1.0]], advantages=[0.0], mask=[[True]], ref=ref)
    kl = KLPenalty(coef=1.0, estimator="k3", max_log_ratio=10.0)
    value = kl.per_token(out.target_logprobs_BL, batch)
    assert value.item() == pytest.approx(math.exp(10.0) - 10.0 - 1.0, rel=1e-6)


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_kl_penalty_adds_coef_times_kl_with_the_same_aggregation(estimator):
    generator = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.25, -3.0]])
    logprobs = generator + torch.tensor(RATIOS).log()
    # Reference logprobs 0.5 below the trainer's on seq 0, 0.3 above on seq 1 (and garbage where masked).
    ref = logprobs - torch.tensor([[0.5, 0.5, 0.5], [-0.3, -0.3, float("nan")]])
    out, batch = _inputs(ref=ref)
    kl_one = {"k1": [0.5, -0.3], "k3": [math.exp(-0.5) + 0.5 - 1, math.exp(0.3) - 0.3 - 1]}[estimator]
    kl_sum = 3 * kl_one[0] + 2 * kl_one[1]
    coef = 0.1
    loss_fn = TokenMeanLoss(CLIP, MAX_LOG_RATIO, kl=KLPenalty(coef=coef, estimator=estimator))
    result = _run(loss_fn, out, batch)
    assert result.loss.item() == pytest.approx(TOKEN_MEAN + coef * kl_sum / 5, rel=1e-5)
    assert result.metrics["kl_sum"].item() == pytest.approx(kl_sum, rel=1e-5)

    seq_fn = SequenceMeanLoss(CLIP, MAX_LOG_RATIO, kl=KLPenalty(coef=coef, estimator=estimator))
    expected_seq = SEQ_MEAN + coef * (kl_one[0] + kl_one[1]) / 2
    assert _run(seq_fn, out, batch).loss.item() == pytest.approx(expected_seq, rel=1e-5)


def test_kl_without_reference_logprobs_is_a_clear_error():
    out, batch = _inputs()
    loss_fn = TokenMeanLoss(CLIP, MAX_LOG_RATIO, kl=KLPenalty(coef=0.1))
    with pytest.raises(ValueError, match="kl_coef"):
        _run(loss_fn, out, batch)


def test_masked_tokens_contribute_nothing_even_when_their_inputs_are_garbage():
    generator = torch.tensor([[-1.0, float("nan"), -0.5], [-1.5, float("inf"), -3.0]])
    logprobs = torch.tensor([[-0.8, -4.0, -0.6], [-1.4, -0.1, -2.0]], requires_grad=True)
    mask = torch.tensor([[True, False, True], [True, False, False]])
    batch = make_rl_batch(
        advantages=torch.tensor([1.0, -1.0]), generator_logprobs=generator, response_mask=mask
    )
    loss_fn = TokenMeanLoss(CLIP, MAX_LOG_RATIO)
    result = loss_fn(ModelOutputs(logprobs), batch, loss_fn.normalizer(batch))
    result.loss.backward()
    # Three live tokens, none clipped: ratio e^0.2 = 1.22 and e^-0.1 with A = +1, e^0.1 with A = -1.
    expected = (-math.exp(0.2) - math.exp(-0.1) + math.exp(0.1)) / 3
    assert result.loss.item() == pytest.approx(expected, rel=1e-6)
    assert torch.isfinite(logprobs.grad).all()
    assert logprobs.grad[~mask].abs().sum().item() == 0.0
    assert result.metrics["tokens"].item() == 3
    assert all(torch.isfinite(v).all() for v in result.metrics.values())


def test_dropped_zero_variance_rows_leave_numerator_and_normalizer():
    out, batch = _inputs()
    kept = batch.keep_rows(torch.tensor([True, False]))
    for loss_fn, norm, expected in [
        (TokenMeanLoss(CLIP, MAX_LOG_RATIO), 3.0, -2.88 / 3),
        (SequenceMeanLoss(CLIP, MAX_LOG_RATIO), 1.0, -2.88 / 3),
        (FixedHorizonLoss(CLIP, MAX_LOG_RATIO, horizon=4), 4.0, -2.88 / 4),
    ]:
        assert loss_fn.normalizer(kept) == norm
        assert _run(loss_fn, out, kept).loss.item() == pytest.approx(expected, rel=1e-6)


def test_zero_global_normalizer_is_refused():
    out, batch = _inputs()
    with pytest.raises(ValueError, match="global_normalizer=0"):
        TokenMeanLoss(CLIP, MAX_LOG_RATIO)(out, batch, 0.0)


def test_metrics_are_sums_and_summarize_to_means():
    out, batch = _inputs()
    out.entropy_BL = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 100.0]])
    loss_fn = TokenMeanLoss(CLIP, MAX_LOG_RATIO)
    metrics = _run(loss_fn, out, batch).metrics
    live_ratios = [1.5, 0.5, 1.1, 0.5, 1.5]
    assert metrics["tokens"].item() == 5 and metrics["sequences"].item() == 2
    assert metrics["ratio_sum"].item() == pytest.approx(sum(live_ratios), rel=1e-6)
    assert metrics["ratio_max"].item() == pytest.approx(1.5, rel=1e-6)
    assert metrics["entropy_sum"].item() == pytest.approx(15.0)
    gaps = [abs(math.log(r)) for r in live_ratios]
    assert metrics["logprob_gap_sum"].item() == pytest.approx(sum(gaps), rel=1e-6)
    assert metrics["logprob_gap_max"].item() == pytest.approx(math.log(2.0), rel=1e-6)
    assert metrics["policy_loss_sum"].item() == pytest.approx(-2.88 + 4.6, rel=1e-6)

    logged = loss_fn.summarize({k: v.item() for k, v in metrics.items()})
    assert logged["policy/loss"] == pytest.approx(TOKEN_MEAN, rel=1e-6)
    assert logged["policy/clip_low_frac"] == pytest.approx(0.2)
    assert logged["policy/clip_high_frac"] == pytest.approx(0.2)
    assert logged["policy/ratio_mean"] == pytest.approx(sum(live_ratios) / 5, rel=1e-6)
    assert logged["policy/entropy"] == pytest.approx(3.0)
    assert logged["policy/logprob_gap_mean"] == pytest.approx(sum(gaps) / 5, rel=1e-6)
    assert loss_fn.max_reduced_metrics == {
        "ratio_max", "logprob_gap_max", "mismatch_abs_max", "mismatch_seq_ratio_max"
    }
    assert loss_fn.needs_entropy


@pytest.mark.parametrize(
    ("loss_type", "cls"),
    [
        ("clipped_token_mean", TokenMeanLoss),
        ("clipped_seq_mean", SequenceMeanLoss),
        ("clipped_fixed_horizon", FixedHorizonLoss),
        ("gspo", GSPOLoss),
        ("cispo", CISPOLoss),
    ],
)
def test_build_policy_loss_picks_the_class_named_by_config(loss_type, cls):
    loss_fn = build_policy_loss(LossConfig(type=loss_type, clip_low=0.1, clip_high=0.3), max_new_tokens=16)
    assert type(loss_fn) is cls
    assert loss_fn.clip == ClipRange(0.1, 0.3)
    assert loss_fn.kl is None
    assert loss_fn.correction == NoCorrection()
    corrected = build_policy_loss(
        LossConfig(type=loss_type), 16, CorrectionConfig(type="icepop", icepop_low=0.4, icepop_high=3.0)
    )
    assert corrected.correction == IcePop(low=0.4, high=3.0)


def test_build_policy_loss_horizon_and_kl():
    default = build_policy_loss(LossConfig(type="clipped_fixed_horizon"), max_new_tokens=16)
    explicit = build_policy_loss(LossConfig(type="clipped_fixed_horizon", horizon=64), max_new_tokens=16)
    assert (default.horizon, explicit.horizon) == (16, 64)
    with_kl = build_policy_loss(LossConfig(kl_coef=0.05, kl_estimator="k1"), max_new_tokens=16)
    assert with_kl.kl == KLPenalty(coef=0.05, estimator="k1", max_log_ratio=10.0)


def test_loss_config_checks_name_field_value_and_fix():
    errors = LossConfig(clip_low=1.0, clip_high=-0.1, max_log_ratio=0.0, kl_coef=-1.0, horizon=8).check()
    joined = "\n".join(errors)
    for field in ("clip_low=1.0", "clip_high=-0.1", "max_log_ratio=0.0", "kl_coef=-1.0", "horizon=8"):
        assert f"grpo.loss.{field}" in joined
    assert "clipped_fixed_horizon" in joined
    assert LossConfig().check() == []
    assert LossConfig(type="clipped_fixed_horizon", horizon=0).check() != []
