"""Token-level cross-entropy for SFT: learn the completion tokens only, averaged over the global batch.

    loss_fn = TokenCrossEntropy()
    loss = loss_fn(ModelOutputs(target_logprobs_BL), batch, global_normalizer)   # sum(-logp * mask) / N
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from forge_core.losses.base import Loss, LossOutput, ModelOutputs

if TYPE_CHECKING:  # the trainers import the losses, not the other way round
    from forge_core.batch import TokenBatch


class TokenCrossEntropy(Loss):
    """-log p(target) summed over masked (completion) tokens, divided by the global token count. Raises
    ValueError when the step has no loss tokens."""

    def normalizer(self, batch: TokenBatch) -> float:
        return float(batch.loss_mask_BL.sum())

    def __call__(self, out: ModelOutputs, batch: TokenBatch, global_normalizer: float) -> LossOutput:
        if not global_normalizer > 0:
            raise ValueError(
                f"global_normalizer={global_normalizer}: the step has no completion tokens to learn; check "
                "that the SFT rows carry a non-empty loss_mask"
            )
        mask = batch.loss_mask_BL
        nll_sum = -torch.where(mask, out.target_logprobs_BL, 0.0).sum()
        return LossOutput(
            loss=nll_sum / global_normalizer,
            metrics={"nll_sum": nll_sum.detach(), "loss_tokens": mask.sum().to(torch.float32)},
        )

    def summarize(self, reduced: dict[str, float]) -> dict[str, float]:
        tokens = reduced.get("loss_tokens", 0.0)
        return {"nll": reduced["nll_sum"] / tokens if tokens else float("nan"), "loss_tokens": tokens}
