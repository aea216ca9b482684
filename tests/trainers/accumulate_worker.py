"""One of two torchrun ranks: the same steps with a step's gradients accumulated unsharded (reduced once) and
reduced after every micro-batch. Prints `ACCUMULATE <json>` on rank 0."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from sft_helpers import sft_test_config, tiny_trainer, token_rows

from forge_core.engine import destroy_distributed, init_distributed
from forge_core.engine import engine as engine_module
from forge_core.losses import TokenCrossEntropy
from forge_core.trainers import pad_token_rows


def main() -> None:
    dist = init_distributed("cpu")
    torch.manual_seed(0)
    syncs: list[bool] = []
    original = engine_module.defer_gradient_sync
    engine_module.defer_gradient_sync = lambda model, defer: (syncs.append(defer), original(model, defer))
    # Each rank its own rows: 3 steps of 3 micro-batches.
    batches = [pad_token_rows(token_rows(12, seed=10 * dist.rank + i)) for i in range(3)]
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        cfg = sft_test_config(Path(tmp))
        for accumulate in (True, False):
            trainer = tiny_trainer(cfg)
            runs[f"accumulates_{accumulate}"] = trainer.engine.accumulates_unsharded
            trainer.engine.accumulates_unsharded = accumulate
            initial = trainer.engine.full_state_dict()
            steps = [trainer.train_step(batch.split(4), TokenCrossEntropy()) for batch in batches]
            full = trainer.engine.full_state_dict()
            runs[accumulate] = {"steps": [(m["loss"], m["grad_norm"]) for m in steps], "weights": full,
                                "moved": max((full[k] - initial[k]).abs().max().item() for k in full) if full else 0.0}
    if dist.is_rank0:
        deferred, reduced = runs[True], runs[False]
        record = {
            "built_accumulating": runs["accumulates_True"],
            "syncs": syncs,
            "steps": [deferred["steps"], reduced["steps"]],
            "max_weight_diff": max((deferred["weights"][k] - reduced["weights"][k]).abs().max().item()
                                   for k in reduced["weights"]),
            "moved": deferred["moved"],
        }
        print("ACCUMULATE " + json.dumps(record), flush=True)
    destroy_distributed()


if __name__ == "__main__":
    main()
