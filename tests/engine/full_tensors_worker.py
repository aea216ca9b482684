"""A torchrun worker for tests/engine/test_full_tensors.py: every rank gathers the same mix of DTensors and
plain tensors with `full_tensors` (a small bucket, so the row-sharded ones take several all-gathers), and rank 0
prints one JSON line: per tensor, whether it equals `full_tensor()` bitwise (dtype and shape included) and
shares no memory with the rank's shard; the order of the names; and the all-gathers `full_tensors` issued.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/engine/full_tensors_worker.py
"""

from __future__ import annotations

import json

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from forge_core.engine import destroy_distributed, init_distributed
from forge_core.engine import distributed as distributed_module

BUCKET_BYTES = 64 << 10


def tensors(mesh) -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)

    def rand(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=generator).to(dtype)

    row = [Shard(0)]
    return [
        ("uneven", distribute_tensor(rand(5, 3), mesh, row)),  # 3 rows on rank 0, 2 on rank 1
        ("one_row", distribute_tensor(rand(1, 4), mesh, row)),  # none on rank 1
        ("bf16", distribute_tensor(rand(6, 2, dtype=torch.bfloat16), mesh, row)),
        ("vector", distribute_tensor(rand(7), mesh, row)),
        ("replicated", distribute_tensor(rand(3, 3), mesh, [Replicate()])),
        ("columns", distribute_tensor(rand(4, 6), mesh, [Shard(1)])),
        ("plain", rand(2, 2)),
        ("big", distribute_tensor(rand(64, 1024), mesh, row)),  # 256 KiB: more than a bucket, gathered alone
        ("after_big", distribute_tensor(rand(9, 5), mesh, row)),
        ("fp16", distribute_tensor(rand(3, 8, dtype=torch.float16), mesh, row)),
    ]


def main() -> None:
    dist_ctx = init_distributed("cpu")
    mesh = init_device_mesh("cpu", (dist_ctx.world_size,))
    items = tensors(mesh)
    gathers = []
    real = distributed_module.dist.all_gather_into_tensor

    def counted(output, tensor, group=None):
        gathers.append(tensor.numel())
        return real(output, tensor, group=group)

    distributed_module.dist.all_gather_into_tensor = counted
    out = list(distributed_module.full_tensors(items, bucket_bytes=BUCKET_BYTES))
    distributed_module.dist.all_gather_into_tensor = real
    expected = {name: value.full_tensor() if hasattr(value, "full_tensor") else value for name, value in items}
    checks = {}
    for (name, value), (_, full) in zip(items, out, strict=True):
        local = value.to_local() if hasattr(value, "to_local") else None
        checks[name] = {
            "equal": bool(torch.equal(full, expected[name])) and full.dtype == expected[name].dtype,
            "shape": list(full.shape),
            "own_memory": local is None or full.untyped_storage().data_ptr() != local.untyped_storage().data_ptr(),
        }
    if dist_ctx.is_rank0:
        print("FULL " + json.dumps({"names": [name for name, _ in out], "checks": checks, "gathers": len(gathers)}))
    destroy_distributed()


if __name__ == "__main__":
    main()
