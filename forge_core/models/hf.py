"""HF <-> torchtitan weights and configs: import HF checkpoints, export folders that transformers and vLLM load.

    write_hf_folder(state_dict, cfg.model, vocab_size, "/tmp/policy", tokenizer_dir="/tmp/tok")  # full state dict
    state_dict, info = load_hf_folder("/tmp/policy")                                              # a local folder
    model = build_model(info.to_model_config(), info.vocab_size, attention="sdpa", architecture=info.architecture)
    init_buffers(model, device="cpu"); model.load_state_dict(state_dict)

Conversion uses torchtitan's state-dict adapters, which permute Llama's q/k rows between interleaved-pair and
rotate-half RoPE.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torchtitan.models.common import Decoder

from forge_core.config.catalog import AUTO_FLAVOR
from forge_core.config.schema import ModelConfig
from forge_core.models.architecture import (
    HF_ARCHITECTURE,
    Architecture,
    architecture_of_hf_config,
    family_of_model_type,
)
from forge_core.models.flavors import Qwen2Model, architecture_of_titan, build_model_config, matching_flavor

WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
# Files of an HF model folder that describe the model, not the tokenizer: never copied from a tokenizer folder
# (a tokenizer_dir may be a whole model folder; a stray weight shard would be loaded by vLLM next to ours).
_MODEL_FILES = {"config.json", "generation_config.json"}
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json")


def is_weights_file(name: str) -> bool:
    """Whether a file of an HF model folder (its path in the folder) holds weights or their index."""
    return name.endswith(_WEIGHT_SUFFIXES)


def _is_tokenizer_file(path: Path) -> bool:
    return (
        path.is_file()
        and not path.name.startswith(".")
        and path.name not in _MODEL_FILES
        and not is_weights_file(path.name)
    )


# ----------------------------------------------------------------------------------------------------------
# Architecture <-> HF config
# ----------------------------------------------------------------------------------------------------------


def hf_config_dict(
    cfg: ModelConfig,
    vocab_size: int,
    *,
    bos_token_id: int | None = None,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    dtype: torch.dtype = torch.float32,
    architecture: Architecture | None = None,
) -> dict[str, Any]:
    """The `config.json` of a from-scratch model, built through the installed transformers' config class so
    its readers get the format they expect; `max_position_embeddings` is `cfg.max_seq_len`."""
    import transformers

    arch = architecture_of_titan(build_model_config(cfg, vocab_size, attention="sdpa", architecture=architecture))
    config_cls = {
        "llama3": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }[arch.family]
    dtype_name = str(dtype).removeprefix("torch.")
    fields = arch.hf_fields()
    if arch.family != "qwen2":
        fields["attention_bias"] = False  # Qwen2's config has no switch: its q/k/v biases are always there
    else:
        fields.pop("head_dim")  # Qwen2Config derives it from hidden_size / num_attention_heads
    hf_config = config_cls(
        vocab_size=vocab_size,
        max_position_embeddings=cfg.max_seq_len,
        hidden_act="silu",
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        architectures=[HF_ARCHITECTURE[arch.family]],
        dtype=dtype_name,
        **fields,
    )
    config = hf_config.to_dict()
    return _with_dtype(config, dtype_name)


def _with_dtype(config: dict[str, Any], dtype_name: str) -> dict[str, Any]:
    # Older readers (transformers < 4.56, some vLLM paths) look for `torch_dtype`, newer ones for `dtype`.
    config["dtype"] = dtype_name
    config["torch_dtype"] = dtype_name
    return config


def checkpoint_config_dict(
    checkpoint: HFModelInfo, arch: Architecture, vocab_size: int, dtype: torch.dtype, token_ids: dict[str, Any]
) -> dict[str, Any]:
    """The checkpoint's config.json with dtype and vocab size set and missing special token ids filled in;
    ValueError when `arch` differs from the checkpoint's."""
    if arch != checkpoint.architecture:
        raise ValueError(
            f"export: the trained model's architecture differs from its checkpoint's config.json in "
            f"{sorted(arch.differences(checkpoint.architecture))}; it cannot keep that config"
        )
    config = dict(checkpoint.hf_config)
    config["vocab_size"] = vocab_size
    for name, value in token_ids.items():
        if config.get(name) is None and value is not None:
            config[name] = value
    return _with_dtype(config, str(dtype).removeprefix("torch."))


# ----------------------------------------------------------------------------------------------------------
# State dicts
# ----------------------------------------------------------------------------------------------------------


def _qwen2_adapter(model_config: Decoder.Config):
    """Qwen3's adapter plus the q/k/v biases (Qwen2 has no qk-norm weights, so to_hf never meets them)."""
    from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

    adapter = Qwen3StateDictAdapter(model_config, None)
    for proj, titan in (("q_proj", "wq"), ("k_proj", "wk"), ("v_proj", "wv")):
        adapter.from_hf_map[f"model.layers.{{}}.self_attn.{proj}.bias"] = f"layers.{{}}.attention.qkv_linear.{titan}.bias"
    return adapter


def _adapter(model_config: Decoder.Config):
    from torchtitan.models.llama3.model import Llama3Model
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
    from torchtitan.models.qwen3.model import Qwen3Model
    from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

    if isinstance(model_config, Qwen2Model.Config):
        return _qwen2_adapter(model_config)
    if isinstance(model_config, Qwen3Model.Config):
        return Qwen3StateDictAdapter(model_config, None)
    if isinstance(model_config, Llama3Model.Config):
        return Llama3StateDictAdapter(model_config, None)
    raise TypeError(f"no HF adapter for {type(model_config).__name__}; forgeflow supports llama3, qwen2 and qwen3")


def titan_to_hf_state_dict(
    state_dict: dict[str, torch.Tensor], model_config: Decoder.Config
) -> dict[str, torch.Tensor]:
    """torchtitan names/layouts -> HF names/layouts; a tied lm_head is dropped. Inputs are not modified."""
    return dict(_adapter(model_config).to_hf(dict(state_dict)))


def hf_to_titan_state_dict(
    hf_state_dict: dict[str, torch.Tensor], model_config: Decoder.Config
) -> dict[str, torch.Tensor]:
    """HF names/layouts -> torchtitan names/layouts; ValueError names the first HF key it does not know."""
    try:
        return dict(_adapter(model_config).from_hf(dict(hf_state_dict)))
    except KeyError as exc:
        raise ValueError(
            f"HF weight {exc.args[0]!r} has no torchtitan counterpart for a "
            f"{type(model_config).__qualname__}; is this a dense Llama/Qwen2/Qwen3 checkpoint?"
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
    """What an HF folder's config.json (and generation_config.json) say about its model, in forgeflow's terms."""

    family: str  # "llama3" | "qwen2" | "qwen3"
    architecture: Architecture
    flavor: str  # the registered flavor with exactly this architecture, else "auto"
    vocab_size: int  # rows of the embedding table (may exceed the tokenizer's vocabulary)
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_id: int | list[int] | None
    hf_config: dict[str, Any]  # config.json as written
    generation_config: dict[str, Any] | None = None  # generation_config.json as written, if the folder has one

    def to_model_config(self, max_seq_len: int | None = None, hf_path: str | None = None) -> ModelConfig:
        """A `ModelConfig` of this architecture; `auto` flavor needs `architecture=self.architecture` to build."""
        return ModelConfig(
            family=self.family,
            flavor=self.flavor,
            hf_path=hf_path,
            max_seq_len=max_seq_len if max_seq_len is not None else self.max_position_embeddings,
        )

    def context_problem(self, max_seq_len: int, where: str) -> str | None:
        """Why `model.max_seq_len` does not fit this checkpoint (None when it does)."""
        if max_seq_len <= self.max_position_embeddings:
            return None
        return (
            f"model.max_seq_len={max_seq_len}: exceeds the checkpoint's context, max_position_embeddings="
            f"{self.max_position_embeddings} in {where}; lower model.max_seq_len (and data.max_seq_len) to at "
            f"most {self.max_position_embeddings}"
        )


def model_info_of_config(
    raw: dict[str, Any], where: str, generation_config: dict[str, Any] | None = None
) -> HFModelInfo:
    """HFModelInfo of a parsed config.json (`where` names it in errors); ValueError for an unsupported model."""
    arch = architecture_of_hf_config(raw, where)
    vocab_size = raw.get("vocab_size")
    positions = raw.get("max_position_embeddings")
    for name, value in (("vocab_size", vocab_size), ("max_position_embeddings", positions)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{where}: {name}={value!r}; an HF model config needs a positive integer here")
    return HFModelInfo(
        family=family_of_model_type(raw, where),
        architecture=arch,
        flavor=matching_flavor(arch) or AUTO_FLAVOR,
        vocab_size=vocab_size,
        max_position_embeddings=positions,
        bos_token_id=raw.get("bos_token_id"),
        eos_token_id=raw.get("eos_token_id"),
        hf_config=raw,
        generation_config=generation_config,
    )


def read_hf_info(local_dir: str | os.PathLike) -> HFModelInfo:
    """HFModelInfo of a local HF folder from its config.json alone (no weights read)."""
    folder = Path(local_dir)
    config_path = folder / "config.json"
    if not config_path.exists():
        raise ValueError(
            f"{config_path}: not found; pass a local HF model folder (download storage URIs first)"
        )
    try:
        raw = json.loads(config_path.read_text())
    except ValueError as exc:
        raise ValueError(f"{config_path}: not valid JSON ({exc}); is this an HF model folder?") from None
    generation_path = folder / "generation_config.json"
    generation = json.loads(generation_path.read_text()) if generation_path.exists() else None
    return model_info_of_config(raw, str(config_path), generation)


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
    """Read a local HF Llama/Qwen2/Qwen3 folder into a torchtitan state dict (stored dtypes) and its info.

    ValueError for missing config or weights, an unsupported model, or weights that do not fit the config.
    """
    folder = Path(local_dir)
    info = read_hf_info(folder)
    model_config = build_model_config(
        info.to_model_config(), info.vocab_size, attention="sdpa", architecture=info.architecture
    )
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


def _write_file_atomically(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Write through a temp file + rename so a reader (e.g. vLLM's reload) never sees a half-written file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
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


def hf_folder_files(
    titan_state_dict: dict[str, torch.Tensor],
    cfg: ModelConfig,
    vocab_size: int,
    tokenizer_dir: str | os.PathLike | None = None,
    *,
    bos_token_id: int | None = None,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    checkpoint: HFModelInfo | None = None,
) -> list[tuple[str, Callable[[BinaryIO], None]]]:
    """The files of the HF folder `write_hf_folder` writes, each as (name, a function that writes it into a
    binary stream), weights last: a store's writer takes them without a local copy.

    `titan_state_dict` is the full state dict of plain tensors. Token ids default to `tokenizer_dir`'s. A
    model trained from `checkpoint` keeps its config files.

    Raises:
        ValueError: weights that do not fit the model, mixed dtypes, or a tokenizer larger than `vocab_size`.
    """
    arch = checkpoint.architecture if checkpoint is not None else None
    model_config = build_model_config(cfg, vocab_size, attention="sdpa", architecture=arch)
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
    dtype = dtypes.pop()
    if checkpoint is not None:
        config = checkpoint_config_dict(checkpoint, architecture_of_titan(model_config), vocab_size, dtype, token_ids)
    else:
        config = hf_config_dict(cfg, vocab_size, dtype=dtype, **token_ids)
    if checkpoint is not None and checkpoint.generation_config is not None:
        generation_config = dict(checkpoint.generation_config)
    else:
        generation_config = {k: v for k, v in token_ids.items() if v is not None}
        generation_config["_from_model_config"] = True
        generation_config["transformers_version"] = config.get("transformers_version")

    files: list[tuple[str, Callable[[BinaryIO], None]]] = []
    if tokenizer_dir is not None:
        for src in sorted(Path(tokenizer_dir).iterdir()):
            if _is_tokenizer_file(src):
                files.append((src.name, lambda f, src=src: _copy_file_into(src, f)))
    files.append(("config.json", lambda f: f.write(_json(config).encode())))
    files.append(("generation_config.json", lambda f: f.write(_json(generation_config).encode())))
    # Weights last: a watcher that keys on the weights file sees a complete folder.
    files.append((WEIGHTS_FILE, lambda f: write_safetensors(tensors, f, metadata={"format": "pt"})))
    return files


def write_hf_folder(
    titan_state_dict: dict[str, torch.Tensor],
    cfg: ModelConfig,
    vocab_size: int,
    out_dir: str | os.PathLike,
    tokenizer_dir: str | os.PathLike | None = None,
    **options: Any,
) -> Path:
    """Write `model.safetensors`, `config.json`, `generation_config.json` (+ tokenizer files) into `out_dir`.

    Each file is replaced atomically, so a running vLLM can reload in place. `options` are `hf_folder_files`'s
    keyword arguments. Returns `out_dir`.

    Raises:
        ValueError: as `hf_folder_files` does.
    """
    files = hf_folder_files(titan_state_dict, cfg, vocab_size, tokenizer_dir, **options)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, write in files:
        _write_file_atomically(out / name, write)
    return out


def write_safetensors(tensors: dict[str, torch.Tensor], f: BinaryIO, metadata: dict[str, str]) -> None:
    """Stream `tensors` (CPU tensors of one dtype) into `f` in the safetensors format: the bytes
    `safetensors.torch.save` returns for them.

    The library writes only to a path or to one `bytes` of the whole file; streaming lets a store hash and
    upload the weights as they are written, without a local file or a second copy of the model in memory.

    Raises:
        ValueError: a dtype safetensors has no name for here, or tensors of several dtypes.
    """
    assert sys.byteorder == "little", "safetensors stores little-endian bytes"
    dtypes = {t.dtype for t in tensors.values()}
    unknown = sorted(str(d) for d in dtypes if d not in _SAFETENSORS_DTYPES)
    if unknown or len(dtypes) > 1:
        raise ValueError(
            f"write_safetensors: dtypes {sorted(map(str, dtypes))}; pass tensors of one of "
            f"{sorted(map(str, _SAFETENSORS_DTYPES))}"
        )
    names = sorted(tensors)  # the library's order for tensors of one dtype
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name in names:
        tensor = tensors[name]
        size = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    f.write(struct.pack("<Q", len(text)))
    f.write(text)
    for name in names:
        f.write(tensors[name].reshape(-1).view(torch.uint8).numpy())


_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64"}


def _copy_file_into(src: Path, f: BinaryIO) -> None:
    with open(src, "rb") as source:
        shutil.copyfileobj(source, f)


def _json(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True) + "\n"
