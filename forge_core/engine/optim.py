"""AdamW and its learning-rate schedule, on torchtitan's optimizer and scheduler containers.

    optimizers = build_optimizer(model, cfg.sft.optimizer, device_type="cpu")
    schedulers = build_lr_schedule(optimizers, cfg.sft.optimizer, total_steps=cfg.sft.steps)

The schedule is linear warmup for `warmup_steps`, then `decay` ("cosine", "linear" or "constant") down to
`min_lr_ratio * lr` at `total_steps`. The containers are `Stateful`, so DCP checkpoints them directly.
"""

from __future__ import annotations

import torch
from torch import nn
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer, ParamGroupConfig

from forge_core.config.schema import OptimizerConfig


def _implementation(device_type: str) -> str:
    # Fused AdamW has CPU and CUDA kernels in torch 2.13 and accepts FSDP's DTensor parameters.
    return "fused" if device_type in ("cpu", "cuda") else "foreach"


def build_optimizer(model: nn.Module, cfg: OptimizerConfig, device_type: str) -> OptimizersContainer:
    """One AdamW over every trainable parameter (call after parallelize + materialisation)."""
    config = OptimizersContainer.Config(
        param_groups=[
            ParamGroupConfig(
                pattern=r".*",
                optimizer_name="AdamW",
                optimizer_kwargs={
                    "lr": cfg.lr,
                    "betas": (cfg.beta1, cfg.beta2),
                    "eps": cfg.eps,
                    "weight_decay": cfg.weight_decay,
                },
            )
        ],
        implementation=_implementation(device_type),
    )
    return config.build(model_parts=[model])


def build_lr_schedule(
    optimizers: OptimizersContainer, cfg: OptimizerConfig, total_steps: int
) -> LRSchedulersContainer:
    """Warmup + decay schedule stepped once per optimizer step."""
    if total_steps < 1:
        raise ValueError(f"total_steps={total_steps}: the LR schedule needs at least one step")
    warmup = min(cfg.warmup_steps, total_steps)
    config = LRSchedulersContainer.Config(
        warmup_steps=warmup,
        total_steps=total_steps,
        # decay_ratio=0 keeps the LR flat after warmup; None decays over all post-warmup steps.
        decay_ratio=0.0 if cfg.decay == "constant" else None,
        decay_type="linear" if cfg.decay == "constant" else cfg.decay,
        min_lr_factor=cfg.min_lr_ratio,
    )
    return config.build(optimizers=optimizers, training_steps=total_steps)


def current_lr(optimizers: OptimizersContainer) -> float:
    return float(optimizers.optimizers[0].param_groups[0]["lr"])


@torch.no_grad()
def clip_gradients(model: nn.Module, max_norm: float) -> float:
    """Clip the total gradient norm over every rank's shards (DTensor-aware) and return it before clipping.

    `max_norm <= 0` disables clipping but still reports the norm."""
    from torchtitan.distributed.utils import clip_grad_norm_

    limit = max_norm if max_norm > 0 else float("inf")
    total = clip_grad_norm_([p for p in model.parameters() if p.grad is not None], limit, foreach=True)
    return float(total.item())
