"""The training engine: device + process group, ParallelDims, model build + parallelize, AdamW + LR schedule,
gradient clipping, DCP checkpoints to the object store.

    from forge_core.engine import Engine
    engine = Engine.Config.from_run_config(cfg, vocab_size, cfg.sft.optimizer, cfg.sft.steps).build()
"""

from forge_core.engine.checkpoint import (
    CHECKPOINT_KIND,
    CheckpointCorrupted,
    Checkpointer,
    CheckpointRef,
    ModelState,
    ResumeState,
    checkpoint_uri,
    committed_checkpoints,
    latest_committed_checkpoint,
    prune_checkpoints,
    verify_checkpoint,
)
from forge_core.engine.distributed import (
    DistContext,
    all_reduce_sum,
    all_reduce_tensors,
    barrier,
    broadcast_object,
    destroy_distributed,
    init_distributed,
)
from forge_core.engine.engine import Engine, resolve_param_dtype
from forge_core.engine.parallel import ParallelPlan, build_parallel_dims, parallelize_model

__all__ = [
    "CHECKPOINT_KIND",
    "CheckpointCorrupted",
    "CheckpointRef",
    "Checkpointer",
    "DistContext",
    "Engine",
    "ModelState",
    "ParallelPlan",
    "ResumeState",
    "all_reduce_sum",
    "all_reduce_tensors",
    "barrier",
    "broadcast_object",
    "build_parallel_dims",
    "checkpoint_uri",
    "committed_checkpoints",
    "destroy_distributed",
    "init_distributed",
    "latest_committed_checkpoint",
    "parallelize_model",
    "prune_checkpoints",
    "resolve_param_dtype",
    "verify_checkpoint",
]
