"""The GRPO batch container and the split of one rollout batch into optimizer steps.

Every `*_BL` tensor is aligned with the trainer's targets: position l holds the value for target token l (the
token predicted from the inputs up to l).

One rollout batch feeds `grpo.epochs` passes, each cut into mini-batches of `grpo.mini_batch_size` sequences
over all data-parallel ranks; each rank takes a contiguous shard of every mini-batch, cut into micro-batches:

    batch = RLBatch.from_token_batch(pad_token_rows(rows), advantages_B, generator_logprobs_BL)
    batch = batch.keep_rows(keep_B)                     # from compute_advantages
    plan = plan_minibatches(batch.batch_size, cfg.grpo.mini_batch_size, cfg.grpo.micro_batch_size,
                            cfg.grpo.epochs, seed=<per rollout batch>, dp_rank=r, dp_size=n)
    for step in plan:                                   # one optimizer step each
        metrics = trainer.train_step([batch.select(rows) for rows in step.micro_rows], loss_fn)

Losses divide by the mini-batch's global normalizer (forge_core.losses.base). A mini-batch whose normalizer
is 0 (every completion dropped) must be skipped, not stepped: the loss refuses it, and a step on zero
gradients would still move the weights through Adam's momentum.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from forge_core.batch.tokens import TokenBatch


@dataclass(kw_only=True)
class RLBatch(TokenBatch):
    """A batch of completions for the GRPO loss (B completions, L target positions).

    The inherited `loss_mask_BL` is the response mask (also readable as `response_mask_BL`): True on
    completion tokens that carry loss, False on prompt, padding and dropped completions.
    """

    advantages_B: torch.Tensor  # float32, one advantage per completion
    generator_logprobs_BL: torch.Tensor  # float32, logp of each target under the policy that sampled it
    # float32, the trainer's own logp of each target under the sampling policy's weights (see
    # forge_core.losses.correction); None until it is computed
    old_logprobs_BL: torch.Tensor | None = None
    ref_logprobs_BL: torch.Tensor | None = None  # float32, the frozen reference policy (only when KL is on)

    def __post_init__(self) -> None:
        super().__post_init__()
        shape = tuple(self.loss_mask_BL.shape)
        assert self.loss_mask_BL.dtype == torch.bool, f"loss_mask_BL is {self.loss_mask_BL.dtype}"
        assert tuple(self.advantages_B.shape) == shape[:1], f"advantages_B {tuple(self.advantages_B.shape)}"
        assert tuple(self.generator_logprobs_BL.shape) == shape, "generator_logprobs_BL must match [B, L]"
        assert self.ref_logprobs_BL is None or tuple(self.ref_logprobs_BL.shape) == shape
        assert self.old_logprobs_BL is None or tuple(self.old_logprobs_BL.shape) == shape

    @property
    def response_mask_BL(self) -> torch.Tensor:
        return self.loss_mask_BL

    @classmethod
    def from_token_batch(
        cls,
        tokens: TokenBatch,
        advantages_B: torch.Tensor,
        generator_logprobs_BL: torch.Tensor,
        ref_logprobs_BL: torch.Tensor | None = None,
    ) -> RLBatch:
        """Completions padded by `pad_token_rows` (loss mask = completion tokens) plus rollout values."""
        return cls(
            input_ids_BL=tokens.input_ids_BL,
            target_ids_BL=tokens.target_ids_BL,
            loss_mask_BL=tokens.loss_mask_BL,
            positions_BL=tokens.positions_BL,
            lengths_B=tokens.lengths_B,
            advantages_B=advantages_B,
            generator_logprobs_BL=generator_logprobs_BL,
            ref_logprobs_BL=ref_logprobs_BL,
        )

    def keep_rows(self, keep_B: torch.Tensor) -> RLBatch:
        """Completions outside `keep_B` stay in the batch (so every rank runs the same micro-batches) but
        carry no loss: their response mask and advantage become zero."""
        keep = keep_B.to(device=self.loss_mask_BL.device, dtype=torch.bool)
        return dataclasses.replace(
            self,
            loss_mask_BL=self.loss_mask_BL & keep[:, None],
            advantages_B=torch.where(keep, self.advantages_B, 0.0),
        )


@dataclass(frozen=True)
class MiniBatchStep:
    """One optimizer step: this rank's micro-batches, as row indices into the rollout batch."""

    epoch: int
    index: int  # mini-batch index within the epoch
    micro_rows: tuple[torch.Tensor, ...]


def plan_minibatches(
    num_samples: int,
    mini_batch_size: int,
    micro_batch_size: int,
    epochs: int,
    seed: int,
    dp_rank: int = 0,
    dp_size: int = 1,
) -> list[MiniBatchStep]:
    """Every optimizer step of one rollout batch, in order, for rank `dp_rank` of `dp_size`.

    Each epoch draws a fresh permutation from a generator seeded once with `seed` (pass a different seed per
    rollout batch). All ranks compute the same permutations without communicating, and together they cover
    every sample exactly once per epoch.

    Raises:
        ValueError: if `epochs` < 1 or the batch sizes do not split `num_samples` evenly over the ranks.
    """
    _check_split(num_samples, mini_batch_size, micro_batch_size, epochs, dp_rank, dp_size)
    per_rank = mini_batch_size // dp_size
    generator = torch.Generator().manual_seed(seed)
    steps = []
    for epoch in range(epochs):
        order = torch.randperm(num_samples, generator=generator)
        for index, start in enumerate(range(0, num_samples, mini_batch_size)):
            shard = order[start + dp_rank * per_rank : start + (dp_rank + 1) * per_rank]
            steps.append(MiniBatchStep(epoch, index, tuple(shard.split(micro_batch_size))))
    return steps


def _check_split(
    num_samples: int, mini_batch_size: int, micro_batch_size: int, epochs: int, dp_rank: int, dp_size: int
) -> None:
    if epochs < 1:
        raise ValueError(f"grpo.epochs={epochs}: must be >= 1")
    if mini_batch_size < 1 or num_samples % mini_batch_size:
        raise ValueError(
            f"grpo.mini_batch_size={mini_batch_size}: must divide the {num_samples} samples of the rollout "
            "batch (rollout.prompts_per_iteration * rollout.sampling.group_size)"
        )
    if micro_batch_size < 1 or mini_batch_size % (micro_batch_size * dp_size):
        raise ValueError(
            f"grpo.mini_batch_size={mini_batch_size}: must be a multiple of grpo.micro_batch_size="
            f"{micro_batch_size} * {dp_size} data-parallel ranks; lower grpo.micro_batch_size or raise "
            "grpo.mini_batch_size"
        )
    assert 0 <= dp_rank < dp_size, f"dp_rank={dp_rank} outside [0, {dp_size})"
