"""Parallelism: torchtitan `ParallelDims` for dp_replicate x dp_shard x tp, applied to a meta-device model.

    parallel_dims = build_parallel_dims(cfg.training.parallelism, world_size=2, device_type="cpu")
    parallelize_model(model, parallel_dims, plan)     # TP (GPU) -> activation checkpointing -> compile -> FSDP2

torchtitan's "partial_dtensor" SPMD backend: DTensor for tp only, FSDP2's `fully_shard` for data parallelism.
FSDP is applied over the data-parallel ranks, and on one rank only to cast (a mixed-precision policy, one unit
around the whole model). A single fp32 rank trains the plain module: torchtitan wraps it all the same, but with
nothing to shard or cast FSDP only copies every parameter in and every gradient out each step. Either way the
state dicts, checkpoints and exports name the same tensors, and a checkpoint of one layout resumes the other (DCP
reshards). FSDP never scales gradients (losses divide by the global normalizer themselves): its division is turned
off on N ranks, and on one rank it divides by the world size, 1, which it skips.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn
from torchtitan.distributed import ParallelDims
from torchtitan.distributed import parallel_dims as titan_parallel_dims
from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

from forge_core.config.schema import ParallelismConfig


@dataclass(frozen=True)
class ParallelPlan:
    """How to wrap the model, resolved from TrainingConfig for one device type."""

    device_type: str
    param_dtype: torch.dtype
    activation_checkpoint: bool
    compile: bool
    reshard_after_forward: str  # torchtitan's policy: default, always or never (ParallelismConfig)


def _resolve_degrees(cfg: ParallelismConfig, world_size: int) -> tuple[int, int, int]:
    if cfg.dp_replicate < 1 or cfg.tp < 1:
        raise ValueError(
            f"training.parallelism: dp_replicate={cfg.dp_replicate}, tp={cfg.tp}: both must be >= 1"
        )
    dp_shard = cfg.dp_shard
    if dp_shard == -1:
        dp_shard, rest = divmod(world_size, cfg.dp_replicate * cfg.tp)
        if rest or dp_shard < 1:
            raise ValueError(
                f"training.parallelism: dp_replicate={cfg.dp_replicate} * tp={cfg.tp} does not divide the world "
                f"size {world_size}; choose degrees whose product divides the number of ranks"
            )
    if dp_shard < 1:
        raise ValueError(
            f"training.parallelism.dp_shard={dp_shard}: must be -1 (all remaining ranks) or >= 1"
        )
    if cfg.dp_replicate * dp_shard * cfg.tp != world_size:
        raise ValueError(
            f"training.parallelism: dp_replicate={cfg.dp_replicate} * dp_shard={dp_shard} * tp={cfg.tp} != "
            f"world size {world_size}; set dp_shard=-1 or make the product equal the number of ranks"
        )
    return cfg.dp_replicate, dp_shard, cfg.tp


@contextlib.contextmanager
def _mesh_device_type(device_type: str):
    # torchtitan's build_mesh reads a module-level `device_type` that is "cuda" even on a CPU-only host; pin it
    # while the meshes are built (they keep their device type afterwards).
    saved = titan_parallel_dims.device_type
    titan_parallel_dims.device_type = device_type
    try:
        yield
    finally:
        titan_parallel_dims.device_type = saved


def build_parallel_dims(cfg: ParallelismConfig, world_size: int, device_type: str) -> ParallelDims:
    """Validate the degrees against the world size and build every device mesh on `device_type`."""
    dp_replicate, dp_shard, tp = _resolve_degrees(cfg, world_size)
    if tp > 1 and device_type != "cuda":
        raise ValueError(
            f"training.parallelism.tp={tp}: tensor parallelism needs GPUs (device is {device_type}); "
            "set training.parallelism.tp=1 on CPU"
        )
    parallel_dims = ParallelDims(
        dp_replicate=dp_replicate,
        dp_shard=dp_shard,
        cp=1,
        tp=tp,
        pp=1,
        ep=1,
        world_size=world_size,
        spmd_backend="partial_dtensor",
    )
    with _mesh_device_type(device_type):
        parallel_dims.build_mesh()
    return parallel_dims


def dp_mesh_info(parallel_dims: ParallelDims) -> tuple[int, int]:
    """(data-parallel degree, this rank's index in it): what the sampler shards the global batch by."""
    if not parallel_dims.dp_enabled:
        return 1, 0
    batch_mesh = parallel_dims.get_mesh("batch")
    return batch_mesh.size(), batch_mesh.get_local_rank()


def dp_group(parallel_dims: ParallelDims) -> torch.distributed.ProcessGroup | None:
    """Process group that loss normalizers and metrics are reduced over (None when dp degree is 1)."""
    if not parallel_dims.dp_enabled:
        return None
    return parallel_dims.get_mesh("batch").get_group()


def _apply_tensor_parallel(model: nn.Module, parallel_dims: ParallelDims) -> None:
    # The model config carries torchtitan's sharding declarations (set by `add_tp_sharding` before build);
    # parallelize() turns them into DTensor placements on the tp mesh.
    model.parallelize(parallel_dims)


def _apply_activation_checkpointing(model: nn.Module) -> None:
    from torchtitan.distributed.activation_checkpoint import FullAC

    FullAC.Config().build(dump_folder="").apply(model)


def _apply_compile(model: nn.Module, parallel_dims: ParallelDims) -> None:
    from torchtitan.config import CompileConfig
    from torchtitan.distributed.compile import apply_compile

    apply_compile(model, compile_config=CompileConfig(enable=True), parallel_dims=parallel_dims)


def resolve_reshard_after_forward(choice: str, device_type: str) -> str:
    """torchtitan's reshard-after-forward policy for `training.parallelism.reshard_after_forward` on `device_type`."""
    if choice == "auto":
        return "default" if device_type == "cuda" else "never"
    return choice


def _apply_fsdp(model: nn.Module, parallel_dims: ParallelDims, param_dtype: torch.dtype, reshard: str) -> None:
    names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
    mesh = parallel_dims.get_mesh(names)
    if mesh.size() == 1 and param_dtype == torch.float32:
        return  # nothing to shard or cast
    if mesh.size() == 1:
        _apply_single_rank_fsdp(model, mesh, param_dtype, reshard_after_forward=reshard == "always")
    else:
        apply_fsdp_to_decoder(
            model, mesh, param_dtype=param_dtype, reduce_dtype=torch.float32, pp_enabled=False,
            reshard_after_forward_policy=reshard,
        )
    if mesh.device_type == "cpu":
        _use_sum_reductions(model)


def _apply_single_rank_fsdp(model: nn.Module, mesh, param_dtype: torch.dtype, reshard_after_forward: bool) -> None:
    # With nothing to shard, FSDP is there for its mixed-precision policy, and per-block units would only add
    # overhead: one unit around the whole model casts it. That unit is the output layer's too, which the
    # `default` policy keeps gathered: only `always` reshards it.
    # No gradient divide factor: FSDP then divides by the world size, 1, which it skips, where a factor of 1
    # would cost a division of every gradient by 1.0 into a new buffer each step.
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False
    )
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)


def accumulates_unsharded(model: nn.Module, parallel_dims: ParallelDims, reshard_after_forward: str) -> bool:
    """Whether `model` accumulates a step's gradients in its unsharded parameters until the step's last micro-batch
    (`defer_gradient_sync`): as one FSDP unit on a single data-parallel rank, whose sharded parameters and gradients
    are the whole model's (no memory cost), and on several data-parallel ranks when FSDP keeps the gathered
    parameters through a step (`reshard_after_forward` "never"): every rank then also holds the whole model's
    gradients during the step, which gathers the parameters and reduces the gradients once instead of once per
    micro-batch."""
    from torch.distributed.fsdp import FSDPModule

    units = [module for module in model.modules() if isinstance(module, FSDPModule)]
    if dp_mesh_info(parallel_dims)[0] == 1:
        return units == [model]
    return bool(units) and reshard_after_forward == "never"


def defer_gradient_sync(model: nn.Module, defer: bool) -> None:
    """While `defer`, backward passes leave their gradients in the unsharded parameters (accumulating) and keep
    those parameters for the next forward; the first backward after `defer=False` reduces the sum into the
    sharded gradients once. On one rank this saves FSDP's copy of the parameters and of the gradients on every
    micro-batch but the last, and the sums are the same, added in the same order; on several ranks it saves an
    all-gather and a reduce-scatter of the model per micro-batch but the last, and each rank's micro-batches are
    summed before the ranks' sums (the same sums up to rounding). `model` is a model for which
    `accumulates_unsharded` holds."""
    model.set_requires_gradient_sync(not defer, recurse=True)
    model.set_reshard_after_backward(not defer, recurse=True)


def _use_sum_reductions(model: nn.Module) -> None:
    # FSDP turns gradient_divide_factor=1 into ReduceOp.PREMUL_SUM, which gloo lacks; plain SUM (with the
    # trivial factor applied as a separate scale) gives the same sums.
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


def parallelize_model(model: nn.Module, parallel_dims: ParallelDims, plan: ParallelPlan) -> nn.Module:
    """Apply TP, activation checkpointing, per-block compile and FSDP2 (in torchtitan's order) to a model on
    the meta device. Returns the same module object, wrapped in place."""
    if parallel_dims.tp_enabled:
        _apply_tensor_parallel(model, parallel_dims)
    if plan.activation_checkpoint:
        _apply_activation_checkpointing(model)
    if plan.compile:
        if plan.device_type != "cuda":
            raise ValueError(
                "training.compile=true: torch.compile is enabled on GPU only; set it to false on CPU"
            )
        _apply_compile(model, parallel_dims)
    _apply_fsdp(model, parallel_dims, plan.param_dtype, plan.reshard_after_forward)
    return model


def add_tp_sharding(model_config, family: str, *, sequence_parallel: bool = True) -> None:
    """Attach torchtitan's TP sharding declarations to a model config (needed before build when tp > 1)."""
    if family == "llama3":
        from torchtitan.models.llama3.sharding import set_llama3_sharding_config

        set_llama3_sharding_config(model_config, enable_sp=sequence_parallel)
    elif family in ("qwen2", "qwen3"):  # qwen2 is qwen3's decoder (forge_core.models.flavors.Qwen2Model)
        from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

        set_qwen3_sharding_config(model_config, enable_sp=sequence_parallel, enable_ep=False)
    else:
        raise ValueError(f"model.family={family!r}: no tensor-parallel plan; use tp=1")
