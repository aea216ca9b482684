"""Trainers: `TitanTrainer` (shared machinery: one forward/backward path with injected losses, optimizer step,
evaluation, log-probs, checkpoints, export) and `SFTTrainer` (data, loop, eval, resume for the SFT stage).
GRPO's trainer (`forge_core.trainers.grpo`) subclasses TitanTrainer the same way.
"""

from forge_core.batch import TokenBatch, pad_token_rows
from forge_core.trainers.base import ArtifactContext, TitanTrainer
from forge_core.trainers.sft import SFTData, SFTSummary, SFTTrainer

__all__ = ["ArtifactContext", "SFTData", "SFTSummary", "SFTTrainer", "TitanTrainer", "TokenBatch", "pad_token_rows"]
