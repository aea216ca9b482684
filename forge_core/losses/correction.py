"""Train-inference mismatch: the correction a GRPO-family loss applies, and the metrics that measure it.

The sampler (vLLM) and the trainer compute different probabilities for the same tokens, and in async mode the
sampler is also an older policy. Per response token t of sequence i:

    gen    the sampler's logprob of the sampled token (`RLBatch.generator_logprobs_BL`)
    old    the trainer's logprob of that token under the sampler's weights (`RLBatch.old_logprobs_BL`, see
           forge_core.run.grpo.attach_policy_logprobs)
    logp   the trainer's current logprob (with grad)
    w_t    exp(old - gen): the correction weight, trainer / sampler

`NoCorrection`: the PPO ratio is exp(logp - gen), no weight. Every other correction is decoupled: the PPO
ratio is exp(logp - old) and each token's policy loss (not the KL term) is multiplied by a detached weight:

    TokenTIS(cap)              min(w_t, cap)                                    (verl / SkyRL "TIS")
    SequenceMIS(threshold)     W_i = prod_t w_t, 0 where W_i > threshold         (TRL's sequence_mask)
    GeometricMeanMask(lo, hi)  1 if lo <= (prod_t w_t)^(1/|y_i|) <= hi else 0    (a sequence rejection mask)
    IcePop(lo, hi)             w_t if lo <= w_t <= hi else 0                     (IcePop, Ring-1T)

A masked token keeps its place in the normaliser (weight 0), so the normaliser does not depend on the
correction. Every correction depends on a row's own tokens only, so micro-batching cannot change it. When
`old == gen` each correction equals `none` exactly.

    correction = build_correction(cfg.grpo.correction)
    summary = mismatch_summary(batch, correction)   # once per rollout batch: means, quantiles, fractions
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from forge_core.config.schema import CorrectionConfig

if TYPE_CHECKING:  # the trainers import the losses, not the other way round
    from forge_core.batch import RLBatch

# Sequence log-ratios are clamped to this before exp() in the metrics, so a wild sequence reads as e^50
# rather than inf (which JSON manifests cannot hold).
_METRIC_MAX_LOG = 50.0
SEQ_RATIO_QUANTILES = (0.05, 0.5, 0.95)


@dataclass(frozen=True)
class CorrectionWeights:
    """What a correction does to one batch: the detached per-token weight (0 outside the response mask) and
    which tokens it masked (weight set to 0) or truncated (weight capped)."""

    weight_BL: torch.Tensor
    masked_BL: torch.Tensor
    truncated_BL: torch.Tensor


def missing_old_logprobs(what: str) -> ValueError:
    return ValueError(
        f"grpo.correction.type={what!r}: the batch has no old_logprobs_BL (the trainer's logprobs of the "
        "sampling policy); compute them for every rollout batch (forge_core.run.grpo.attach_policy_logprobs) "
        "or set grpo.correction.type=none"
    )


def log_weights(batch: RLBatch, what: str) -> torch.Tensor:
    """log w = old - gen per token, 0 outside the response mask. Raises ValueError naming the correction
    `what` when the batch has no old logprobs."""
    if batch.old_logprobs_BL is None:
        raise missing_old_logprobs(what)
    mask = batch.response_mask_BL
    return torch.where(mask, batch.old_logprobs_BL.float() - batch.generator_logprobs_BL.float(), 0.0)


def sequence_log_weights(log_w_BL: torch.Tensor) -> torch.Tensor:
    """log W_i = sum_t log w_t per sequence (the log of the sequence's trainer / sampler probability ratio)."""
    return log_w_BL.sum(dim=1)


def _no_change(mask_BL: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(mask_BL)


class Correction(ABC):
    """One train-inference mismatch correction (see the module docstring)."""

    name: ClassVar[str]
    # Whether the loss reads `old_logprobs_BL` (the trainer's logprobs under the sampling policy's weights).
    reads_old_logprobs: ClassVar[bool] = True

    def ratio_base(self, batch: RLBatch) -> torch.Tensor:
        """The logprobs the PPO ratio is taken against: the trainer's own logprobs of the sampling policy."""
        if batch.old_logprobs_BL is None:
            raise missing_old_logprobs(self.name)
        return batch.old_logprobs_BL

    def weights(self, batch: RLBatch) -> CorrectionWeights:
        """The detached per-token weights of `batch` (rows are independent of each other)."""
        mask = batch.response_mask_BL
        with torch.no_grad():
            weight_BL, masked_BL, truncated_BL = self.transform(log_weights(batch, self.name), mask)
        return CorrectionWeights(
            weight_BL=torch.where(mask, weight_BL, 0.0),
            masked_BL=masked_BL & mask,
            truncated_BL=truncated_BL & mask,
        )

    @abstractmethod
    def transform(
        self, log_w_BL: torch.Tensor, mask_BL: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(weight, masked, truncated) per token from log w (0 outside the mask)."""


@dataclass(frozen=True)
class NoCorrection(Correction):
    """The PPO ratio against the sampler's logprobs, weight 1 (equal to torchtitan's DAPOLoss)."""

    name: ClassVar[str] = "none"
    reads_old_logprobs: ClassVar[bool] = False

    def ratio_base(self, batch: RLBatch) -> torch.Tensor:
        return batch.generator_logprobs_BL

    def weights(self, batch: RLBatch) -> CorrectionWeights:
        # Needs no old logprobs: a loss without a correction runs on batches that have none.
        mask = batch.response_mask_BL
        return CorrectionWeights(mask.float(), _no_change(mask), _no_change(mask))

    def transform(self, log_w_BL, mask_BL):
        return torch.ones_like(log_w_BL), _no_change(mask_BL), _no_change(mask_BL)


@dataclass(frozen=True)
class TokenTIS(Correction):
    """Token-level truncated importance sampling: weight min(w_t, cap)."""

    cap: float
    name: ClassVar[str] = "tis"

    def transform(self, log_w_BL, mask_BL):
        w = torch.exp(log_w_BL)
        return w.clamp(max=self.cap), _no_change(mask_BL), w > self.cap


@dataclass(frozen=True)
class SequenceMIS(Correction):
    """Sequence-level masked importance sampling: weight W_i = prod_t w_t on every token of sequence i, and 0
    when W_i exceeds `threshold`."""

    threshold: float
    name: ClassVar[str] = "mis"

    def transform(self, log_w_BL, mask_BL):
        log_seq_B = sequence_log_weights(log_w_BL)
        masked_B = log_seq_B > math.log(self.threshold)
        weight_B = torch.where(masked_B, 0.0, torch.exp(log_seq_B))
        return weight_B[:, None].expand_as(log_w_BL), masked_B[:, None] & mask_BL, _no_change(mask_BL)


@dataclass(frozen=True)
class GeometricMeanMask(Correction):
    """A sequence is kept (weight 1) when the geometric mean of its token weights lies in [low, high], and
    masked (weight 0) otherwise; no reweighting."""

    low: float
    high: float
    name: ClassVar[str] = "geo_mask"

    def transform(self, log_w_BL, mask_BL):
        tokens_B = mask_BL.sum(dim=1).clamp(min=1)
        geo_B = torch.exp(sequence_log_weights(log_w_BL) / tokens_B)
        masked_B = (geo_B < self.low) | (geo_B > self.high)
        weight_BL = torch.where(masked_B[:, None], 0.0, torch.ones_like(log_w_BL))
        return weight_BL, masked_B[:, None] & mask_BL, _no_change(mask_BL)


@dataclass(frozen=True)
class IcePop(Correction):
    """Token-level: weight w_t inside [low, high], 0 outside (the token is masked)."""

    low: float
    high: float
    name: ClassVar[str] = "icepop"

    def transform(self, log_w_BL, mask_BL):
        w = torch.exp(log_w_BL)
        masked_BL = (w < self.low) | (w > self.high)
        return torch.where(masked_BL, 0.0, w), masked_BL, _no_change(mask_BL)


CORRECTIONS: dict[str, Callable[[CorrectionConfig], Correction]] = {
    "none": lambda cfg: NoCorrection(),
    "tis": lambda cfg: TokenTIS(cap=cfg.tis_cap),
    "mis": lambda cfg: SequenceMIS(threshold=cfg.mis_threshold),
    "geo_mask": lambda cfg: GeometricMeanMask(low=cfg.geo_low, high=cfg.geo_high),
    "icepop": lambda cfg: IcePop(low=cfg.icepop_low, high=cfg.icepop_high),
}


def build_correction(cfg: CorrectionConfig) -> Correction:
    """The correction named by `cfg.type` with its bounds."""
    if cfg.type not in CORRECTIONS:
        raise ValueError(f"grpo.correction.type={cfg.type!r}: unknown; choose one of {sorted(CORRECTIONS)}")
    return CORRECTIONS[cfg.type](cfg)


# ---- mismatch metrics -------------------------------------------------------------------------------------


def k3_sampler_trainer(log_w_BL: torch.Tensor) -> torch.Tensor:
    """k3 estimate of KL(sampler || trainer) per token from samples of the sampler: w - 1 - log w (>= 0)."""
    return torch.exp(log_w_BL) - 1.0 - log_w_BL


def mismatch_sums(batch: RLBatch, weights: CorrectionWeights) -> dict[str, torch.Tensor]:
    """Per-micro-batch SUMS (maxima for the `*_max` keys) of the sampler-vs-trainer mismatch and of what the
    correction did (its `weights`); {} when the batch has no old logprobs. See `summarize_mismatch`."""
    if batch.old_logprobs_BL is None:
        return {}
    mask = batch.response_mask_BL
    with torch.no_grad():
        log_w = log_weights(batch, "none")
        active_B = mask.any(dim=1)
        log_seq_B = sequence_log_weights(log_w).clamp(max=_METRIC_MAX_LOG)
    return {
        "mismatch_abs_sum": log_w.abs().sum(),
        "mismatch_abs_max": log_w.abs().max() if log_w.numel() else log_w.new_zeros(()),
        "mismatch_k3_sum": torch.where(mask, k3_sampler_trainer(log_w), 0.0).sum(),
        "mismatch_seq_ratio_max": (
            torch.where(active_B, torch.exp(log_seq_B), 0.0).max() if active_B.numel() else log_w.new_zeros(())
        ),
        "corrected_masked_tokens": weights.masked_BL.sum().float(),
        "corrected_truncated_tokens": weights.truncated_BL.sum().float(),
        "corrected_masked_seqs": weights.masked_BL.any(dim=1).sum().float(),
        "corrected_truncated_seqs": weights.truncated_BL.any(dim=1).sum().float(),
    }


MISMATCH_MAX_KEYS = frozenset({"mismatch_abs_max", "mismatch_seq_ratio_max"})


def summarize_mismatch(sums: dict[str, float], tokens: float, sequences: float) -> dict[str, float]:
    """Logged values from reduced `mismatch_sums` over `tokens` response tokens of `sequences` sequences."""
    if "mismatch_abs_sum" not in sums:
        return {}
    tokens, sequences = max(tokens, 1.0), max(sequences, 1.0)
    return {
        "mismatch/logprob_diff_mean": float(sums["mismatch_abs_sum"]) / tokens,
        "mismatch/logprob_diff_max": float(sums["mismatch_abs_max"]),
        "mismatch/kl_k3": float(sums["mismatch_k3_sum"]) / tokens,
        "mismatch/seq_ratio_max": float(sums["mismatch_seq_ratio_max"]),
        "correction/masked_token_frac": float(sums["corrected_masked_tokens"]) / tokens,
        "correction/truncated_token_frac": float(sums["corrected_truncated_tokens"]) / tokens,
        "correction/masked_seq_frac": float(sums["corrected_masked_seqs"]) / sequences,
        "correction/truncated_seq_frac": float(sums["corrected_truncated_seqs"]) / sequences,
    }


def mismatch_summary(batch: RLBatch, correction: Correction) -> dict[str, float]:
    """The mismatch metrics of a whole rollout batch (rows that carry loss), plus quantiles of the sequence
    ratio W_i = prod_t w_t. Raises ValueError when the batch has no old logprobs."""
    if batch.old_logprobs_BL is None:
        raise missing_old_logprobs(correction.name)
    mask = batch.response_mask_BL
    active_B = mask.any(dim=1)
    sums = {k: float(v) for k, v in mismatch_sums(batch, correction.weights(batch)).items()}
    summary = summarize_mismatch(sums, float(mask.sum()), float(active_B.sum()))
    log_seq_B = sequence_log_weights(log_weights(batch, correction.name))[active_B].double()
    if log_seq_B.numel():
        ratios = torch.exp(log_seq_B.clamp(-_METRIC_MAX_LOG, _METRIC_MAX_LOG))
        summary["mismatch/seq_ratio_min"] = float(ratios.min())
        for q in SEQ_RATIO_QUANTILES:
            summary[f"mismatch/seq_ratio_p{round(100 * q):02d}"] = float(torch.quantile(ratios, q))
    return summary
