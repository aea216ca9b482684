"""The loss protocol shared by every trainer: one forward/backward path, losses injected as components.

    out = ModelOutputs(target_logprobs_BL, entropy_BL)
    result = loss(out, micro_batch, global_normalizer)      # LossOutput(loss, metrics)
    result.loss.backward()

Normalisation: `loss.normalizer(micro_batch)` is the micro-batch's share of the denominator (tokens,
sequences, ...); the trainer sums it over the step's micro-batches and data-parallel ranks into
`global_normalizer`, and `__call__` returns its micro-batch *sum* divided by that. Gradients are summed, never
averaged, so the step's gradient does not depend on how the batch is split.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch


@dataclass
class ModelOutputs:
    """What a loss sees of the model: fp32 log p(target) per position, and the next-token entropy (no grad)
    when the loss sets `needs_entropy`."""

    target_logprobs_BL: torch.Tensor
    entropy_BL: torch.Tensor | None = None


@dataclass
class LossOutput:
    """`loss`: scalar, this micro-batch's sum divided by the global normalizer. `metrics`: detached SUMS (or
    maxima, see `Loss.max_reduced_metrics`) that the trainer reduces over micro-batches and ranks."""

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


class Loss(ABC):
    """Base class of every training loss.

    Subclasses implement `normalizer` and `__call__`; they may set `needs_entropy` to receive
    `ModelOutputs.entropy_BL` and override `summarize` (by default the sums are logged as they are).
    """

    needs_entropy: ClassVar[bool] = False
    max_reduced_metrics: ClassVar[frozenset[str]] = frozenset()

    @abstractmethod
    def normalizer(self, batch: Any) -> float:
        """This micro-batch's share of the global denominator (e.g. its number of loss tokens)."""

    @abstractmethod
    def __call__(self, out: ModelOutputs, batch: Any, global_normalizer: float) -> LossOutput:
        """The micro-batch loss sum divided by `global_normalizer`, plus metric sums."""

    def summarize(self, reduced: dict[str, float]) -> dict[str, float]:
        """Logged values from metrics reduced over all micro-batches and ranks of a step or an evaluation."""
        return dict(reduced)


def reduce_metric_dicts(
    per_micro_batch: list[dict[str, torch.Tensor]], max_keys: frozenset[str]
) -> dict[str, torch.Tensor]:
    """Combine per-micro-batch metric dicts: sum, or max for keys in `max_keys`. Keys missing from some
    micro-batches are reduced over the ones that have them."""
    combined: dict[str, torch.Tensor] = {}
    for metrics in per_micro_batch:
        for key, value in metrics.items():
            value = value.detach().float()
            if key not in combined:
                combined[key] = value.clone()
            elif key in max_keys:
                combined[key] = torch.maximum(combined[key], value)
            else:
                combined[key] = combined[key] + value
    return combined
