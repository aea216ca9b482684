"""A torchrun worker for tests/engine/test_checkpoint_hashing.py: every rank saves a checkpoint holding a
sharded DTensor and its own RNG state (so every rank writes a shard of its own) into each store given, then
rank 0 prints one JSON line per store: the committed manifest's files, the files hashed again by reading the
shards back (`ArtifactWriter.adopt_existing`), and whether a reload gives back the saved tensor.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/engine/hashed_checkpoint_worker.py \
        file:///tmp/store s3://bucket/root=http://127.0.0.1:5000
"""

from __future__ import annotations

import dataclasses
import json
import sys

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from forge_core.engine import Checkpointer, destroy_distributed, init_distributed
from forge_core.storage import ArtifactWriter, ObjectStore


class ShardedWeight(Stateful):
    def __init__(self, value: torch.Tensor) -> None:
        self.value = value

    def state_dict(self) -> dict:
        return {"w": self.value}

    def load_state_dict(self, state_dict: dict) -> None:
        self.value = state_dict["w"]


def main(store_args: list[str]) -> None:
    dist_ctx = init_distributed("cpu")
    mesh = init_device_mesh("cpu", (dist_ctx.world_size,))
    full = torch.arange(4096 * dist_ctx.world_size, dtype=torch.float32).reshape(dist_ctx.world_size * 64, 64)
    weight = distribute_tensor(full, mesh, [Shard(0)])
    for arg in store_args:
        root, _, endpoint = arg.partition("=")
        store = ObjectStore(root, endpoint_url=endpoint or None)
        output = store.artifact_uri("sft", "hashed")
        checkpointer = Checkpointer(store, output, dist_ctx, stage="sft", config={}, inputs={})
        ref = checkpointer.save(3, {"model": ShardedWeight(weight)}, {"cursor": 3})
        restored = ShardedWeight(distribute_tensor(torch.zeros_like(full), mesh, [Shard(0)]))
        resume = checkpointer.load_latest({"model": restored})
        reloaded = restored.value.full_tensor()
        if dist_ctx.is_rank0:
            manifest = store.read_manifest(ref.uri)
            after = ArtifactWriter(store, ref.uri, kind="checkpoint", stage="sft", attempt=manifest.attempt)
            after.adopt_existing()
            record = {
                "store": root,
                "while_writing": {rel: dataclasses.asdict(e) for rel, e in manifest.files.items()},
                "after": {rel: dataclasses.asdict(e) for rel, e in after.files.items()},
                "resumed_step": resume.step,
                "reloaded_equal": bool(torch.equal(reloaded, full)),
            }
            print("HASHED " + json.dumps(record), flush=True)
    destroy_distributed()


if __name__ == "__main__":
    main(sys.argv[1:])
