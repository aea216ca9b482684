"""The batch types trainers build and losses consume: `TokenBatch` (next-token rows, `tokens.py`) and GRPO's
`RLBatch` with the split of one rollout batch into optimizer steps (`rl.py`). Pure torch, below losses and
trainers (tests/test_import_layers.py).

    from forge_core.batch import RLBatch, TokenBatch, pad_token_rows, plan_minibatches
"""

from forge_core.batch.rl import MiniBatchStep, RLBatch, plan_minibatches
from forge_core.batch.tokens import TokenBatch, pad_token_rows

__all__ = ["MiniBatchStep", "RLBatch", "TokenBatch", "pad_token_rows", "plan_minibatches"]
