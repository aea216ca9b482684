"""The batch types trainers build and losses consume: `TokenBatch` (next-token rows) and GRPO's `RLBatch` with
the split of one rollout batch into optimizer steps. Pure torch, below losses and trainers.

    from forge_core.batch import RLBatch, TokenBatch, pad_token_rows, plan_minibatches
"""

from forge_core.batch.rl import MiniBatchStep, RLBatch, plan_minibatches
from forge_core.batch.tokens import TokenBatch, next_token_batch, pad_token_rows

__all__ = ["MiniBatchStep", "RLBatch", "TokenBatch", "next_token_batch", "pad_token_rows", "plan_minibatches"]
