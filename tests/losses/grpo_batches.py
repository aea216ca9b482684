"""Builders of small RLBatch objects for the loss tests, a tiny policy with a rollout batch, and the worker of
the real two-rank (gloo) split-invariance test. Plain module-level functions, so spawned ranks can use them."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from forge_core.batch import RLBatch, plan_minibatches
from forge_core.config.schema import AdvantageConfig, CorrectionConfig, LossConfig
from forge_core.losses.base import ModelOutputs
from forge_core.losses.grpo import build_policy_loss
from forge_core.models.logprobs import token_entropy, token_logprobs
from forge_core.trainers.advantages import compute_advantages

VOCAB, LENGTH, BATCH, GROUP = 11, 6, 8, 4
HORIZON = 5


def make_rl_batch(
    advantages: torch.Tensor,
    generator_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    ref_logprobs: torch.Tensor | None = None,
    input_ids: torch.Tensor | None = None,
    target_ids: torch.Tensor | None = None,
    old_logprobs: torch.Tensor | None = None,
) -> RLBatch:
    """An RLBatch whose token ids default to zeros (tests that feed log-probabilities ignore them)."""
    shape = response_mask.shape
    return RLBatch(
        input_ids_BL=torch.zeros(shape, dtype=torch.long) if input_ids is None else input_ids,
        target_ids_BL=torch.zeros(shape, dtype=torch.long) if target_ids is None else target_ids,
        loss_mask_BL=response_mask.bool(),
        advantages_B=advantages.float(),
        generator_logprobs_BL=generator_logprobs.float(),
        old_logprobs_BL=old_logprobs,
        ref_logprobs_BL=ref_logprobs,
    )


class TinyPolicy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, input_ids_BL: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(input_ids_BL)))


def tiny_rollout(seed: int = 0, off_policy_noise: float = 0.0, with_ref: bool = False, mismatch: float = 0.0):
    """A policy and a rollout batch of 2 groups x 4 completions with ragged response masks. `off_policy_noise`
    moves the sampler's logprobs away from the policy's; `mismatch` > 0 adds `old_logprobs_BL` (the trainer's
    logprobs of the sampler) that far from the sampler's."""
    torch.manual_seed(seed)
    policy = TinyPolicy()
    input_ids = torch.randint(0, VOCAB, (BATCH, LENGTH))
    targets = torch.randint(0, VOCAB, (BATCH, LENGTH))
    # Prompt covers the first 2 targets; completions have 1..4 response tokens (then padding).
    lengths = torch.tensor([4, 1, 3, 2, 4, 4, 2, 3])
    positions = torch.arange(LENGTH)
    mask = (positions >= 2) & (positions < 2 + lengths[:, None])
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.0, 1.0, 1.0, 0.25])
    groups = torch.arange(BATCH) // GROUP
    advantages, _, _ = compute_advantages(rewards, groups, AdvantageConfig())
    with torch.no_grad():
        generator = token_logprobs(policy(input_ids), targets)
        generator = generator + off_policy_noise * torch.randn(BATCH, LENGTH)
        ref = generator + 0.3 * torch.randn(BATCH, LENGTH) if with_ref else None
        old = generator + mismatch * torch.randn(BATCH, LENGTH) if mismatch > 0 else None
    batch = make_rl_batch(
        advantages=advantages,
        generator_logprobs=generator,
        response_mask=mask,
        ref_logprobs=ref,
        input_ids=input_ids,
        target_ids=targets,
        old_logprobs=old,
    )
    return policy, batch


def policy_outputs(policy: TinyPolicy, batch: RLBatch) -> ModelOutputs:
    logits = policy(batch.input_ids_BL)
    with torch.no_grad():
        entropy = token_entropy(logits)
    return ModelOutputs(token_logprobs(logits, batch.target_ids_BL), entropy)


# ---- the loss family, every (loss, correction) pair ----------------------------------------------------------

LOSS_TYPES = ["clipped_token_mean", "clipped_seq_mean", "clipped_fixed_horizon", "gspo", "cispo"]
CORRECTIONS = ["none", "tis", "mis", "geo_mask", "icepop"]
# Bounds that make every correction act on `tiny_rollout(mismatch=0.3)` (measured: each masks or truncates
# some but not all of its tokens), so split-invariance is checked where the correction changes the loss.
CORRECTION_BOUNDS = {"tis_cap": 1.2, "mis_threshold": 1.5, "geo_low": 0.9, "geo_high": 1.1,
                     "icepop_low": 0.8, "icepop_high": 1.25}


def family_loss(loss_type: str, correction: str):
    """The loss `loss_type` with KL (k2) on and the correction `correction` with test bounds."""
    cfg = LossConfig(type=loss_type, horizon=HORIZON if loss_type == "clipped_fixed_horizon" else None,
                     kl_coef=0.1, kl_estimator="k2")
    return build_policy_loss(cfg, max_new_tokens=4, correction=CorrectionConfig(type=correction, **CORRECTION_BOUNDS))


def family_cases() -> list[tuple[str, str]]:
    return [(loss_type, correction) for loss_type in LOSS_TYPES for correction in CORRECTIONS]


def rank_gradients(loss_fn, policy: TinyPolicy, batch: RLBatch, micro_rows, normalizer: float) -> list[torch.Tensor]:
    """This rank's summed gradients over its micro-batches, each loss divided by the global normalizer."""
    policy.zero_grad()
    for rows in micro_rows:
        micro = batch.select(rows)
        loss_fn(policy_outputs(policy, micro), micro, normalizer).loss.backward()
    return [p.grad.clone() for p in policy.parameters()]


def two_rank_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """One gloo rank: for every (loss, correction) pair, its half of the mini-batch in micro-batches of 2, the
    normalizer and the gradients all-reduced by SUM (as TitanTrainer and FSDP do); rank 0 saves the results."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        results = {}
        for loss_type, correction in family_cases():
            loss_fn = family_loss(loss_type, correction)
            policy, batch = tiny_rollout(off_policy_noise=0.3, with_ref=True, mismatch=0.3)
            (step,) = plan_minibatches(BATCH, BATCH, 2, epochs=1, seed=5, dp_rank=rank, dp_size=world)
            local = torch.tensor(float(sum(loss_fn.normalizer(batch.select(rows)) for rows in step.micro_rows)))
            dist.all_reduce(local)
            grads = rank_gradients(loss_fn, policy, batch, step.micro_rows, float(local))
            for grad in grads:
                dist.all_reduce(grad)
            results[f"{loss_type}/{correction}"] = {"normalizer": float(local), "grads": grads}
        if rank == 0:
            torch.save(results, Path(out_dir) / "two_ranks.pt")
    finally:
        dist.destroy_process_group()
