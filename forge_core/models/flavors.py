"""Model configs: any architecture of a supported family, torchtitan's dense registry flavors and forgeflow's
small CPU flavors, all built from torchtitan's own building blocks and initialisers.

Attention backends: "sdpa" (causal only, so callers feed one sequence per row; CPU and GPU), "flex" and
"varlen" (block masks built from positions by `forward_logits`; GPU, flex has no CPU backward).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
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
)
from torchtitan.models.qwen3.model import Qwen3Model

from forge_core.config.catalog import (
    AUTO_FLAVOR,
    FAMILIES,
    FLAVORS,
    FORGE_FLAVORS,
    FROM_SCRATCH_FLAVOR,
    validate_flavor,
)
from forge_core.config.schema import ModelConfig
from forge_core.models.architecture import MODEL_TYPE_OF_FAMILY, Architecture

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


class Qwen2Model(Qwen3Model):
    """Qwen2 / Qwen2.5: Qwen3's decoder with q/k/v biases and no qk-norm; its own class so a built config
    names its family."""

    @dataclass(kw_only=True, slots=True)
    class Config(Qwen3Model.Config):
        pass


def _llama3_config(arch: Architecture) -> Decoder.Config:
    """A Llama3 config from torchtitan's llama3 helpers, so it initialises exactly like the registry flavors."""
    from torchtitan.models import llama3 as tt_llama3
    from torchtitan.models.llama3.model import Llama3Model

    dim, vocab = arch.hidden_size, _PLACEHOLDER_VOCAB
    scaling = {}
    if arch.rope_scaling is not None:
        factor, low, high, original = arch.rope_scaling
        scaling = {
            "scaling": "llama",
            "scaling_factor": factor,
            "low_freq_factor": low,
            "high_freq_factor": high,
            "original_max_position_embeddings": original,
        }
    return Llama3Model.Config(
        dim=dim,
        vocab_size=vocab,
        enable_weight_tying=arch.tie_word_embeddings,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=tt_llama3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=tt_llama3._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=tt_llama3._output_linear_init(dim)),
        layers=tt_llama3._build_llama3_layers(
            fuse_qkv=True,
            n_layers=arch.num_hidden_layers,
            dim=dim,
            n_heads=arch.num_attention_heads,
            n_kv_heads=arch.num_key_value_heads,
            hidden_dim=arch.intermediate_size,
            rope=ComplexRoPE.Config(
                dim=arch.head_dim, max_seq_len=_PLACEHOLDER_SEQ_LEN, theta=arch.rope_theta, **scaling
            ),
            attn_backend="flex",
        ),
    )


def _qwen_config(arch: Architecture) -> Decoder.Config:
    """A dense Qwen3 config from torchtitan's qwen3 helpers; Qwen2 swaps the qk-norm for q/k/v biases."""
    from torchtitan.models import qwen3 as tt_qwen3

    dim, vocab = arch.hidden_size, _PLACEHOLDER_VOCAB
    layers = tt_qwen3._build_qwen3_layers(
        # Qwen2's biased projections are built separate: _separate_qkv only splits bias-free fused ones.
        fuse_qkv=not arch.qkv_bias,
        n_layers=arch.num_hidden_layers,
        dim=dim,
        n_heads=arch.num_attention_heads,
        n_kv_heads=arch.num_key_value_heads,
        head_dim=arch.head_dim,
        hidden_dim=arch.intermediate_size,
        attn_backend="flex",
        rope=CosSinRoPE.Config(dim=arch.head_dim, max_seq_len=_PLACEHOLDER_SEQ_LEN, theta=arch.rope_theta),
    )
    if not arch.qk_norm:
        layers = [_without_qk_norm_with_qkv_bias(layer) for layer in layers]
    config_cls = Qwen2Model.Config if arch.family == "qwen2" else Qwen3Model.Config
    return config_cls(
        vocab_size=vocab,
        dim=dim,
        norm=tt_qwen3._qwen3_norm(dim),
        enable_weight_tying=arch.tie_word_embeddings,
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab, embedding_dim=dim, param_init=tt_qwen3._EMBEDDING_SKIP_INIT
        ),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=tt_qwen3._LINEAR_INIT),
        layers=layers,
    )


def _without_qk_norm_with_qkv_bias(layer):
    attn = layer.attention
    qkv = attn.qkv_linear
    qkv = dataclasses.replace(
        qkv, wq=dataclasses.replace(qkv.wq, bias=True), wkv=dataclasses.replace(qkv.wkv, bias=True)
    )
    return dataclasses.replace(layer, attention=dataclasses.replace(attn, qk_norm=None, qkv_linear=qkv))


def _with_norm_eps(config: Decoder.Config, eps: float) -> Decoder.Config:
    """Every RMSNorm of the model (block norms, qk-norm, final norm) at the checkpoint's rms_norm_eps."""

    def norm(norm_config):
        return None if norm_config is None else dataclasses.replace(norm_config, eps=eps)

    layers = []
    for layer in config.layers:
        attention = dataclasses.replace(layer.attention, qk_norm=norm(layer.attention.qk_norm))
        layers.append(
            dataclasses.replace(
                layer, attention_norm=norm(layer.attention_norm), ffn_norm=norm(layer.ffn_norm), attention=attention
            )
        )
    return dataclasses.replace(config, norm=norm(config.norm), layers=layers)


def config_of_architecture(arch: Architecture) -> Decoder.Config:
    """The torchtitan config of an architecture (placeholder vocab and context: build_model_config sets both)."""
    builder = _llama3_config if arch.family == "llama3" else _qwen_config
    return _with_norm_eps(builder(arch), arch.rms_norm_eps)


def _flavor(family: str, **sizes) -> Architecture:
    defaults = {
        "llama3": {"rms_norm_eps": 1e-5, "tie_word_embeddings": False, "rope_theta": 10000.0},
        "qwen2": {"rms_norm_eps": 1e-6, "tie_word_embeddings": True, "rope_theta": 1000000.0},
        "qwen3": {"rms_norm_eps": 1e-6, "tie_word_embeddings": True, "rope_theta": 1000000.0},
    }[family]
    sizes.setdefault("head_dim", sizes["hidden_size"] // sizes["num_attention_heads"])
    return Architecture(family=family, **{**defaults, **sizes})


# forgeflow's CPU flavors. llama3 `tiny` is the demo model; `small` mirrors torchtitan's debugmodel with
# grouped-query attention. The llama3 FFN widths are torchtitan's compute_ffn_hidden_dim(dim, multiple_of=256).
_FORGE_FLAVORS: dict[str, dict[str, Architecture]] = {
    "llama3": {
        "tiny": _flavor(
            "llama3", hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4,
        ),
        "small": _flavor(
            "llama3", hidden_size=256, intermediate_size=768, num_hidden_layers=6, num_attention_heads=16,
            num_key_value_heads=8, rope_theta=500000.0, rope_type="llama3", rope_scaling=(8.0, 1.0, 4.0, 8192),
        ),
        "medium": _flavor(
            "llama3", hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
            num_key_value_heads=8, rope_theta=500000.0,
        ),
    },
    "qwen2": {
        "tiny": _flavor(
            "qwen2", hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2,
        ),
    },
    "qwen3": {
        "tiny": _flavor(
            "qwen3", hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32,
        ),
        "small": _flavor(
            "qwen3", hidden_size=256, intermediate_size=768, num_hidden_layers=6, num_attention_heads=8,
            num_key_value_heads=4, head_dim=64,
        ),
        "medium": _flavor(
            "qwen3", hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
            num_key_value_heads=4, head_dim=64,
        ),
    },
}

assert {family: tuple(flavors) for family, flavors in _FORGE_FLAVORS.items()} == FORGE_FLAVORS


def attention_choice(device_type: str) -> tuple[AttentionBackend, str]:
    """The attention backend forgeflow uses on 'cpu' or 'cuda' (else ValueError), and why: SDPA on both,
    exact for right-padded batches; flex would recompile per sequence length on GPU."""
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
        return config_of_architecture(_FORGE_FLAVORS[family][flavor])
    if family == "llama3":
        from torchtitan.models.llama3 import model_registry
    else:
        from torchtitan.models.qwen3 import model_registry
    return model_registry(flavor, attn_backend="flex").model


def architecture_of_titan(model_config: Decoder.Config) -> Architecture:
    """The architecture a torchtitan config builds (the inverse of `config_of_architecture`)."""
    from torchtitan.models.llama3.model import Llama3Model

    if isinstance(model_config, Qwen2Model.Config):
        family = "qwen2"
    elif isinstance(model_config, Qwen3Model.Config):
        family = "qwen3"
    elif isinstance(model_config, Llama3Model.Config):
        family = "llama3"
    else:
        raise TypeError(f"no forgeflow family builds a {type(model_config).__qualname__}")
    attn = model_config.first_attention
    rope = attn.rope
    if rope.scaling not in ("none", "llama"):
        raise ValueError(f"RoPE scaling {rope.scaling!r} has no HF export in forgeflow (supported: none, llama)")
    scaling = None
    if rope.scaling == "llama":
        scaling = (
            float(rope.scaling_factor),
            float(rope.low_freq_factor),
            float(rope.high_freq_factor),
            int(rope.original_max_position_embeddings),
        )
    return Architecture(
        family=family,
        hidden_size=model_config.dim,
        intermediate_size=model_config.layers[0].feed_forward.w1.out_features,
        num_hidden_layers=len(model_config.layers),
        num_attention_heads=attn.n_heads,
        num_key_value_heads=attn.n_kv_heads or attn.n_heads,
        head_dim=attn.head_dim or model_config.dim // attn.n_heads,
        rms_norm_eps=float(model_config.layers[0].attention_norm.eps),
        tie_word_embeddings=bool(model_config.enable_weight_tying),
        rope_theta=float(rope.theta),
        rope_type="llama3" if scaling else "default",
        rope_scaling=scaling,
    )


def from_scratch_flavor(flavor: str) -> str:
    """The registered flavor a from-scratch run builds: `auto` without a checkpoint is the family's `tiny`."""
    return FROM_SCRATCH_FLAVOR if flavor == AUTO_FLAVOR else flavor


def flavor_architecture(family: str, flavor: str) -> Architecture:
    """The architecture of a registered flavor (forgeflow's CPU flavors or torchtitan's registry)."""
    validate_flavor(family, flavor)
    if flavor in _FORGE_FLAVORS[family]:
        return _FORGE_FLAVORS[family][flavor]
    return architecture_of_titan(_base_config(family, flavor))


def matching_flavor(arch: Architecture) -> str | None:
    """The registered flavor of `arch`'s family with exactly this architecture, if any."""
    for flavor in FLAVORS[arch.family]:
        if flavor_architecture(arch.family, flavor) == arch:
            return flavor
    return None


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
    else:  # qwen2 and qwen3 share qwen3's initialisers
        from torchtitan.models import qwen3 as tt_family
    return tt_family._LINEAR_INIT


def _separate_qkv(attn, family: str):
    """Replace torchtitan's fused `wqkv` by separate wq/wk/wv projections: fused state-dict keys (made by a
    hook) are not parameter names, which breaks DCP's `get_model_state_dict` / `set_model_state_dict`."""

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


def check_architecture(cfg: ModelConfig, architecture: Architecture | None) -> Architecture:
    """The given checkpoint architecture, else the named flavor's; ValueError when they disagree."""

    if architecture is None:
        if cfg.flavor == AUTO_FLAVOR and cfg.hf_path is not None:
            raise ValueError(
                f"model.flavor={AUTO_FLAVOR!r} with model.hf_path={cfg.hf_path!r}: the architecture comes from "
                "that checkpoint's config.json, which the caller did not pass (architecture=read_hf_info(folder)"
                ".architecture)"
            )
        return flavor_architecture(cfg.family, from_scratch_flavor(cfg.flavor))
    if architecture.family != cfg.family:
        raise ValueError(
            f"model.family={cfg.family!r}, but the checkpoint's config.json is model_type="
            f"{MODEL_TYPE_OF_FAMILY[architecture.family]!r} (family {architecture.family!r}); set "
            f"model.family={architecture.family}"
        )
    if cfg.flavor != AUTO_FLAVOR:
        named = flavor_architecture(cfg.family, cfg.flavor)
        if named != architecture:
            differences = ", ".join(
                f"{name}: flavor {mine!r} vs checkpoint {theirs!r}"
                for name, (mine, theirs) in named.differences(architecture).items()
            )
            raise ValueError(
                f"model.flavor={cfg.flavor!r} disagrees with the checkpoint's config.json ({differences}); set "
                f"model.flavor={AUTO_FLAVOR} (the checkpoint's own architecture) or use the matching checkpoint"
            )
    return architecture


def build_model_config(
    cfg: ModelConfig, vocab_size: int, *, attention: AttentionBackend, architecture: Architecture | None = None
) -> Decoder.Config:
    """torchtitan model config with the tokenizer's vocab, `cfg.max_seq_len` and `attention` in every layer.

    Builds `architecture` when given, else `cfg.family`/`cfg.flavor`. `attention` is explicit on purpose
    (FlexAttention has no CPU backward; see `attention_choice`). ValueError for unknown names, non-positive
    sizes, or a flavor or family that disagrees with `architecture`.
    """


    if cfg.flavor != AUTO_FLAVOR or cfg.family not in FAMILIES:
        validate_flavor(cfg.family, cfg.flavor)
    if vocab_size < 1:
        raise ValueError(f"vocab_size={vocab_size}: must be >= 1 (the tokenizer's vocabulary size)")
    if cfg.max_seq_len < 1:
        raise ValueError(f"model.max_seq_len={cfg.max_seq_len}: must be >= 1")
    _inner_attention_config(attention)  # validate before building anything
    arch = check_architecture(cfg, architecture)
    if architecture is None and from_scratch_flavor(cfg.flavor) not in _FORGE_FLAVORS[cfg.family]:
        config = _base_config(cfg.family, cfg.flavor)  # torchtitan's registry config, its own initialisers
    else:
        config = config_of_architecture(arch)
    config = _with_vocab(config, vocab_size)
    return _with_attention(config, cfg.family, cfg.max_seq_len, attention)
