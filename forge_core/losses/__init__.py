"""Training losses behind one protocol (`forge_core.losses.base`).

    from forge_core.losses import TokenCrossEntropy
    metrics = trainer.train_step(batch.split(micro_batch_size), TokenCrossEntropy())
"""

from forge_core.losses.base import Loss, LossOutput, ModelOutputs, reduce_metric_dicts
from forge_core.losses.cross_entropy import TokenCrossEntropy

__all__ = ["Loss", "LossOutput", "ModelOutputs", "TokenCrossEntropy", "reduce_metric_dicts"]
