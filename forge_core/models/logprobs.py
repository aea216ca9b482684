"""Per-token log-probabilities from a torchtitan decoder, shared by the trainers and the rollout parity checks.

logp_BL = model_logprobs(model, input_ids_BL, target_ids_BL)      # fp32, grad flows when enabled
logits_BLV = forward_logits(model, input_ids_BL, positions_BL)   # pad_to=length_bucket(L, max) when compiled
logp_BL, entropy_BL = token_logprobs(logits_BLV, target_ids_BL), token_entropy(logits_BLV)
logits_NV = forward_logits(model, input_ids_BL, at_BL=loss_mask_BL)   # the output layer at N positions only
logp_BL = on_positions(token_logprobs(logits_NV, target_ids_BL[loss_mask_BL]), loss_mask_BL)   # 0 elsewhere
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from forge_core.models.flavors import attention_backend_of


def _decoder_config(model: nn.Module):
    # torch.compile wraps the module; fully_shard keeps the original object.
    inner = getattr(model, "_orig_mod", model)
    return inner.config, inner


# Shortest bucket of `length_bucket`: shorter batches are all padded to it (a few wasted positions at most).
MIN_BUCKET = 64


def length_bucket(length: int, max_len: int) -> int:
    """The padded length of `length` positions for a compiled model, so it meets few shapes: the next power of
    two (at least MIN_BUCKET), capped at `max_len`; `length` itself when >= `max_len`."""
    if length < 1:
        raise ValueError(f"length={length}: must be >= 1")
    if length >= max_len:
        return length
    return min(max(MIN_BUCKET, 1 << (length - 1).bit_length()), max_len)


def forward_logits(
    model: nn.Module,
    input_ids_BL: torch.Tensor,
    positions_BL: torch.Tensor | None = None,
    *,
    pad_to: int | None = None,
    at_BL: torch.Tensor | None = None,
) -> torch.Tensor:
    """Logits [B, L, V] of a torchtitan decoder, in the model's compute dtype; given the bool mask `at_BL`, the
    logits [N, V] of its N True positions (row-major) alone, for which alone the output layer runs: the
    vocabulary projection of positions no loss reads is skipped (a model whose output layer is tensor-parallel
    takes no `at_BL`: its input is sharded over the sequence).

    With SDPA `positions_BL` only moves RoPE; with flex/varlen the masks come from it (0 starts a document).
    `pad_to` > L runs on right-padded rows and returns the first L positions, unaffected by the padding.
    """
    length = input_ids_BL.shape[1]
    if pad_to is not None and pad_to > length:
        extra = pad_to - length
        input_ids_BL = torch.nn.functional.pad(input_ids_BL, (0, extra))
        if positions_BL is not None:
            tail = torch.arange(1, extra + 1, device=positions_BL.device, dtype=positions_BL.dtype)
            positions_BL = torch.cat([positions_BL, positions_BL[:, -1:] + tail], dim=1)
        if at_BL is not None:
            at_BL = torch.nn.functional.pad(at_BL, (0, extra), value=False)
    if at_BL is None:
        return _forward(model, input_ids_BL, positions_BL)[:, :length]
    with _output_layer_at(model, at_BL.to(input_ids_BL.device)):
        return _forward(model, input_ids_BL, positions_BL)


@contextlib.contextmanager
def _output_layer_at(model: nn.Module, at_BL: torch.Tensor) -> Iterator[None]:
    """While open, the decoder's output layer takes only the hidden states of `at_BL`'s True positions, [N, D]
    (selected inside the model's forward, so FSDP gathers and reduces the layer as it always does)."""
    _, inner = _decoder_config(model)

    def select(_module: nn.Module, args: tuple) -> tuple:
        hidden_BLD, *rest = args
        return (hidden_BLD[at_BL], *rest)

    handle = inner.lm_head.register_forward_pre_hook(select)
    try:
        yield
    finally:
        handle.remove()


def on_positions(values_N: torch.Tensor, at_BL: torch.Tensor) -> torch.Tensor:
    """[B, L]: `values_N` at the N True positions of `at_BL` (row-major), 0 elsewhere; differentiable."""
    return values_N.new_zeros(at_BL.shape).masked_scatter(at_BL.to(values_N.device), values_N)


def _forward(model: nn.Module, input_ids_BL: torch.Tensor, positions_BL: torch.Tensor | None) -> torch.Tensor:
    config, inner = _decoder_config(model)
    if attention_backend_of(config) == "sdpa":
        return model(input_ids_BL, positions=positions_BL)
    if positions_BL is None:
        length = input_ids_BL.shape[1]
        positions_BL = torch.arange(length, device=input_ids_BL.device).expand_as(input_ids_BL)
    masks = inner.get_attention_masks(positions_BL)
    return model(input_ids_BL, positions=positions_BL, attention_masks=masks)


def token_logprobs(logits_BLV: torch.Tensor, target_ids_BL: torch.Tensor) -> torch.Tensor:
    """log p(target) per position: fp32 log_softmax over the vocab, then gather. Shape [B, L] (or [N] from
    logits [N, V] and targets [N])."""
    logprobs_BLV = torch.log_softmax(logits_BLV.float(), dim=-1)
    return logprobs_BLV.gather(-1, target_ids_BL.long().unsqueeze(-1)).squeeze(-1)


def token_entropy(logits_BLV: torch.Tensor) -> torch.Tensor:
    """Entropy of the next-token distribution per position, in nats, computed in fp32. Shape [B, L] (or [N])."""
    logprobs_BLV = torch.log_softmax(logits_BLV.float(), dim=-1)
    return -(logprobs_BLV.exp() * logprobs_BLV).sum(dim=-1)


def model_logprobs(
    model: nn.Module,
    input_ids_BL: torch.Tensor,
    target_ids_BL: torch.Tensor,
    positions_BL: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 log-probabilities [B, L] of `target_ids_BL` given `input_ids_BL`; padding targets get values too."""


    if input_ids_BL.shape != target_ids_BL.shape:
        raise ValueError(
            f"input_ids_BL {tuple(input_ids_BL.shape)} and target_ids_BL {tuple(target_ids_BL.shape)} "
            "must have the same shape"
        )
    return token_logprobs(forward_logits(model, input_ids_BL, positions_BL), target_ids_BL)
