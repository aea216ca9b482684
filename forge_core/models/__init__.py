"""Model specs on torchtitan 0.3.0 and HF <-> torchtitan weight conversion.

    model = build_model(cfg.model, vocab_size, device="meta", attention=attention_for_device("cpu"))
    init_weights(model, seed=cfg.seed, device="cpu")
    logp_BL = model_logprobs(model, input_ids_BL, target_ids_BL)

Families: llama3 (HF `llama`), qwen2, qwen3; `FLAVORS[family]` lists the registered flavors. Names are
imported lazily, so importing the package does not pull in torch (see forge_core.models.hf for HF folders).
"""



from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# public name -> submodule that defines it (a dotted name: a module outside this package)
_EXPORTS = {
    "FAMILIES": "forge_core.config.catalog",
    "FLAVORS": "forge_core.config.catalog",
    "flavor_errors": "forge_core.config.catalog",
    "validate_flavor": "forge_core.config.catalog",
    "ATTENTION_BACKENDS": "flavors",
    "AttentionBackend": "flavors",
    "attention_backend_of": "flavors",
    "attention_choice": "flavors",
    "attention_for_device": "flavors",
    "build_model_config": "flavors",
    "Architecture": "architecture",
    "architecture_of_hf_config": "architecture",
    "read_hf_info": "hf",
    "build_model": "build",
    "flops_per_token": "build",
    "init_buffers": "build",
    "init_weights": "build",
    "num_params": "build",
    "HFModelInfo": "hf",
    "hf_config_dict": "hf",
    "hf_folder_files": "hf",
    "hf_to_titan_state_dict": "hf",
    "load_hf_folder": "hf",
    "titan_to_hf_state_dict": "hf",
    "write_hf_folder": "hf",
    "forward_logits": "logprobs",
    "length_bucket": "logprobs",
    "model_logprobs": "logprobs",
    "on_positions": "logprobs",
    "token_entropy": "logprobs",
    "token_logprobs": "logprobs",
}

__all__ = [
    "ATTENTION_BACKENDS",
    "FAMILIES",
    "FLAVORS",
    "Architecture",
    "AttentionBackend",
    "HFModelInfo",
    "architecture_of_hf_config",
    "attention_backend_of",
    "attention_choice",
    "attention_for_device",
    "build_model",
    "build_model_config",
    "flavor_errors",
    "flops_per_token",
    "forward_logits",
    "hf_config_dict",
    "hf_folder_files",
    "hf_to_titan_state_dict",
    "init_buffers",
    "init_weights",
    "length_bucket",
    "load_hf_folder",
    "model_logprobs",
    "num_params",
    "on_positions",
    "read_hf_info",
    "titan_to_hf_state_dict",
    "token_entropy",
    "token_logprobs",
    "validate_flavor",
    "write_hf_folder",
]

if TYPE_CHECKING:
    from forge_core.config.catalog import FAMILIES, FLAVORS, flavor_errors, validate_flavor
    from forge_core.models.architecture import Architecture, architecture_of_hf_config
    from forge_core.models.build import build_model, flops_per_token, init_buffers, init_weights, num_params
    from forge_core.models.flavors import (
        ATTENTION_BACKENDS,
        AttentionBackend,
        attention_backend_of,
        attention_choice,
        attention_for_device,
        build_model_config,
    )
    from forge_core.models.hf import (
        HFModelInfo,
        hf_config_dict,
        hf_folder_files,
        hf_to_titan_state_dict,
        load_hf_folder,
        read_hf_info,
        titan_to_hf_state_dict,
        write_hf_folder,
    )
    from forge_core.models.logprobs import (
        forward_logits,
        length_bucket,
        model_logprobs,
        on_positions,
        token_entropy,
        token_logprobs,
    )


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'forge_core.models' has no attribute {name!r}")
    module = _EXPORTS[name] if "." in _EXPORTS[name] else f"forge_core.models.{_EXPORTS[name]}"
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
