"""Names of the model families and flavors forgeflow builds, kept apart from their builders
(forge_core.models.flavors) so validating a config never imports torch.

    from forge_core.config.catalog import FLAVORS, flavor_errors
    flavor_errors("llama3", "tiny")   # -> [] ; an unknown name -> ["model.flavor='x': ... valid flavors: [...]"]
"""

from __future__ import annotations

FAMILIES: tuple[str, ...] = ("llama3", "qwen2", "qwen3")

# `model.flavor: auto`: the checkpoint's own architecture (model.hf_path's config.json, any size); without a
# checkpoint (a from-scratch run), the family's `tiny` CPU flavor.
AUTO_FLAVOR = "auto"
FROM_SCRATCH_FLAVOR = "tiny"

# forgeflow's CPU flavors (see forge_core.models.flavors for their sizes).
FORGE_FLAVORS: dict[str, tuple[str, ...]] = {
    "llama3": ("tiny", "small", "medium"),
    "qwen2": ("tiny",),
    "qwen3": ("tiny", "small", "medium"),
}

# torchtitan 0.3.0's dense registry flavors (real sizes, meant for GPU). qwen3's MoE flavors are left out: their
# HF export needs Qwen3MoeConfig and expert splitting, which forgeflow does not handle.
TITAN_FLAVORS: dict[str, tuple[str, ...]] = {
    "llama3": ("debugmodel", "1B", "3B", "8B", "70B", "405B"),
    "qwen2": (),  # torchtitan has no qwen2 registry: real Qwen2.5 sizes come from their config.json (auto)
    "qwen3": ("debugmodel", "0.6B", "1.7B", "4B", "8B", "14B", "32B"),
}

FLAVORS: dict[str, tuple[str, ...]] = {
    family: FORGE_FLAVORS[family] + TITAN_FLAVORS[family] for family in FAMILIES
}


def flavor_errors(family: str, flavor: str) -> list[str]:
    """Config-style messages for an unknown family or flavor (empty when both are valid)."""
    if family not in FLAVORS:
        return [f"model.family={family!r}: unknown model family; valid families: {list(FAMILIES)}"]
    if flavor != AUTO_FLAVOR and flavor not in FLAVORS[family]:
        message = (
            f"model.flavor={flavor!r}: unknown flavor for model.family={family!r}; valid flavors: "
            f"{list(FLAVORS[family])}, or {AUTO_FLAVOR!r} for the architecture of model.hf_path's config.json"
        )
        return [message]
    return []


def validate_flavor(family: str, flavor: str) -> None:
    """Raise ValueError naming the valid choices when `family`/`flavor` is unknown."""
    errors = flavor_errors(family, flavor)
    if errors:
        raise ValueError(errors[0])
