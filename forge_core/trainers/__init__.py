"""Trainers: `TitanTrainer` (the machinery shared by every stage) and `SFTTrainer`; GRPO's trainer is
`forge_core.trainers.grpo`.
"""

from forge_core.batch import TokenBatch, pad_token_rows
from forge_core.trainers.base import ArtifactContext, TitanTrainer
from forge_core.trainers.sft import SFTData, SFTSummary, SFTTrainer

__all__ = ["ArtifactContext", "SFTData", "SFTSummary", "SFTTrainer", "TitanTrainer", "TokenBatch", "pad_token_rows"]
