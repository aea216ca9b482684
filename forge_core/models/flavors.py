"""Model flavors: torchtitan's dense registry flavors plus forgeflow's small CPU flavors.

`build_model_config(cfg.model, vocab_size, attention="sdpa")` returns a torchtitan `Decoder.Config`
(`Llama3Model.Config` / `Qwen3Model.Config`) with the tokenizer's vocab size, `max_seq_len` applied to every
layer's RoPE and the chosen inner attention in every layer. Build the module with `config.build()` or
`forge_core.models.build_model`.

Attention backends:
- "sdpa": `F.scaled_dot_product_attention` with `is_causal=True`. Works on CPU and GPU, forward and backward.
  Causal only: it cannot separate documents packed into one row, so callers feed one sequence per row.
- "flex": torchtitan's default for language models (GPU). Needs block masks built from positions
  (`forge_core.models.forward_logits` builds them). FlexAttention has no CPU backward. forgeflow's trainers
  use SDPA on GPU too (`attention_choice` says why).
- "varlen": GPU varlen kernels, also mask-driven.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Literal, get_args

from torchtitan.models.common import (
    ComplexRoPE,
    CosSinRoPE,
    Decoder,
    Embedding,
    FlexAttention,
    FusedQKVLinear,
    Linear,
    QKVLinear,
    RMSNorm,
    ScaledDotProductAttention,
    VarlenAttention,
    compute_ffn_hidden_dim,
)

from forge_core.config.catalog import FAMILIES, FLAVORS, FORGE_FLAVORS, validate_flavor
from forge_core.config.schema import ModelConfig

__all__ = [
    "ATTENTION_BACKENDS",
    "FAMILIES",
    "FLAVORS",
    "AttentionBackend",
    "attention_backend_of",
    "attention_choice",
    "attention_for_device",
    "build_model_config",
    "validate_flavor",
]

AttentionBackend = Literal["sdpa", "flex", "varlen"]
ATTENTION_BACKENDS: tuple[str, ...] = get_args(AttentionBackend)

# Placeholder vocab of the forgeflow flavors; build_model_config always applies the tokenizer's size.
_PLACEHOLDER_VOCAB = 64
# Placeholder context of the forgeflow flavors; build_model_config applies ModelConfig.max_seq_len.
_PLACEHOLDER_SEQ_LEN = 2048


def _llama3_forge_flavor(
    *, dim: int, n_layers: int, n_heads: int, n_kv_heads: int, rope_theta: float, rope_scaling: str
) -> Callable[[], Decoder.Config]:
    """A Llama3 config assembled from torchtitan's own llama3 building blocks and initialisers."""

    def build() -> Decoder.Config:
        # The initialisers and layer builder are module-level helpers of the pinned torchtitan 0.3.0; reusing
        # them keeps our small flavors initialised exactly like torchtitan's registry flavors.
        from torchtitan.models import llama3 as tt_llama3
        from torchtitan.models.llama3.model import Llama3Model

        vocab = _PLACEHOLDER_VOCAB
        return Llama3Model.Config(
            dim=dim,
            vocab_size=vocab,
            tok_embeddings=Embedding.Config(
                num_embeddings=vocab, embedding_dim=dim, param_init=tt_llama3._EMBEDDING_INIT
            ),
            norm=RMSNorm.Config(normalized_shape=dim, param_init=tt_llama3._NORM_INIT),
            lm_head=Linear.Config(
                in_features=dim, out_features=vocab, param_init=tt_llama3._output_linear_init(dim)
            ),
            layers=tt_llama3._build_llama3_layers(
                fuse_qkv=True,
                n_layers=n_layers,
                dim=dim,
                n_heads=n_heads,
                n_kv_heads=n_kv_heads,
                hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=256),
                rope=ComplexRoPE.Config(
                    dim=dim // n_heads,
                    max_seq_len=_PLACEHOLDER_SEQ_LEN,
                    theta=rope_theta,
                    scaling=rope_scaling,
                ),
                attn_backend="flex",
            ),
        )

    return build


def _qwen3_forge_flavor(
    *, dim: int, n_layers: int, n_heads: int, n_kv_heads: int, head_dim: int, hidden_dim: int
) -> Callable[[], Decoder.Config]:
    """A dense Qwen3 config (qk-norm, tied embeddings) from torchtitan's qwen3 building blocks."""

    def build() -> Decoder.Config:
        from torchtitan.models import qwen3 as tt_qwen3
        from torchtitan.models.qwen3.model import Qwen3Model

        vocab = _PLACEHOLDER_VOCAB
        return Qwen3Model.Config(
            vocab_size=vocab,
            dim=dim,
            norm=tt_qwen3._qwen3_norm(dim),
            enable_weight_tying=True,
            tok_embeddings=Embedding.Config(
                num_embeddings=vocab, embedding_dim=dim, param_init=tt_qwen3._EMBEDDING_SKIP_INIT
            ),
            lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=tt_qwen3._LINEAR_INIT),
            layers=tt_qwen3._build_qwen3_layers(
                fuse_qkv=True,
                n_layers=n_layers,
                dim=dim,
                n_heads=n_heads,
                n_kv_heads=n_kv_heads,
                head_dim=head_dim,
                hidden_dim=hidden_dim,
                attn_backend="flex",
                rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=_PLACEHOLDER_SEQ_LEN, theta=1000000.0),
            ),
        )

    return build


# forgeflow's CPU flavors. llama3 `tiny` is the demo model of DESIGN.md section 8 (hidden 128, 2 layers,
# 4 heads: ~0.53M parameters with a 15-symbol vocab); `small` mirrors torchtitan's debugmodel (dim 256,
# 6 layers, Llama-3 RoPE scaling) with grouped-query attention, ~5M parameters with a small vocab; `medium`
# (dim 512, 8 layers, head dim 64, ~27M parameters) is the size where vLLM starts to beat transformers' generate
# on CPU (bench/rollout_throughput.py) and the model bench/grpo_iteration.py compares against TRL on.
_FORGE_FLAVORS: dict[str, dict[str, Callable[[], Decoder.Config]]] = {
    "llama3": {
        "tiny": _llama3_forge_flavor(
            dim=128, n_layers=2, n_heads=4, n_kv_heads=4, rope_theta=10000.0, rope_scaling="none"
        ),
        "small": _llama3_forge_flavor(
            dim=256, n_layers=6, n_heads=16, n_kv_heads=8, rope_theta=500000.0, rope_scaling="llama"
        ),
        "medium": _llama3_forge_flavor(
            dim=512, n_layers=8, n_heads=8, n_kv_heads=8, rope_theta=500000.0, rope_scaling="none"
        ),
    },
    "qwen3": {
        "tiny": _qwen3_forge_flavor(
            dim=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, hidden_dim=384
        ),
        "small": _qwen3_forge_flavor(
            dim=256, n_layers=6, n_heads=8, n_kv_heads=4, head_dim=64, hidden_dim=768
        ),
        "medium": _qwen3_forge_flavor(
            dim=512, n_layers=8, n_heads=8, n_kv_heads=4, head_dim=64, hidden_dim=1536
        ),
    },
}

assert {family: tuple(flavors) for family, flavors in _FORGE_FLAVORS.items()} == FORGE_FLAVORS


def attention_choice(device_type: str) -> tuple[AttentionBackend, str]:
    """The attention backend forgeflow uses on a device type, and why (the engine records both).

    SDPA on both: every trainer batch holds one right-padded sequence per row (forge_core.batch.tokens:
    padding, not packing), for which plain causal attention is exact. Flex attention is only needed for masks
    inside a row (packed documents), which forgeflow does not build; on GPU torchtitan 0.3.0 compiles it with
    max-autotune for every distinct sequence length, and past torch's recompile limit it falls back to an
    unfused path that materialises B x H x L^2 scores.
    """
    if device_type == "cpu":
        return "sdpa", "CPU: FlexAttention has no CPU backward; batches are right-padded, causal SDPA is exact"
    if device_type == "cuda":
        return "sdpa", (
            "CUDA: batches are right-padded (one sequence per row), so causal SDPA (cuDNN/flash kernels) is exact; "
            "flex would only be needed for packed documents and recompiles per sequence length"
        )
    raise ValueError(f"device_type={device_type!r}: unsupported; use 'cpu' or 'cuda'")


def attention_for_device(device_type: str) -> AttentionBackend:
    """The attention backend forgeflow uses on a device type (see `attention_choice` for why)."""
    return attention_choice(device_type)[0]


def _inner_attention_config(attention: str):
    if attention == "sdpa":
        return ScaledDotProductAttention.Config()
    if attention == "flex":
        return FlexAttention.Config()
    if attention == "varlen":
        return VarlenAttention.Config()
    raise ValueError(
        f"attention={attention!r}: unknown attention backend; valid: {list(ATTENTION_BACKENDS)} "
        "('sdpa' on CPU)"
    )


def attention_backend_of(model_config: Decoder.Config) -> AttentionBackend:
    """Which attention backend a built model config uses (read from its first attention layer)."""
    inner = model_config.first_attention.inner_attention
    if isinstance(inner, ScaledDotProductAttention.Config):
        return "sdpa"
    if isinstance(inner, FlexAttention.Config):
        return "flex"
    if isinstance(inner, VarlenAttention.Config):
        return "varlen"
    raise TypeError(f"unexpected inner attention config {type(inner).__name__}")


def _base_config(family: str, flavor: str) -> Decoder.Config:
    if flavor in _FORGE_FLAVORS[family]:
        return _FORGE_FLAVORS[family][flavor]()
    if family == "llama3":
        from torchtitan.models.llama3 import model_registry
    else:
        from torchtitan.models.qwen3 import model_registry
    return model_registry(flavor, attn_backend="flex").model


def _with_vocab(config: Decoder.Config, vocab_size: int) -> Decoder.Config:
    return dataclasses.replace(
        config,
        vocab_size=vocab_size,
        tok_embeddings=dataclasses.replace(config.tok_embeddings, num_embeddings=vocab_size),
        lm_head=dataclasses.replace(config.lm_head, out_features=vocab_size),
    )


def _qkv_base_init(family: str) -> dict:
    # The per-tensor initialiser torchtitan wraps for its fused wqkv; its fused init is documented as
    # bit-identical to initialising separate wq/wk/wv with it.
    if family == "llama3":
        from torchtitan.models import llama3 as tt_family
    else:
        from torchtitan.models import qwen3 as tt_family
    return tt_family._LINEAR_INIT


def _separate_qkv(attn, family: str):
    """Replace torchtitan's fused `wqkv` by separate wq/wk/wv projections.

    With the fused layout, `model.state_dict()` keys (wq/wk/wv, made by a state-dict hook) are not parameter
    names, which breaks `torch.distributed.checkpoint.state_dict.get_model_state_dict` / `set_model_state_dict`
    (FQN lookup fails). Separate projections keep parameters, state-dict keys and torchtitan's canonical names
    identical, so DCP, FSDP full-state-dict gathering and HF conversion all see one naming.
    """
    qkv = attn.qkv_linear
    if not isinstance(qkv, FusedQKVLinear.Config):
        return attn
    init = _qkv_base_init(family)
    dim = qkv.wqkv.in_features
    return dataclasses.replace(
        attn,
        qkv_linear=QKVLinear.Config(
            head_dim=qkv.head_dim,
            wq=Linear.Config(in_features=dim, out_features=qkv.n_heads * qkv.head_dim, param_init=init),
            wkv=Linear.Config(in_features=dim, out_features=qkv.n_kv_heads * qkv.head_dim, param_init=init),
        ),
    )


def _with_attention(config: Decoder.Config, family: str, max_seq_len: int, attention: str) -> Decoder.Config:
    layers = []
    for layer in config.layers:
        attn = _separate_qkv(layer.attention, family)
        attn = dataclasses.replace(
            attn,
            rope=dataclasses.replace(attn.rope, max_seq_len=max_seq_len),
            inner_attention=_inner_attention_config(attention),
        )
        layers.append(dataclasses.replace(layer, attention=attn))
    return dataclasses.replace(config, layers=layers)


def build_model_config(cfg: ModelConfig, vocab_size: int, *, attention: AttentionBackend) -> Decoder.Config:
    """torchtitan model config for `cfg.family`/`cfg.flavor` with the tokenizer's vocab and `cfg.max_seq_len`.

    Attention uses separate wq/wk/wv projections (torchtitan's registry fuses them into `wqkv`; see
    `_separate_qkv` for why forgeflow does not), initialised exactly as torchtitan initialises the fused one.

    `attention` is explicit on purpose (FlexAttention has no CPU backward); `attention_choice(device.type)`
    gives forgeflow's choice and its reason. Raises ValueError for an unknown
    family/flavor/backend or non-positive sizes.
    """
    validate_flavor(cfg.family, cfg.flavor)
    if vocab_size < 1:
        raise ValueError(f"vocab_size={vocab_size}: must be >= 1 (the tokenizer's vocabulary size)")
    if cfg.max_seq_len < 1:
        raise ValueError(f"model.max_seq_len={cfg.max_seq_len}: must be >= 1")
    _inner_attention_config(attention)  # validate before building anything
    config = _base_config(cfg.family, cfg.flavor)
    config = _with_vocab(config, vocab_size)
    return _with_attention(config, cfg.family, cfg.max_seq_len, attention)
