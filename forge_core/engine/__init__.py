"""The training engine: device + process group, ParallelDims, model build + parallelize, AdamW + LR schedule,
gradient clipping, DCP checkpoints to the object store.

    from forge_core.engine import Engine
    engine = Engine.Config.from_run_config(cfg, vocab_size, cfg.sft.optimizer, cfg.sft.steps).build()

The names below load on first use, so importing a light submodule (`forge_core.engine.preflight`) does not
import torch and torchtitan.
"""

import importlib

_SUBMODULE_OF = {
    **dict.fromkeys(
        (
            "CHECKPOINT_KIND",
            "CheckpointCorrupted",
            "Checkpointer",
            "CheckpointRef",
            "PendingSave",
            "ModelState",
            "ResumeState",
            "checkpoint_uri",
            "committed_checkpoints",
            "latest_committed_checkpoint",
            "load_components",
            "prune_checkpoints",
            "verify_checkpoint",
        ),
        "checkpoint",
    ),
    **dict.fromkeys(
        (
            "DistContext",
            "all_reduce_sum",
            "all_reduce_tensors",
            "barrier",
            "broadcast_object",
            "destroy_distributed",
            "init_distributed",
            "new_gloo_group",
        ),
        "distributed",
    ),
    **dict.fromkeys(("Engine", "resolve_param_dtype"), "engine"),
    **dict.fromkeys(("ParallelPlan", "build_parallel_dims", "parallelize_model"), "parallel"),
}

__all__ = list(_SUBMODULE_OF)


def __getattr__(name: str):
    submodule = _SUBMODULE_OF.get(name)
    if submodule is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{submodule}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
