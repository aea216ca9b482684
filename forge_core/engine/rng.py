"""Seeding and per-rank RNG state capture, so a resumed run draws exactly what an uninterrupted one would."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int, rank: int) -> None:
    """Seed python, numpy and torch (CPU + current CUDA device) with `seed + rank`: ranks draw different
    streams (e.g. dropout), runs with the same seed draw the same ones."""
    rank_seed = seed + rank
    random.seed(rank_seed)
    np.random.seed(rank_seed % 2**32)
    torch.manual_seed(rank_seed)


def capture_rng_state(device: torch.device) -> dict[str, Any]:
    """Every generator this process may draw from, as plain picklable values."""
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch_cpu": torch.get_rng_state(),
    }
    if device.type == "cuda":
        state["torch_cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng_state(state: dict[str, Any], device: torch.device) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch_cpu"])
    if device.type == "cuda" and "torch_cuda" in state:
        torch.cuda.set_rng_state(state["torch_cuda"], device)
