"""Build torchtitan models from a forgeflow `ModelConfig`, initialise them, count parameters and FLOPs.

model = build_model(cfg.model, vocab_size, device="meta", attention="sdpa")
# (parallelize / fully_shard here when distributed)
init_weights(model, seed=cfg.seed, device="cpu")
"""

from __future__ import annotations

import torch
from torch import nn
from torchtitan.models.common import Decoder

from forge_core.config.schema import ModelConfig
from forge_core.models.architecture import Architecture
from forge_core.models.flavors import AttentionBackend, build_model_config


def build_model(
    cfg: ModelConfig,
    vocab_size: int,
    device: str | torch.device = "meta",
    *,
    attention: AttentionBackend,
    architecture: Architecture | None = None,
) -> Decoder:
    """Build the torchtitan module for `cfg` (or `architecture`) on `device`; parameters stay uninitialised
    until `init_weights` (or `init_buffers` before loading a state dict)."""
    model_config = build_model_config(cfg, vocab_size, attention=attention, architecture=architecture)
    with torch.device(device):
        model = model_config.build()
    return model


def _has_meta_tensors(model: nn.Module) -> bool:
    return any(t.is_meta for t in model.parameters()) or any(t.is_meta for t in model.buffers())


def init_weights(model: Decoder, seed: int, *, device: str | torch.device | None = None) -> Decoder:
    """Random-initialise every parameter and buffer, deterministic for a seed (on FSDP, the same on every
    rank); the global RNG is untouched. A meta model needs `device` (else ValueError)."""
    if _has_meta_tensors(model):
        if device is None:
            raise ValueError("init_weights: the model is on the meta device; pass device='cpu' or 'cuda'")
        model.to_empty(device=device)
    buffer_device = torch.device(device) if device is not None else next(model.parameters()).device
    fork_devices = [buffer_device] if buffer_device.type == "cuda" else []
    with torch.random.fork_rng(devices=fork_devices, device_type=buffer_device.type):
        torch.manual_seed(seed)
        with torch.no_grad():
            model.init_states(buffer_device=buffer_device)
    return model


def init_buffers(model: Decoder, *, device: str | torch.device) -> Decoder:
    """Materialise a meta model on `device` with its buffers (RoPE caches) computed but weights left unset,
    for loading a state dict next without drawing random weights first."""
    from torchtitan.protocols.module import Module

    model.to_empty(device=device)
    for module in model.modules():
        if isinstance(module, Module):
            # torchtitan's per-module buffer hook; init_states calls it after the parameter initialisers.
            module._init_self_buffers(buffer_device=torch.device(device))
    return model


def num_params(model: nn.Module, *, exclude_embeddings: bool = False) -> int:
    """Number of distinct parameters (tied weights once, FSDP shards at full size); `exclude_embeddings`
    drops the input embedding table unless it is tied to the lm_head."""
    params = {id(p): p for p in model.parameters()}
    total = sum(p.numel() for p in params.values())
    if not exclude_embeddings:
        return total
    embedding = getattr(model, "tok_embeddings", None)
    lm_head = getattr(model, "lm_head", None)
    if embedding is None or (lm_head is not None and embedding.weight is lm_head.weight):
        return total
    return total - embedding.weight.numel()


def _matmul_params_per_token(model_config: Decoder.Config) -> int:
    """Parameters touched by a matmul per token: all linear layers incl. lm_head, no embedding lookup."""
    total = model_config.dim * model_config.vocab_size  # lm_head
    for layer in model_config.layers:
        attn = layer.attention
        head_dim = attn.head_dim or attn.dim // attn.n_heads
        n_kv_heads = attn.n_kv_heads or attn.n_heads
        total += attn.dim * (attn.n_heads + 2 * n_kv_heads) * head_dim  # wq, wk, wv
        total += attn.n_heads * head_dim * attn.dim  # wo
        ffn = layer.feed_forward
        total += ffn.w1.in_features * ffn.w1.out_features
        total += ffn.w2.in_features * ffn.w2.out_features
        total += ffn.w3.in_features * ffn.w3.out_features
    return total


def flops_per_token(model_config: Decoder.Config, seq_len: int) -> int:
    """Training FLOPs per token of a dense model: 6 N + 12 L H d_head T, N the matmul parameters; no causal
    discount, as torchtitan and PaLM count it."""


    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len}: must be >= 1")
    attention_flops = 0
    for layer in model_config.layers:
        attn = layer.attention
        head_dim = attn.head_dim or attn.dim // attn.n_heads
        attention_flops += 12 * attn.n_heads * head_dim * seq_len
    return 6 * _matmul_params_per_token(model_config) + attention_flops
