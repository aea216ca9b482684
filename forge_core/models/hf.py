"""HF <-> torchtitan weights and configs: import HF checkpoints, export folders that transformers and vLLM load.

Export (end of an SFT/GRPO stage, rank 0, full unsharded state dict of plain tensors):

    write_hf_folder(state_dict, cfg.model, vocab_size, "/tmp/policy", tokenizer_dir="/tmp/tok")
    # -> model.safetensors, config.json, generation_config.json, tokenizer files

Import (object-store folders: download them first with `store.reader(uri).download_dir(prefix, local)`):

    state_dict, info = load_hf_folder("/tmp/policy")
    model = build_model(info.to_model_config(max_seq_len=256), info.vocab_size, attention="sdpa")
    init_buffers(model, device="cpu")
    model.load_state_dict(state_dict)

Weight names and layouts go through torchtitan's own `Llama3StateDictAdapter` / `Qwen3StateDictAdapter`,
which also permute Llama's q/k rows between torchtitan's interleaved-pair RoPE (`ComplexRoPE`) and HF's
rotate-half RoPE. Qwen3 uses rotate-half on both sides (`CosSinRoPE`), so no permutation there.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torchtitan.models.common import Decoder

from forge_core.config.schema import ModelConfig
from forge_core.models.flavors import FLAVORS, build_model_config

_HF_MODEL_TYPE = {"llama3": "llama", "qwen3": "qwen3"}
_HF_ARCHITECTURE = {"llama3": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_FAMILY_OF_MODEL_TYPE = {v: k for k, v in _HF_MODEL_TYPE.items()}

WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
# Files of an HF model folder that describe the model, not the tokenizer: never copied from a tokenizer folder
# (a tokenizer_dir may be a whole model folder; a stray weight shard would be loaded by vLLM next to ours).
_MODEL_FILES = {"config.json", "generation_config.json"}
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json")


def _is_tokenizer_file(path: Path) -> bool:
    return (
        path.is_file()
        and not path.name.startswith(".")
        and path.name not in _MODEL_FILES
        and not path.name.endswith(_WEIGHT_SUFFIXES)
    )


# ----------------------------------------------------------------------------------------------------------
# Architecture <-> HF config
# ----------------------------------------------------------------------------------------------------------


def _rope_parameters(model_config: Decoder.Config) -> dict[str, Any]:
    rope = model_config.first_attention.rope
    if rope.scaling == "none":
        return {"rope_type": "default", "rope_theta": float(rope.theta)}
    if rope.scaling == "llama":
        return {
            "rope_type": "llama3",
            "rope_theta": float(rope.theta),
            "factor": float(rope.scaling_factor),
            "low_freq_factor": float(rope.low_freq_factor),
            "high_freq_factor": float(rope.high_freq_factor),
            "original_max_position_embeddings": int(rope.original_max_position_embeddings),
        }
    raise ValueError(f"RoPE scaling {rope.scaling!r} has no HF export in forgeflow (supported: none, llama)")


def _architecture_of_titan(model_config: Decoder.Config) -> dict[str, Any]:
    """The HF config fields that define the network, derived from a torchtitan config."""
    attn = model_config.first_attention
    layer = model_config.layers[0]
    return {
        "hidden_size": model_config.dim,
        "intermediate_size": layer.feed_forward.w1.out_features,
        "num_hidden_layers": len(model_config.layers),
        "num_attention_heads": attn.n_heads,
        "num_key_value_heads": attn.n_kv_heads or attn.n_heads,
        "head_dim": attn.head_dim or model_config.dim // attn.n_heads,
        "rms_norm_eps": float(layer.attention_norm.eps),
        "tie_word_embeddings": bool(model_config.enable_weight_tying),
        "rope_parameters": _rope_parameters(model_config),
    }


def _architecture_of_hf(hf_config) -> dict[str, Any]:
    """The same fields read from a transformers config object (any serialisation format it accepts)."""
    rope = dict(getattr(hf_config, "rope_parameters", None) or {})
    rope_type = rope.get("rope_type", "default")
    keep = ["rope_type", "rope_theta"]
    if rope_type == "llama3":
        keep += ["factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"]
    rope = {k: rope.get(k) for k in keep}
    rope["rope_type"] = rope_type
    for k in ("rope_theta", "factor", "low_freq_factor", "high_freq_factor"):
        if rope.get(k) is not None:
            rope[k] = float(rope[k])
    heads = hf_config.num_attention_heads
    return {
        "hidden_size": hf_config.hidden_size,
        "intermediate_size": hf_config.intermediate_size,
        "num_hidden_layers": hf_config.num_hidden_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": hf_config.num_key_value_heads or heads,
        "head_dim": getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
        "rms_norm_eps": float(hf_config.rms_norm_eps),
        "tie_word_embeddings": bool(hf_config.tie_word_embeddings),
        "rope_parameters": rope,
    }


def _unsupported_hf_features(hf_config) -> list[str]:
    problems = []
    for flag in ("attention_bias", "mlp_bias", "use_sliding_window"):
        if getattr(hf_config, flag, False):
            problems.append(f"{flag}=True")
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf_config.hidden_act!r}")
    return problems


def hf_config_dict(
    cfg: ModelConfig,
    vocab_size: int,
    *,
    bos_token_id: int | None = None,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    """The `config.json` of `cfg`'s model as transformers (and vLLM) read it: LlamaConfig or Qwen3Config.

    Built through the installed transformers' own config class so the serialisation format (e.g. v5's
    `rope_parameters`) is the one its readers expect. `max_position_embeddings` is `cfg.max_seq_len`.
    """
    import transformers

    model_config = build_model_config(cfg, vocab_size, attention="sdpa")
    config_cls = {"llama3": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config}[cfg.family]
    dtype_name = str(dtype).removeprefix("torch.")
    hf_config = config_cls(
        vocab_size=vocab_size,
        max_position_embeddings=cfg.max_seq_len,
        hidden_act="silu",
        attention_bias=False,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        architectures=[_HF_ARCHITECTURE[cfg.family]],
        dtype=dtype_name,
        **_architecture_of_titan(model_config),
    )
    config = hf_config.to_dict()
    # Older readers (transformers < 4.56, some vLLM paths) look for `torch_dtype`, newer ones for `dtype`.
    config["dtype"] = dtype_name
    config["torch_dtype"] = dtype_name
    return config


# ----------------------------------------------------------------------------------------------------------
# State dicts
# ----------------------------------------------------------------------------------------------------------


def _adapter(model_config: Decoder.Config):
    from torchtitan.models.llama3.model import Llama3Model
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
    from torchtitan.models.qwen3.model import Qwen3Model
    from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

    if isinstance(model_config, Qwen3Model.Config):
        return Qwen3StateDictAdapter(model_config, None)
    if isinstance(model_config, Llama3Model.Config):
        return Llama3StateDictAdapter(model_config, None)
    raise TypeError(f"no HF adapter for {type(model_config).__name__}; forgeflow supports llama3 and qwen3")


def titan_to_hf_state_dict(
    state_dict: dict[str, torch.Tensor], model_config: Decoder.Config
) -> dict[str, torch.Tensor]:
    """torchtitan names/layouts (as `model.state_dict()` gives them: wq/wk/wv split) -> HF names/layouts.

    Llama q/k rows are permuted to HF's rotate-half RoPE. A tied lm_head is dropped (HF stores only
    `model.embed_tokens.weight` then). Input tensors are not modified.
    """
    return dict(_adapter(model_config).to_hf(dict(state_dict)))


def hf_to_titan_state_dict(
    hf_state_dict: dict[str, torch.Tensor], model_config: Decoder.Config
) -> dict[str, torch.Tensor]:
    """HF names/layouts -> torchtitan names/layouts, loadable with `model.load_state_dict(..., strict=True)`.

    Raises ValueError naming the first HF key torchtitan's adapter does not know.
    """
    try:
        return dict(_adapter(model_config).from_hf(dict(hf_state_dict)))
    except KeyError as exc:
        raise ValueError(
            f"HF weight {exc.args[0]!r} has no torchtitan counterpart for a "
            f"{type(model_config).__qualname__}; is this a dense Llama/Qwen3 checkpoint?"
        ) from None


def _expected_titan_shapes(model_config: Decoder.Config) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        model = model_config.build()
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _check_state_dict_matches(
    state_dict: dict[str, torch.Tensor], model_config: Decoder.Config, where: str
) -> None:
    expected = _expected_titan_shapes(model_config)
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    wrong = sorted(k for k in set(expected) & set(state_dict) if tuple(state_dict[k].shape) != expected[k])
    if missing or unexpected or wrong:
        details = []
        if missing:
            details.append(f"missing {missing[:5]}")
        if unexpected:
            details.append(f"unexpected {unexpected[:5]}")
        if wrong:
            k = wrong[0]
            details.append(f"shape of {k}: {tuple(state_dict[k].shape)} != expected {expected[k]}")
        raise ValueError(f"{where}: weights do not fit the model config ({'; '.join(details)})")


# ----------------------------------------------------------------------------------------------------------
# Folders
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HFModelInfo:
    """What an HF folder says about its model, in forgeflow's terms."""

    family: str  # "llama3" | "qwen3"
    flavor: str  # the FLAVORS[family] entry whose architecture equals config.json's
    vocab_size: int  # rows of the embedding table (may exceed the tokenizer's vocabulary)
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_id: int | list[int] | None
    hf_config: dict[str, Any]

    def to_model_config(self, max_seq_len: int | None = None, hf_path: str | None = None) -> ModelConfig:
        """A `ModelConfig` that rebuilds this architecture (context defaults to max_position_embeddings)."""
        return ModelConfig(
            family=self.family,
            flavor=self.flavor,
            hf_path=hf_path,
            max_seq_len=max_seq_len if max_seq_len is not None else self.max_position_embeddings,
        )


def _family_of(hf_config, config_path: Path) -> str:
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in _FAMILY_OF_MODEL_TYPE:
        raise ValueError(
            f"{config_path}: model_type={model_type!r} is not supported; forgeflow loads "
            f"{sorted(_FAMILY_OF_MODEL_TYPE)} (families {list(_HF_MODEL_TYPE)})"
        )
    return _FAMILY_OF_MODEL_TYPE[model_type]


def _matching_flavor(family: str, hf_config, vocab_size: int, config_path: Path) -> str:
    architecture = _architecture_of_hf(hf_config)
    for flavor in FLAVORS[family]:
        candidate = build_model_config(
            ModelConfig(family=family, flavor=flavor, max_seq_len=1), vocab_size, attention="sdpa"
        )
        if _architecture_of_titan(candidate) == architecture:
            return flavor
    raise ValueError(
        f"{config_path}: architecture {architecture} matches no flavor of model.family={family!r} "
        f"(flavors: {list(FLAVORS[family])}); add a flavor with these sizes to forge_core.models.flavors"
    )


def _read_hf_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    single = folder / WEIGHTS_FILE
    if single.exists():
        return load_file(single)
    index = folder / WEIGHTS_INDEX_FILE
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        weights: dict[str, torch.Tensor] = {}
        for shard in shards:
            weights.update(load_file(folder / shard))
        return weights
    raise ValueError(f"{folder}: no {WEIGHTS_FILE} or {WEIGHTS_INDEX_FILE}; is this an HF model folder?")


def load_hf_folder(local_dir: str | os.PathLike) -> tuple[dict[str, torch.Tensor], HFModelInfo]:
    """Read an HF Llama/Qwen3 folder into a torchtitan state dict (tensors in their stored dtype).

    Raises ValueError naming the folder/file for a missing config or weights, an unsupported model type or
    feature, an architecture that matches no forgeflow flavor, or weights that do not fit the config.
    """
    import transformers

    folder = Path(local_dir)
    config_path = folder / "config.json"
    if not config_path.exists():
        raise ValueError(
            f"{config_path}: not found; pass a local HF model folder (download storage URIs first)"
        )
    hf_config = transformers.AutoConfig.from_pretrained(folder)
    family = _family_of(hf_config, config_path)
    problems = _unsupported_hf_features(hf_config)
    if problems:
        raise ValueError(f"{config_path}: unsupported settings for forgeflow's {family}: {problems}")
    vocab_size = int(hf_config.vocab_size)
    flavor = _matching_flavor(family, hf_config, vocab_size, config_path)
    info = HFModelInfo(
        family=family,
        flavor=flavor,
        vocab_size=vocab_size,
        max_position_embeddings=int(hf_config.max_position_embeddings),
        bos_token_id=hf_config.bos_token_id,
        eos_token_id=hf_config.eos_token_id,
        hf_config=json.loads(config_path.read_text()),
    )
    model_config = build_model_config(info.to_model_config(), vocab_size, attention="sdpa")
    state_dict = hf_to_titan_state_dict(_read_hf_weights(folder), model_config)
    _check_state_dict_matches(state_dict, model_config, str(folder))
    return state_dict, info


def _special_token_ids(tokenizer_dir: Path) -> dict[str, Any]:
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    return {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "tokenizer_size": len(tokenizer),
    }


def _write_file_atomically(path: Path, write) -> None:
    """Write through a temp file + rename so a reader (e.g. vLLM's reload) never sees a half-written file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _hf_tensors_for_saving(hf_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    tensors = {}
    for name, tensor in hf_state_dict.items():
        if type(tensor) is not torch.Tensor:
            raise ValueError(
                f"write_hf_folder: {name} is a {type(tensor).__name__}; pass a full state dict of plain tensors "
                "(torch.distributed.checkpoint.state_dict.get_model_state_dict with full_state_dict=True)"
            )
        tensors[name] = tensor.detach().to("cpu").contiguous()
    return tensors


def write_hf_folder(
    titan_state_dict: dict[str, torch.Tensor],
    cfg: ModelConfig,
    vocab_size: int,
    out_dir: str | os.PathLike,
    tokenizer_dir: str | os.PathLike | None = None,
    *,
    bos_token_id: int | None = None,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
) -> Path:
    """Write `model.safetensors`, `config.json`, `generation_config.json` (+ tokenizer files) into `out_dir`.

    `titan_state_dict` is the full model state dict (plain tensors, as `model.state_dict()` gives it). Special
    token ids default to those of the tokenizer in `tokenizer_dir`; explicit arguments win. Files already in
    `out_dir` are replaced one by one atomically, so a running vLLM can reload the new weights in place.
    Returns `out_dir`.
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model_config = build_model_config(cfg, vocab_size, attention="sdpa")
    _check_state_dict_matches(titan_state_dict, model_config, "write_hf_folder")

    token_ids = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    if tokenizer_dir is not None:
        token_ids = _special_token_ids(Path(tokenizer_dir))
        if token_ids.pop("tokenizer_size") > vocab_size:
            raise ValueError(
                f"tokenizer_dir={tokenizer_dir}: tokenizer has more tokens than vocab_size={vocab_size}"
            )
    explicit = {"bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "pad_token_id": pad_token_id}
    token_ids.update({k: v for k, v in explicit.items() if v is not None})

    tensors = _hf_tensors_for_saving(titan_to_hf_state_dict(titan_state_dict, model_config))
    dtypes = {t.dtype for t in tensors.values()}
    if len(dtypes) != 1:
        raise ValueError(f"write_hf_folder: mixed parameter dtypes {sorted(map(str, dtypes))}; cast first")
    config = hf_config_dict(cfg, vocab_size, dtype=dtypes.pop(), **token_ids)
    generation_config = {k: v for k, v in token_ids.items() if v is not None}
    generation_config["_from_model_config"] = True
    generation_config["transformers_version"] = config.get("transformers_version")

    if tokenizer_dir is not None:
        for src in sorted(Path(tokenizer_dir).iterdir()):
            if _is_tokenizer_file(src):
                _write_file_atomically(out / src.name, lambda tmp, src=src: shutil.copyfile(src, tmp))
    _write_file_atomically(out / "config.json", lambda tmp: Path(tmp).write_text(_json(config)))
    _write_file_atomically(
        out / "generation_config.json", lambda tmp: Path(tmp).write_text(_json(generation_config))
    )
    # Weights last: a watcher that keys on the weights file sees a complete folder.
    _write_file_atomically(out / WEIGHTS_FILE, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
    return out


def _json(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True) + "\n"
