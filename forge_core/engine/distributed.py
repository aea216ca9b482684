"""Device and process-group setup: one code path for a plain `python` process (world size 1) and for N ranks
under torchrun (or any launcher that sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT).

    dist_ctx = init_distributed("auto")        # CUDA + NCCL when a GPU is usable, else CPU + gloo (logged why)
    total = all_reduce_sum(3.0, engine.dp_group, dist_ctx.device)

Not `torchtitan.tools.utils.device_type`/`device_module`: on a CPU-only host they fall back to "cuda".
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from forge_core.engine.preflight import HostDevices
from forge_core.launch.spec import DEADLINE_ENV
from forge_core.timings import DEFAULT_PROCESS_GROUP_TIMEOUT_S, PROCESS_GROUP_TIMEOUT_MARGIN_S

log = logging.getLogger(__name__)

DeviceChoice = Literal["auto", "cpu", "cuda"]
T = TypeVar("T")

_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class DistContext:
    """Where this process runs: its global rank, the world size, and its compute device."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0

    @property
    def device_type(self) -> str:
        return self.device.type


def resolve_device_type(choice: DeviceChoice) -> str:
    """ "auto" -> "cuda" when a GPU is usable, else "cpu" (logged with the reason on every rank). Raises
    ValueError for an unknown choice, or "cuda" without a usable GPU."""
    if choice not in ("auto", "cpu", "cuda"):
        raise ValueError(f"training.device={choice!r}: unknown; use 'auto', 'cpu' or 'cuda'")
    if choice == "cpu":
        return "cpu"
    unusable = HostDevices.probe().gpu_unusable_reason()
    if choice == "cuda" and unusable is not None:
        raise ValueError(f"training.device='cuda' asks for a GPU, but {unusable}; or set training.device=cpu")
    if choice == "auto":
        rank = os.environ.get("RANK", "0")
        if unusable is None:
            log.info(
                "rank %s: training.device=auto chose cuda: torch %s (CUDA %s) sees %d device(s), "
                "CUDA_VISIBLE_DEVICES=%s",
                rank, torch.__version__, torch.version.cuda, torch.cuda.device_count(),
                os.environ.get("CUDA_VISIBLE_DEVICES", "(unset)"),
            )  # fmt: skip
        else:
            log.info("rank %s: training.device=auto chose cpu: %s", rank, unusable)
    return "cpu" if unusable is not None else "cuda"


def cuda_device_for(local_rank: int) -> torch.device:
    """This rank's GPU, one per local rank. Raises ValueError when the node sees too few devices (sharing one
    would fail later inside NCCL with an error that names neither setting)."""
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise ValueError(
            f"LOCAL_RANK={local_rank}: this node sees {count} CUDA device(s) (CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')}); launch.<stage>.nproc_per_node must not exceed "
            "the GPUs visible to the stage"
        )
    return torch.device("cuda", local_rank)


def _launched_by_torchrun() -> bool:
    return all(name in os.environ for name in _TORCHRUN_ENV)


def _backend_for(device_type: str) -> str:
    # On GPU, CPU tensors still need a backend (object collectives, DCP planning): gloo serves those.
    return "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"


# Whether the default process group was created by init_distributed (and so is destroy_distributed's to end).
_group_created_here = False


def process_group_timeout_s() -> float:
    """How long a collective waits for a missing peer: the launch's deadline (FORGE_LAUNCH_DEADLINE_S) plus
    PROCESS_GROUP_TIMEOUT_MARGIN_S, else DEFAULT_PROCESS_GROUP_TIMEOUT_S.

    Longer than the deadline so that, for a hung rank, the launcher's deadline fires first and names the rank
    from its heartbeats, rather than a bare collective timeout on its peers."""
    deadline = os.environ.get(DEADLINE_ENV)
    if not deadline:
        return DEFAULT_PROCESS_GROUP_TIMEOUT_S
    try:
        return float(deadline) + PROCESS_GROUP_TIMEOUT_MARGIN_S
    except ValueError:
        raise ValueError(
            f"{DEADLINE_ENV}={deadline!r}: not a number of seconds; it is set by forge_core.launch from "
            "launch.<stage>.deadline_s, unset it when starting a worker by hand"
        ) from None


def init_distributed(device: DeviceChoice = "auto", timeout_s: float | None = None) -> DistContext:
    """Initialise the default process group once per process and return this rank's `DistContext`.

    Under torchrun the env:// rendezvous is used; a plain process becomes a world of size 1 over an in-memory
    store (no port, no network). Calling it again returns the context of the existing group. `timeout_s`
    defaults to `process_group_timeout_s()`.
    """
    device_type = resolve_device_type(device)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cuda":
        torch_device = cuda_device_for(local_rank)
        torch.cuda.set_device(torch_device)
    else:
        torch_device = torch.device("cpu")

    global _group_created_here
    if not dist.is_initialized():
        _group_created_here = True
        timeout = timedelta(seconds=process_group_timeout_s() if timeout_s is None else timeout_s)
        _default_timeout_for_new_groups(timeout)
        if _launched_by_torchrun():
            dist.init_process_group(backend=_backend_for(device_type), timeout=timeout)
        else:
            dist.init_process_group(
                backend=_backend_for(device_type),
                store=dist.HashStore(),
                rank=0,
                world_size=1,
                timeout=timeout,
            )
    return DistContext(
        rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank, device=torch_device
    )


def _default_timeout_for_new_groups(timeout: timedelta) -> None:
    """Make `timeout` the default of every process group this process creates later, NCCL's included.

    Groups created without a timeout (torchtitan's device-mesh dimensions, e.g. HSDP or TP x FSDP) read
    torch's defaults from these module globals; left alone, a hang there could hit NCCL's watchdog before the
    launch deadline names the hung rank."""
    c10d = dist.distributed_c10d
    c10d.default_pg_timeout = timeout
    if c10d.default_pg_nccl_timeout is not None:  # None when torch is built without NCCL (CPU wheels)
        c10d.default_pg_nccl_timeout = timeout


def destroy_distributed() -> None:
    """Tear down the default process group if `init_distributed` created it; a group someone else created
    (e.g. an in-process vLLM engine) is theirs to destroy."""
    global _group_created_here
    if _group_created_here and dist.is_initialized():
        dist.destroy_process_group()
    _group_created_here = False


def new_gloo_group() -> dist.ProcessGroup:
    """Collective: a gloo process group of every rank, for collectives on host memory that run on a thread of
    their own beside the default group's (a checkpoint written behind a stage's commit)."""
    return dist.new_group(backend="gloo")


def barrier(group: dist.ProcessGroup | None = None) -> None:
    """Collective over `group` (None = the default group)."""
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.barrier(group=group)


def all_reduce_sum(value: float, group: dist.ProcessGroup | None, device: torch.device) -> float:
    """Sum a Python float over `group` (None = no reduction: the group is a single rank)."""
    if group is None:
        return float(value)
    tensor = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return float(tensor.item())


def all_reduce_tensors(
    values: dict[str, torch.Tensor], max_keys: frozenset[str], group: dist.ProcessGroup | None
) -> dict[str, torch.Tensor]:
    """Reduce a dict of scalar tensors over `group`: SUM, or MAX for keys in `max_keys` (two collectives at
    most)."""
    if group is None or not values:
        return dict(values)
    out: dict[str, torch.Tensor] = {}
    for op, keys in (
        (dist.ReduceOp.SUM, [k for k in values if k not in max_keys]),
        (dist.ReduceOp.MAX, [k for k in values if k in max_keys]),
    ):
        if not keys:
            continue
        stacked = torch.stack([values[k].detach().float().reshape(()) for k in keys])
        dist.all_reduce(stacked, op=op, group=group)
        out.update({k: stacked[i] for i, k in enumerate(keys)})
    return out


def run_on_rank0(fn: Callable[[], T], dist_ctx: DistContext) -> T | None:
    """Run `fn` on rank 0 only; other ranks get None. An exception on rank 0 is re-raised on every rank (same
    type when it is a ValueError, else RuntimeError), so no rank waits forever in a later collective."""
    result, error = None, None
    if dist_ctx.is_rank0:
        try:
            result = fn()
        except Exception as exc:  # noqa: BLE001 - re-raised below, on every rank
            error = exc
    failure = broadcast_object(None if error is None else (isinstance(error, ValueError), str(error)))
    if error is not None:
        raise error
    if failure is not None:
        is_value_error, message = failure
        raise (ValueError if is_value_error else RuntimeError)(f"rank 0 failed: {message}")
    return result


def gather_objects(obj: T, group: dist.ProcessGroup | None = None) -> list[T] | None:
    """Collective over `group` (None = the default group): every rank's picklable `obj`, in rank order, on the
    group's rank 0; None on the other ranks."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [obj]
    size = dist.get_world_size(group)
    gathered: list[T] | None = [None] * size if dist.get_rank(group) == 0 else None
    dist.gather_object(obj, gathered, group=group, group_dst=0)
    return gathered


def broadcast_object(obj: object, src: int = 0, group: dist.ProcessGroup | None = None) -> object:
    """Send a picklable object from the rank `src` of `group` (None = the default group) to each of its ranks
    (identity in a world of one)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, group=group, group_src=src)
    return holder[0]


# Full tensors per all-gather in `full_tensors`: one collective per parameter is latency-bound (gloo, or peers
# that share cores), while a bucket stays small next to the model it gathers.
GATHER_BUCKET_BYTES = 32 << 20


def full_tensors(
    items: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = GATHER_BUCKET_BYTES
) -> Iterator[tuple[str, torch.Tensor]]:
    """Collective: each (name, tensor) of `items`, in order, whole: a DTensor gathered (every rank of its mesh
    iterates the same items), any other tensor as it is.

    Consecutive DTensors sharded along dim 0 of the same 1-D mesh (FSDP's layout) are gathered together, one
    all-gather per run of at most `bucket_bytes` of full tensors (a larger tensor alone); any other DTensor by
    `full_tensor()`. Either way a gathered tensor is new memory, never a view of the sharded one.
    """
    run: list[tuple[str, DTensor]] = []
    run_bytes = 0
    for name, value in items:
        if run and (not _gathers_with(run[-1][1], value) or run_bytes + _full_bytes(value) > bucket_bytes):
            yield from _gathered_together(run)
            run, run_bytes = [], 0
        if _row_sharded(value):
            run.append((name, value))
            run_bytes += _full_bytes(value)
        elif isinstance(value, DTensor):
            yield name, _new_memory(value.full_tensor(), value.to_local())
        else:
            yield name, value
    yield from _gathered_together(run)


def _new_memory(full: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`full`, copied when it is the rank's own shard (a replicated DTensor's full tensor is)."""
    return full.clone() if full.untyped_storage().data_ptr() == local.untyped_storage().data_ptr() else full


def _row_sharded(value: torch.Tensor) -> bool:
    return (
        isinstance(value, DTensor)
        and value.device_mesh.ndim == 1
        and value.ndim > 0
        and len(value.placements) == 1
        and type(value.placements[0]) is Shard
        and value.placements[0].dim == 0
    )


def _gathers_with(previous: DTensor, value: torch.Tensor) -> bool:
    return _row_sharded(value) and value.device_mesh == previous.device_mesh


def _full_bytes(value: torch.Tensor) -> int:
    return value.numel() * value.element_size()


def _rows_of_ranks(rows: int, ranks: int) -> list[int]:
    """Dim-0 rows each rank of a Shard(0) placement holds (torch.chunk's split: the last ranks may hold fewer,
    or none)."""
    chunk = -(-rows // ranks)
    return [max(0, min(chunk, rows - rank * chunk)) for rank in range(ranks)]


def _gathered_together(run: list[tuple[str, DTensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """One all-gather of the local shards of `run` (as bytes, so dtypes may differ), cut back into full tensors."""
    if not run:
        return
    mesh = run[0][1].device_mesh
    ranks, me = mesh.size(), mesh.get_local_rank()
    # pieces[k][r]: the bytes rank r holds of tensor k
    pieces = []
    for _, value in run:
        row_bytes = _full_bytes(value) // value.shape[0] if value.shape[0] else 0
        pieces.append([rows * row_bytes for rows in _rows_of_ranks(value.shape[0], ranks)])
    per_rank = [sum(sizes[rank] for sizes in pieces) for rank in range(ranks)]
    width = max(per_rank)
    device = run[0][1].device
    send = torch.empty(width, dtype=torch.uint8, device=device)
    offset = 0
    for (_, value), sizes in zip(run, pieces, strict=True):
        local = value.to_local().contiguous().view(-1).view(torch.uint8)
        assert local.numel() == sizes[me], f"local shard of {tuple(value.shape)}: {local.numel()} bytes, not {sizes[me]}"
        send[offset : offset + sizes[me]].copy_(local)
        offset += sizes[me]
    received = torch.empty(ranks * width, dtype=torch.uint8, device=device)
    dist.all_gather_into_tensor(received, send, group=mesh.get_group())
    read = [rank * width for rank in range(ranks)]
    for (name, value), sizes in zip(run, pieces, strict=True):
        full = torch.empty(value.shape, dtype=value.dtype, device=device)
        out = full.view(-1).view(torch.uint8)
        written = 0
        for rank, size in enumerate(sizes):
            out[written : written + size].copy_(received[read[rank] : read[rank] + size])
            written += size
            read[rank] += size
        yield name, full
