"""GRPO-family policy losses: a surrogate (PPO's per-token clip, GSPO's sequence ratio or CISPO's clipped IS
weight), an optional mismatch correction, an optional KL penalty to a frozen reference, and an aggregation.

The ratio is `exp(logp_trainer - logp_base)` with the base logprobs *stored in the batch*
(`correction.ratio_base`), never `logp - logp.detach()`, which is always 1 so clipping would never act.
Surrogates, corrections and aggregations only combine tokens of one row, so the split-invariance of
forge_core.losses.base holds for all of them.

    loss_fn = build_policy_loss(cfg.grpo.loss, cfg.rollout.sampling.max_new_tokens, cfg.grpo.correction)
    metrics = trainer.train_step(micro_batches, loss_fn)     # RLBatch micro-batches of one mini-batch
    # metrics: loss, policy/* (summarize_policy_metrics), mismatch/* and correction/* (with old logprobs)
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from forge_core.config.schema import CorrectionConfig, LossConfig
from forge_core.losses.base import Loss, LossOutput, ModelOutputs
from forge_core.losses.correction import (
    MISMATCH_MAX_KEYS,
    Correction,
    NoCorrection,
    build_correction,
    mismatch_sums,
    summarize_mismatch,
)

if TYPE_CHECKING:
    # Type-only: the trainer package imports the losses, so a runtime import here would be circular.
    from forge_core.batch import RLBatch


@dataclass(frozen=True)
class ClipRange:
    """The ratio is clipped to [1 - low, 1 + high]; high > low is DAPO's clip-higher."""

    low: float
    high: float


@dataclass(frozen=True)
class SurrogateTerms:
    loss_BL: torch.Tensor  # the per-token policy loss to minimise; 0 outside the response mask
    ratio_BL: torch.Tensor  # detached
    clipped_low_BL: torch.Tensor  # bool: the lower clip bound is active
    clipped_high_BL: torch.Tensor  # bool: the upper clip bound is active


def _base_where_masked(logprobs_BL: torch.Tensor, base_logprobs_BL: torch.Tensor, mask_BL: torch.Tensor):
    """(fp32 logprobs, fp32 base logprobs with the trainer's own detached values outside the mask), so padding
    in the base (zeros, NaN) cannot leak into a ratio or a gradient."""
    logprobs = logprobs_BL.float()
    return logprobs, torch.where(mask_BL, base_logprobs_BL.float(), logprobs.detach())


def _ppo_clip(
    ratio_BL: torch.Tensor, advantages_B: torch.Tensor, mask_BL: torch.Tensor, clip: ClipRange
) -> SurrogateTerms:
    """-min(ratio * A, clip(ratio) * A) per token: where a clip bound is active the token's gradient is 0."""
    adv = advantages_B.float()[:, None]
    unclipped = ratio_BL * adv
    clipped = ratio_BL.clamp(1.0 - clip.low, 1.0 + clip.high) * adv
    loss = torch.where(mask_BL, -torch.minimum(unclipped, clipped), 0.0)
    ratio_d = ratio_BL.detach()
    return SurrogateTerms(
        loss_BL=loss,
        ratio_BL=ratio_d,
        clipped_low_BL=mask_BL & (adv < 0) & (ratio_d < 1.0 - clip.low),
        clipped_high_BL=mask_BL & (adv > 0) & (ratio_d > 1.0 + clip.high),
    )


def clipped_surrogate(
    logprobs_BL: torch.Tensor,
    base_logprobs_BL: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_BL: torch.Tensor,
    clip: ClipRange,
    max_log_ratio: float,
) -> SurrogateTerms:
    """PPO's per-token clipped surrogate with separate low/high clip, as a loss to minimise; the ratio is
    exp(logp - base) per token. Masked positions get loss 0 and ratio 1."""
    logprobs, base = _base_where_masked(logprobs_BL, base_logprobs_BL, mask_BL)
    ratio = torch.exp((logprobs - base).clamp(-max_log_ratio, max_log_ratio))
    return _ppo_clip(ratio, advantages_B, mask_BL, clip)


def gspo_surrogate(
    logprobs_BL: torch.Tensor,
    base_logprobs_BL: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_BL: torch.Tensor,
    clip: ClipRange,
    max_log_ratio: float,
) -> SurrogateTerms:
    """GSPO-token: every token of sequence i carries the sequence ratio s_i = exp(mean_t log(pi / pi_base)),
    written sg[s_i] * pi_t / sg[pi_t] so that its value is s_i and its gradient is s_i * grad log pi_t; then
    PPO's clip. Averaged over each sequence's tokens (`SequenceMeanLoss`), this is GSPO's sequence objective
    -min(s_i A_i, clip(s_i) A_i) with gradient s_i A_i / |y_i| * sum_t grad log pi_t while unclipped."""
    logprobs, base = _base_where_masked(logprobs_BL, base_logprobs_BL, mask_BL)
    tokens_B = mask_BL.sum(dim=1).clamp(min=1)
    seq_log_ratio_B = (logprobs.detach() - base).sum(dim=1) / tokens_B
    log_ratio = seq_log_ratio_B[:, None] + (logprobs - logprobs.detach())
    ratio = torch.exp(log_ratio.clamp(-max_log_ratio, max_log_ratio))
    return _ppo_clip(ratio, advantages_B, mask_BL, clip)


def cispo_surrogate(
    logprobs_BL: torch.Tensor,
    base_logprobs_BL: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_BL: torch.Tensor,
    clip: ClipRange,
    max_log_ratio: float,
) -> SurrogateTerms:
    """CISPO: -sg(clip(ratio, 1 - low, 1 + high)) * A * log pi per token. The clip bounds the detached
    importance weight instead of cutting the token out, so every token keeps a gradient (REINFORCE with a
    clipped IS weight); a bound is reported active whenever it clipped the weight, whatever A's sign."""
    logprobs, base = _base_where_masked(logprobs_BL, base_logprobs_BL, mask_BL)
    ratio = torch.exp((logprobs.detach() - base).clamp(-max_log_ratio, max_log_ratio))
    weight = ratio.clamp(1.0 - clip.low, 1.0 + clip.high)
    adv = advantages_B.float()[:, None]
    loss = torch.where(mask_BL, -(weight * adv) * logprobs, 0.0)
    return SurrogateTerms(
        loss_BL=loss,
        ratio_BL=ratio,
        clipped_low_BL=mask_BL & (ratio < 1.0 - clip.low),
        clipped_high_BL=mask_BL & (ratio > 1.0 + clip.high),
    )


def k1_estimate(log_ratio_BL: torch.Tensor) -> torch.Tensor:
    """k1: the log ratio logp - ref_logp itself (unbiased, can be negative)."""
    return log_ratio_BL


def k2_estimate(log_ratio_BL: torch.Tensor) -> torch.Tensor:
    """k2: (logp - ref_logp)^2 / 2 (never negative, low variance, biased)."""
    return 0.5 * log_ratio_BL.square()


def k3_estimate(log_ratio_BL: torch.Tensor) -> torch.Tensor:
    """k3: exp(ref - logp) - (ref - logp) - 1 (unbiased and never negative; GRPO's choice)."""
    return torch.exp(-log_ratio_BL) + log_ratio_BL - 1.0


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "k1": k1_estimate,
    "k2": k2_estimate,
    "k3": k3_estimate,
}


@dataclass(frozen=True)
class KLPenalty:
    """Per-token `coef * KL(pi || ref)` estimate against the frozen reference policy's logprobs. The log
    ratio is clamped to +-max_log_ratio first, as in the surrogate, so k3's exp cannot overflow."""

    coef: float
    estimator: str = "k3"
    max_log_ratio: float = 10.0

    def __post_init__(self) -> None:
        if self.estimator not in KL_ESTIMATORS:
            raise ValueError(
                f"grpo.loss.kl_estimator={self.estimator!r}: unknown; choose one of {sorted(KL_ESTIMATORS)}"
            )

    def per_token(self, logprobs_BL: torch.Tensor, batch: RLBatch) -> torch.Tensor:
        """The unweighted KL estimate per token, 0 outside the response mask. Raises ValueError when the batch
        has no reference logprobs."""
        if batch.ref_logprobs_BL is None:
            raise ValueError(
                f"grpo.loss.kl_coef={self.coef}: the batch has no ref_logprobs_BL; compute the frozen "
                "reference policy's logprobs for every rollout batch, or set grpo.loss.kl_coef=0"
            )
        mask = batch.response_mask_BL
        logprobs = logprobs_BL.float()
        ref = torch.where(mask, batch.ref_logprobs_BL.float(), logprobs.detach())
        log_ratio = (logprobs - ref).clamp(-self.max_log_ratio, self.max_log_ratio)
        return torch.where(mask, KL_ESTIMATORS[self.estimator](log_ratio), 0.0)


class ClippedPolicyLoss(Loss):
    """Shared body of the GRPO-family losses: surrogate (+ correction weight, + KL), metrics, and the division by
    the global normalizer. Subclasses define the aggregation (`normalizer`, `aggregate`) and may replace the
    surrogate."""

    # Entropy is only logged (computed without grad).
    needs_entropy = True
    max_reduced_metrics = frozenset({"ratio_max", "logprob_gap_max"}) | MISMATCH_MAX_KEYS
    surrogate = staticmethod(clipped_surrogate)

    def __init__(
        self,
        clip: ClipRange,
        max_log_ratio: float,
        kl: KLPenalty | None = None,
        correction: Correction | None = None,
    ) -> None:
        self.clip = clip
        self.max_log_ratio = max_log_ratio
        self.kl = kl
        self.correction = correction if correction is not None else NoCorrection()

    @abstractmethod
    def normalizer(self, batch: RLBatch) -> float:
        """This micro-batch's share of the global denominator."""

    @abstractmethod
    def aggregate(self, loss_BL: torch.Tensor, mask_BL: torch.Tensor) -> torch.Tensor:
        """This micro-batch's numerator: a scalar sum of (already masked) per-token losses."""

    def __call__(self, out: ModelOutputs, batch: RLBatch, global_normalizer: float) -> LossOutput:
        if not global_normalizer > 0:
            raise ValueError(
                f"global_normalizer={global_normalizer}: must be > 0; skip mini-batches in which no "
                "completion carries loss (e.g. every group was dropped for zero reward variance)"
            )
        mask = batch.response_mask_BL
        terms = self.surrogate(
            out.target_logprobs_BL,
            self.correction.ratio_base(batch),
            batch.advantages_B,
            mask,
            self.clip,
            self.max_log_ratio,
        )
        # The weight is 1 without a correction: multiplying by it changes no bit of the loss or its gradient.
        weights = self.correction.weights(batch)
        per_token_BL = terms.loss_BL * weights.weight_BL
        kl_BL = None
        if self.kl is not None:
            kl_BL = self.kl.per_token(out.target_logprobs_BL, batch)
            per_token_BL = per_token_BL + self.kl.coef * kl_BL
        loss = self.aggregate(per_token_BL, mask) / global_normalizer
        metrics = {**policy_metrics(out, batch, terms, kl_BL), **mismatch_sums(batch, weights)}
        return LossOutput(loss=loss, metrics=metrics)

    def summarize(self, reduced: dict[str, float]) -> dict[str, float]:
        return {
            **summarize_policy_metrics(reduced),
            **summarize_mismatch(reduced, float(reduced["tokens"]), float(reduced["sequences"])),
        }


class TokenMeanLoss(ClippedPolicyLoss):
    """Sum over every response token of the mini-batch / their count (DAPO; TRL's and torchtitan's default).
    Long completions weigh more, in proportion to their length."""

    def normalizer(self, batch: RLBatch) -> float:
        return float(batch.response_mask_BL.sum())

    def aggregate(self, loss_BL: torch.Tensor, mask_BL: torch.Tensor) -> torch.Tensor:
        return loss_BL.sum()


class SequenceMeanLoss(ClippedPolicyLoss):
    """Mean over each completion's tokens, then mean over completions (the original GRPO objective).
    Completions without response tokens (dropped ones) count in neither."""

    def normalizer(self, batch: RLBatch) -> float:
        return float(active_sequences(batch.response_mask_BL).sum())

    def aggregate(self, loss_BL: torch.Tensor, mask_BL: torch.Tensor) -> torch.Tensor:
        tokens_B = mask_BL.sum(dim=1).clamp(min=1)
        return (loss_BL.sum(dim=1) / tokens_B).sum()


class FixedHorizonLoss(ClippedPolicyLoss):
    """Sum over tokens / (completions * horizon) (Dr.GRPO): a constant per-token weight, so neither length
    nor the number of tokens in the batch biases the gradient."""

    def __init__(
        self,
        clip: ClipRange,
        max_log_ratio: float,
        horizon: int,
        kl: KLPenalty | None = None,
        correction: Correction | None = None,
    ):
        super().__init__(clip, max_log_ratio, kl, correction)
        if horizon < 1:
            raise ValueError(f"grpo.loss.horizon={horizon}: must be >= 1")
        self.horizon = horizon

    def normalizer(self, batch: RLBatch) -> float:
        return float(active_sequences(batch.response_mask_BL).sum()) * self.horizon

    def aggregate(self, loss_BL: torch.Tensor, mask_BL: torch.Tensor) -> torch.Tensor:
        return loss_BL.sum()


class GSPOLoss(SequenceMeanLoss):
    """GSPO: one clipped ratio per sequence, the geometric mean of its token ratios, averaged over sequences.
    Clip bounds act on that mean, so they must be far tighter than per-token ones."""

    surrogate = staticmethod(gspo_surrogate)


class CISPOLoss(TokenMeanLoss):
    """CISPO: the detached clipped importance weight times each token's log-probability, averaged over the
    mini-batch's tokens."""

    surrogate = staticmethod(cispo_surrogate)


def active_sequences(mask_BL: torch.Tensor) -> torch.Tensor:
    """Bool per row: the completion has at least one token that carries loss."""
    return mask_BL.any(dim=1)


def policy_metrics(
    out: ModelOutputs, batch: RLBatch, terms: SurrogateTerms, kl_BL: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    """Detached per-micro-batch SUMS (maxima for `ClippedPolicyLoss.max_reduced_metrics`) over response
    tokens."""
    mask = batch.response_mask_BL
    logprobs = out.target_logprobs_BL.detach().float()
    gap_BL = torch.where(mask, (logprobs - batch.generator_logprobs_BL.float()).abs(), 0.0)
    metrics = {
        "tokens": mask.sum().to(torch.float32),
        "sequences": active_sequences(mask).sum().to(torch.float32),
        "policy_loss_sum": terms.loss_BL.detach().sum(),
        "clip_low_count": terms.clipped_low_BL.sum().to(torch.float32),
        "clip_high_count": terms.clipped_high_BL.sum().to(torch.float32),
        "ratio_sum": torch.where(mask, terms.ratio_BL, 0.0).sum(),
        "ratio_max": torch.where(mask, terms.ratio_BL, 0.0).max(),
        "logprob_gap_sum": gap_BL.sum(),
        "logprob_gap_max": gap_BL.max(),
    }
    if out.entropy_BL is not None:
        metrics["entropy_sum"] = torch.where(mask, out.entropy_BL.detach().float(), 0.0).sum()
    if kl_BL is not None:
        metrics["kl_sum"] = kl_BL.detach().sum()
    return metrics


def summarize_policy_metrics(sums: dict[str, float]) -> dict[str, float]:
    """Logged per-token means and fractions from metrics reduced over micro-batches and ranks."""
    tokens = max(float(sums["tokens"]), 1.0)
    summary = {
        "policy/loss": float(sums["policy_loss_sum"]) / tokens,
        "policy/clip_low_frac": float(sums["clip_low_count"]) / tokens,
        "policy/clip_high_frac": float(sums["clip_high_count"]) / tokens,
        "policy/ratio_mean": float(sums["ratio_sum"]) / tokens,
        "policy/ratio_max": float(sums["ratio_max"]),
        "policy/logprob_gap_mean": float(sums["logprob_gap_sum"]) / tokens,
        "policy/logprob_gap_max": float(sums["logprob_gap_max"]),
        "policy/tokens": float(sums["tokens"]),
        "policy/sequences": float(sums["sequences"]),
    }
    if "entropy_sum" in sums:
        summary["policy/entropy"] = float(sums["entropy_sum"]) / tokens
    if "kl_sum" in sums:
        summary["policy/kl"] = float(sums["kl_sum"]) / tokens
    return summary


# Each loss type's class; its constructor takes (clip, max_log_ratio, kl=..., correction=...), plus the
# horizon for the fixed-horizon aggregation (`build_policy_loss`).
LOSS_CLASSES: dict[str, type[ClippedPolicyLoss]] = {
    "clipped_token_mean": TokenMeanLoss,
    "clipped_seq_mean": SequenceMeanLoss,
    "clipped_fixed_horizon": FixedHorizonLoss,
    "gspo": GSPOLoss,
    "cispo": CISPOLoss,
}
LOSS_TYPES = tuple(LOSS_CLASSES)


def build_policy_loss(
    cfg: LossConfig, max_new_tokens: int, correction: CorrectionConfig | None = None
) -> ClippedPolicyLoss:
    """The loss named by `cfg.type` with the mismatch correction `correction` (None = none);
    `max_new_tokens` is the fixed horizon when `cfg.horizon` is None."""
    if cfg.type not in LOSS_CLASSES:
        raise ValueError(f"grpo.loss.type={cfg.type!r}: unknown; choose one of {list(LOSS_TYPES)}")
    clip = ClipRange(*cfg.clip_range())
    kl = None
    if cfg.kl_coef > 0:
        kl = KLPenalty(coef=cfg.kl_coef, estimator=cfg.kl_estimator, max_log_ratio=cfg.max_log_ratio)
    parts = {"kl": kl, "correction": build_correction(correction) if correction is not None else None}
    cls = LOSS_CLASSES[cfg.type]
    if issubclass(cls, FixedHorizonLoss):
        return cls(clip, cfg.max_log_ratio, cfg.horizon if cfg.horizon is not None else max_new_tokens, **parts)
    return cls(clip, cfg.max_log_ratio, **parts)
