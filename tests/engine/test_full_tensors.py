"""`full_tensors` gathers a model's DTensors whole, bitwise as `full_tensor()` does, with one all-gather per
bucket of FSDP's row-sharded tensors instead of one per tensor: two torchrun ranks, uneven and empty shards,
mixed dtypes, and tensors it leaves to `full_tensor()` (replicated, column-sharded) or passes through (plain)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.two_ranks import torchrun_two_ranks

WORKER = Path(__file__).with_name("full_tensors_worker.py")


def test_two_ranks_gather_every_tensor_bitwise_with_one_all_gather_per_bucket():
    result = torchrun_two_ranks(str(WORKER))
    assert result.returncode == 0, result.stderr[-4000:]
    record = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("FULL ")).split(" ", 1)[1])
    names = ["uneven", "one_row", "bf16", "vector", "replicated", "columns", "plain", "big", "after_big", "fp16"]
    assert record["names"] == names  # the items' order, whatever way each was gathered
    for name, check in record["checks"].items():
        assert check["equal"], (name, check)
        assert check["own_memory"], (name, check)
    assert record["checks"]["uneven"]["shape"] == [5, 3] and record["checks"]["one_row"]["shape"] == [1, 4]
    # Row-sharded runs: [uneven, one_row, bf16, vector] until the replicated one, [big] (over the bucket alone),
    # [after_big, fp16]; the replicated and column-sharded tensors go through full_tensor().
    assert record["gathers"] == 3, record
