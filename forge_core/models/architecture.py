"""The network a model is, in one record: read from an HF `config.json` or a torchtitan config, compared,
and written back into an exported `config.json`.

    arch = architecture_of_hf_config(json.loads(text), where="/models/x/config.json")   # ValueError if unsupported
    model_config = build_model_config(cfg.model, vocab_size, attention="sdpa", architecture=arch)

Families and the HF `model_type` each reads: `llama3` <- `llama` (optional Llama-3 RoPE scaling), `qwen2` <-
`qwen2` (q/k/v biases, no qk-norm), `qwen3` <- `qwen3` (dense; qk-norm). Any other feature the forward pass
would need is a ValueError naming the config.json field and value, never a silently different model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

FAMILY_OF_MODEL_TYPE = {"llama": "llama3", "qwen2": "qwen2", "qwen3": "qwen3"}
MODEL_TYPE_OF_FAMILY = {family: model_type for model_type, family in FAMILY_OF_MODEL_TYPE.items()}
HF_ARCHITECTURE = {"llama3": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# RoPE types each family's torchtitan RoPE reproduces exactly (CosSinRoPE has no Llama-3 scaling).
_ROPE_TYPES = {"llama3": ("default", "llama3"), "qwen2": ("default",), "qwen3": ("default",)}
_LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(frozen=True)
class Architecture:
    """Every size and switch that decides a dense decoder's forward pass, except vocab size and context."""

    family: str  # "llama3" | "qwen2" | "qwen3"
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    rope_theta: float
    rope_type: str = "default"  # "default" | "llama3"
    # Llama-3 RoPE scaling: factor, low_freq_factor, high_freq_factor, original_max_position_embeddings.
    rope_scaling: tuple[float, float, float, int] | None = None

    @property
    def qkv_bias(self) -> bool:
        return self.family == "qwen2"

    @property
    def qk_norm(self) -> bool:
        return self.family == "qwen3"

    def rope_parameters(self) -> dict[str, Any]:
        """transformers' `rope_parameters` of this RoPE."""
        parameters: dict[str, Any] = {"rope_type": self.rope_type, "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            parameters.update(zip(_LLAMA3_ROPE_KEYS, self.rope_scaling))
        return parameters

    def hf_fields(self) -> dict[str, Any]:
        """The config.json fields that state this architecture (transformers' names)."""
        return {
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "rope_parameters": self.rope_parameters(),
        }

    def differences(self, other: Architecture) -> dict[str, tuple[Any, Any]]:
        """{field: (this value, other value)} for every field where the two differ."""
        mine, theirs = dataclasses.asdict(self), dataclasses.asdict(other)
        return {name: (mine[name], theirs[name]) for name in mine if mine[name] != theirs[name]}


def family_of_model_type(raw: dict[str, Any], where: str) -> str:
    """The forgeflow family of a config.json's `model_type` (ValueError naming it when unsupported)."""
    model_type = raw.get("model_type")
    if model_type not in FAMILY_OF_MODEL_TYPE:
        raise ValueError(
            f"{where}: model_type={model_type!r} is not supported; forgeflow builds the dense decoders "
            f"{sorted(FAMILY_OF_MODEL_TYPE)} (model.family {sorted(MODEL_TYPE_OF_FAMILY)})"
        )
    return FAMILY_OF_MODEL_TYPE[model_type]


def architecture_of_hf_config(raw: dict[str, Any], where: str) -> Architecture:
    """The architecture a parsed config.json describes, with transformers' defaults for absent fields;
    ValueError naming `where`, the field and its value for an unsupported model type or feature."""


    import transformers

    family = family_of_model_type(raw, where)
    hf = transformers.CONFIG_MAPPING[raw["model_type"]].from_dict(raw)
    problems = _unsupported_features(raw, hf, family)
    if problems:
        raise ValueError(
            f"{where}: {'; '.join(problems)}. forgeflow's {family} builds the plain dense model only; use a "
            "checkpoint without these features"
        )
    heads = int(hf.num_attention_heads)
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    return Architecture(
        family=family,
        hidden_size=int(hf.hidden_size),
        intermediate_size=int(hf.intermediate_size),
        num_hidden_layers=int(hf.num_hidden_layers),
        num_attention_heads=heads,
        num_key_value_heads=int(getattr(hf, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(hf, "head_dim", None) or hf.hidden_size // heads),
        rms_norm_eps=float(hf.rms_norm_eps),
        tie_word_embeddings=bool(hf.tie_word_embeddings),
        rope_theta=float(rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0))),
        rope_type=rope_type,
        rope_scaling=(
            (*(float(rope[k]) for k in _LLAMA3_ROPE_KEYS[:3]), int(rope[_LLAMA3_ROPE_KEYS[3]]))
            if rope_type == "llama3"
            else None
        ),
    )


def _rope_field(raw: dict[str, Any]) -> str:
    return "rope_parameters" if "rope_parameters" in raw else "rope_scaling"


def _unsupported_features(raw: dict[str, Any], hf, family: str) -> list[str]:
    """Each setting of the checkpoint that forgeflow's model of `family` would not reproduce, as `field=value`."""
    problems = []
    for flag in ("attention_bias", "mlp_bias", "use_sliding_window"):
        if raw.get(flag):
            problems.append(f"{flag}={raw[flag]!r}")
    if getattr(hf, "hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf.hidden_act!r} (only silu)")
    layer_types = raw.get("layer_types") or []
    if any(kind != "full_attention" for kind in layer_types):
        problems.append(f"layer_types={sorted(set(layer_types))!r} (only full_attention)")
    for field in ("num_experts", "num_local_experts", "n_routed_experts"):
        if raw.get(field):
            problems.append(f"{field}={raw[field]!r} (mixture of experts)")
    if raw.get("quantization_config"):
        problems.append(f"quantization_config.quant_method={raw['quantization_config'].get('quant_method')!r}")
    if raw.get("partial_rotary_factor", 1.0) != 1.0:
        problems.append(f"partial_rotary_factor={raw['partial_rotary_factor']!r}")
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type not in _ROPE_TYPES[family]:
        problems.append(
            f"{_rope_field(raw)}.rope_type={rope_type!r} (supported for {family}: {list(_ROPE_TYPES[family])})"
        )
    heads = raw.get("num_attention_heads") or 0
    head_dim = raw.get("head_dim")
    if family == "llama3" and head_dim and heads and head_dim * heads != raw.get("hidden_size"):
        problems.append(
            f"head_dim={head_dim!r} with hidden_size={raw.get('hidden_size')!r}, num_attention_heads={heads!r} "
            "(llama needs head_dim = hidden_size / num_attention_heads)"
        )
    return problems
