"""Builders of small RLBatch objects for the loss tests (plain functions, so spawned ranks can use them)."""

from __future__ import annotations

import torch

from forge_core.trainers.rl_batch import RLBatch


def make_rl_batch(
    advantages: torch.Tensor,
    generator_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    ref_logprobs: torch.Tensor | None = None,
    input_ids: torch.Tensor | None = None,
    target_ids: torch.Tensor | None = None,
) -> RLBatch:
    """An RLBatch whose token ids default to zeros (tests that feed log-probabilities ignore them)."""
    shape = response_mask.shape
    return RLBatch(
        input_ids_BL=torch.zeros(shape, dtype=torch.long) if input_ids is None else input_ids,
        target_ids_BL=torch.zeros(shape, dtype=torch.long) if target_ids is None else target_ids,
        loss_mask_BL=response_mask.bool(),
        advantages_B=advantages.float(),
        generator_logprobs_BL=generator_logprobs.float(),
        ref_logprobs_BL=ref_logprobs,
    )
