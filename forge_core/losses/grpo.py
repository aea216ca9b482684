"""GRPO-family policy losses: a per-token clipped surrogate against the generator's logprobs, an optional KL
penalty to a frozen reference policy, and three ways to average tokens (one small class each).

The ratio is `exp(logp_trainer - logp_generator)` with the generator's logprobs *stored in the batch*, never
`logp - logp.detach()` (that ratio is always 1, so clipping never acts after the first optimizer step).

Normalisation. Every loss divides a *sum* over this micro-batch by `global_normalizer`, the sum of
`loss.normalizer(mb)` over every micro-batch of the mini-batch on every data-parallel rank
(`TitanTrainer.global_normalizer`). Summing the micro-batch gradients over micro-batches and ranks then gives
exactly the gradient of the mini-batch loss, however the mini-batch was split (forge_core.trainers.rl_batch).

Usage (the trainer runs the forward, the normalizer, backward and the metric reduction):

    loss_fn = build_policy_loss(cfg.grpo.loss, cfg.rollout.sampling.max_new_tokens)
    metrics = trainer.train_step(micro_batches, loss_fn)     # RLBatch micro-batches of one mini-batch
    # metrics: loss, policy/loss, policy/clip_low_frac, policy/clip_high_frac, policy/ratio_mean,
    #          policy/ratio_max, policy/entropy, policy/kl (KL on), policy/logprob_gap_mean, ..._max
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from forge_core.config.schema import LossConfig
from forge_core.losses.base import Loss, LossOutput, ModelOutputs

if TYPE_CHECKING:
    # Type-only: the trainer package imports the losses, so a runtime import here would be circular.
    from forge_core.trainers.rl_batch import RLBatch


@dataclass(frozen=True)
class ClipRange:
    """The ratio is clipped to [1 - low, 1 + high]; high > low is DAPO's clip-higher."""

    low: float
    high: float


@dataclass(frozen=True)
class SurrogateTerms:
    loss_BL: torch.Tensor  # -min(ratio * A, clip(ratio) * A); 0 outside the response mask
    ratio_BL: torch.Tensor  # detached
    clipped_low_BL: torch.Tensor  # bool: the lower clip bound is active (ratio < 1 - low, A < 0)
    clipped_high_BL: torch.Tensor  # bool: the upper clip bound is active (ratio > 1 + high, A > 0)


def clipped_surrogate(
    logprobs_BL: torch.Tensor,
    generator_logprobs_BL: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_BL: torch.Tensor,
    clip: ClipRange,
    max_log_ratio: float,
) -> SurrogateTerms:
    """PPO's per-token clipped surrogate with separate low/high clip, as a loss to minimise.

    Where a clip bound is active the token's gradient is zero. Masked positions get loss 0 and ratio 1, and
    whatever the generator logprobs hold there (padding, NaN) cannot leak into the gradient.
    """
    logprobs = logprobs_BL.float()
    generator = torch.where(mask_BL, generator_logprobs_BL.float(), logprobs.detach())
    log_ratio = (logprobs - generator).clamp(-max_log_ratio, max_log_ratio)
    ratio = torch.exp(log_ratio)
    adv = advantages_B.float()[:, None]
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - clip.low, 1.0 + clip.high) * adv
    loss = torch.where(mask_BL, -torch.minimum(unclipped, clipped), 0.0)
    ratio_d = ratio.detach()
    return SurrogateTerms(
        loss_BL=loss,
        ratio_BL=ratio_d,
        clipped_low_BL=mask_BL & (adv < 0) & (ratio_d < 1.0 - clip.low),
        clipped_high_BL=mask_BL & (adv > 0) & (ratio_d > 1.0 + clip.high),
    )


def k1_estimate(log_ratio_BL: torch.Tensor) -> torch.Tensor:
    """k1 from log_ratio = logp - ref_logp: the log ratio itself (unbiased for KL(pi || ref) under samples
    of pi, but can be negative)."""
    return log_ratio_BL


def k3_estimate(log_ratio_BL: torch.Tensor) -> torch.Tensor:
    """k3 from log_ratio = logp - ref_logp: exp(ref - logp) - (ref - logp) - 1 (unbiased and never negative;
    GRPO's choice)."""
    return torch.exp(-log_ratio_BL) + log_ratio_BL - 1.0


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "k1": k1_estimate,
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
        """The unweighted KL estimate per token, 0 outside the response mask."""
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
    """Shared body of the three GRPO losses: per-token surrogate (+ KL), metrics, and the division by the
    global normalizer. Subclasses only say how per-token losses are summed and what one micro-batch adds to
    the denominator."""

    # Entropy is only logged (it is computed without grad), but the metrics require it.
    needs_entropy = True
    max_reduced_metrics = frozenset({"ratio_max", "logprob_gap_max"})

    def __init__(self, clip: ClipRange, max_log_ratio: float, kl: KLPenalty | None = None) -> None:
        self.clip = clip
        self.max_log_ratio = max_log_ratio
        self.kl = kl

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
        terms = clipped_surrogate(
            out.target_logprobs_BL,
            batch.generator_logprobs_BL,
            batch.advantages_B,
            mask,
            self.clip,
            self.max_log_ratio,
        )
        per_token_BL = terms.loss_BL
        kl_BL = None
        if self.kl is not None:
            kl_BL = self.kl.per_token(out.target_logprobs_BL, batch)
            per_token_BL = per_token_BL + self.kl.coef * kl_BL
        loss = self.aggregate(per_token_BL, mask) / global_normalizer
        metrics = policy_metrics(out, batch, terms, kl_BL)
        return LossOutput(loss=loss, metrics=metrics)

    def summarize(self, reduced: dict[str, float]) -> dict[str, float]:
        return summarize_policy_metrics(reduced)


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

    def __init__(self, clip: ClipRange, max_log_ratio: float, horizon: int, kl: KLPenalty | None = None):
        super().__init__(clip, max_log_ratio, kl)
        if horizon < 1:
            raise ValueError(f"grpo.loss.horizon={horizon}: must be >= 1")
        self.horizon = horizon

    def normalizer(self, batch: RLBatch) -> float:
        return float(active_sequences(batch.response_mask_BL).sum()) * self.horizon

    def aggregate(self, loss_BL: torch.Tensor, mask_BL: torch.Tensor) -> torch.Tensor:
        return loss_BL.sum()


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
    """Turn metrics reduced over micro-batches and ranks into the logged per-token means and fractions."""
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


LOSS_TYPES = ("clipped_token_mean", "clipped_seq_mean", "clipped_fixed_horizon")


def build_policy_loss(cfg: LossConfig, max_new_tokens: int) -> ClippedPolicyLoss:
    """The loss named by `cfg.type`; `max_new_tokens` is the fixed horizon when `cfg.horizon` is None."""
    clip = ClipRange(low=cfg.clip_low, high=cfg.clip_high)
    kl = None
    if cfg.kl_coef > 0:
        kl = KLPenalty(coef=cfg.kl_coef, estimator=cfg.kl_estimator, max_log_ratio=cfg.max_log_ratio)
    if cfg.type == "clipped_token_mean":
        return TokenMeanLoss(clip, cfg.max_log_ratio, kl)
    if cfg.type == "clipped_seq_mean":
        return SequenceMeanLoss(clip, cfg.max_log_ratio, kl)
    if cfg.type == "clipped_fixed_horizon":
        horizon = cfg.horizon if cfg.horizon is not None else max_new_tokens
        return FixedHorizonLoss(clip, cfg.max_log_ratio, horizon, kl)
    raise ValueError(f"grpo.loss.type={cfg.type!r}: unknown; choose one of {list(LOSS_TYPES)}")
