"""Optimizer helpers: the current LR and DTensor-aware gradient clipping. AdamW and its LR schedule are built
by their config section:

    optimizers, schedulers = cfg.sft.optimizer.build(model, device_type="cpu", total_steps=cfg.sft.steps)
"""

from __future__ import annotations

import torch
from torch import nn
from torchtitan.components.optimizer import OptimizersContainer


def current_lr(optimizers: OptimizersContainer) -> float:
    return float(optimizers.optimizers[0].param_groups[0]["lr"])


@torch.no_grad()
def clip_gradients(model: nn.Module, max_norm: float) -> float:
    """Clip the total gradient norm over every rank's shards and return it before clipping; `max_norm <= 0`
    only reports it."""
    from torchtitan.distributed.utils import clip_grad_norm_

    limit = max_norm if max_norm > 0 else float("inf")
    total = clip_grad_norm_([p for p in model.parameters() if p.grad is not None], limit, foreach=True)
    return float(total.item())
