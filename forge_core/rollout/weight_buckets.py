"""The bytes of a weight transfer from a trainer rank to vLLM engines, without importing vLLM.

Both ends of a group share what is here: the bucket plan, the gloo group, and the two ways a bucket travels
(`GroupBuckets`, `SharedMemoryBuckets`). The trainer's end, `BucketSender`, lives here too, so a trainer rank
sends weights without importing vLLM (seconds on a CPU). forge_core.rollout.weight_transfer puts the engine's end
and vLLM's registration (its `gloo` backend) on top.

A group is one sender (group rank 0) and the engines it serves (ranks 1..K). The sender streams the weights in
buckets of at most `bucket_bytes` (a larger parameter is a bucket of its own), each one gloo broadcast that the
engines cut along the same plan. With every engine on the sender's host, buckets go through shared-memory files
instead. Nothing is written to disk.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import datetime
import os
import re
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import psutil
import torch

from forge_core.timings import WEIGHT_TRANSFER_TIMEOUT_S

# Buckets travelling at once: the next is filled (sender) or loaded (engine) while one travels.
IN_FLIGHT = 2


@dataclass(frozen=True)
class Param:
    """One parameter on the wire: its HF name, wire dtype and full shape (the fields of vLLM's ParamMeta, so
    either serves wherever the other is read)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass
class EngineRendezvous:
    """An engine's part in a group: the sender's rendezvous, this engine's first rank, and the bucket size."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    bucket_bytes: int
    listen_address: str = "127.0.0.1"
    timeout_s: float = WEIGHT_TRANSFER_TIMEOUT_S

    @classmethod
    def of_sender(
        cls, master_address: str, master_port: int, world_size: int, bucket_bytes: int, timeout_s: float
    ) -> EngineRendezvous:
        """The group a sender at `master_address:master_port` opens: its engines take group ranks 1 onwards
        (each engine's client moves `rank_offset` past the engines before it)."""
        return cls(master_address, master_port, 1, world_size, bucket_bytes, timeout_s=timeout_s)


@dataclass
class BucketUpdate:
    """One round's parameters in streaming order, and the shared-memory files (none: through the group)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    segments: list[str] = dataclasses.field(default_factory=list)

    @classmethod
    def of(cls, meta: Sequence[Param], segments: Sequence[str] = ()) -> BucketUpdate:
        return cls(
            [m.name for m in meta], [str(m.dtype).removeprefix("torch.") for m in meta], [list(m.shape) for m in meta],
            list(segments),
        )  # fmt: skip

    def params(self) -> list[Param]:
        return [
            Param(name, getattr(torch, dtype), tuple(shape))
            for name, dtype, shape in zip(self.names, self.dtype_names, self.shapes, strict=True)
        ]


class EngineClient(Protocol):
    """The engines' side of a round as the sender drives it (vLLM's VLLMWeightSyncClient has these methods)."""

    def init_weight_transfer_engine(self, init_info: dict) -> None: ...
    def start_weight_update(self) -> None: ...
    def update_weights(self, update_info: dict) -> None: ...
    def finish_weight_update(self, weight_version: str | None = None) -> None: ...


class Source(Protocol):
    """The trainer's weights (vLLM's WeightSource has these methods): `metadata` declares what one iteration
    yields, in order; iterating gathers each parameter, a collective every trainer rank takes part in."""

    def metadata(self) -> list[Param]: ...
    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]: ...


def nbytes(meta: Param) -> int:
    return torch.Size(meta.shape).numel() * torch.empty((), dtype=meta.dtype).element_size()


def plan_buckets(
    params: Sequence[Param], bucket_bytes: int, together: Callable[[str], str] | None = None
) -> list[range]:
    """Consecutive runs of parameter indices, each at most `bucket_bytes` unless one unit alone is larger. A unit
    (never split) is one parameter, or with `together` a run of consecutive parameters of one `together(name)`."""
    units: list[range] = []
    for index, meta in enumerate(params):
        if units and together is not None and together(meta.name) == together(params[units[-1].start].name):
            units[-1] = range(units[-1].start, index + 1)
        else:
            units.append(range(index, index + 1))
    buckets: list[range] = []
    size = 0
    for unit in units:
        unit_bytes = sum(nbytes(params[k]) for k in unit)
        if buckets and size + unit_bytes <= bucket_bytes:
            buckets[-1] = range(buckets[-1].start, unit.stop)
            size += unit_bytes
        else:
            buckets.append(unit)
            size = unit_bytes
    return buckets


_DECODER_LAYER = re.compile(r"^(.*\.layers\.\d+)\.")


def decoder_layer(name: str) -> str:
    """The decoder layer an HF parameter name belongs to ("model.layers.3"); the name itself outside one."""
    match = _DECODER_LAYER.match(name)
    return match.group(1) if match else name


def open_group(
    master_address: str, master_port: int, rank: int, world_size: int, listen_address: str, timeout_s: float
) -> torch.distributed.ProcessGroup:
    """A gloo group apart from torch's default group: rank 0 hosts the store at `master_address:master_port`;
    this member listens on `listen_address` only."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = torch.distributed.TCPStore(
        master_address, master_port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False
    )
    options = torch.distributed.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [torch.distributed.ProcessGroupGloo.create_device(hostname=listen_address)]
    prefixed = torch.distributed.PrefixStore("forgeflow-weights", store)
    return torch.distributed.ProcessGroupGloo(prefixed, rank, world_size, options)


def start_broadcast(group: torch.distributed.ProcessGroup, buffer: torch.Tensor):
    """Start broadcasting rank 0's `buffer` to every member; returns the work object. Broadcasts complete in
    the order they were started."""
    options = torch.distributed.BroadcastOptions()
    options.rootRank = 0
    return group.broadcast([buffer], options)


def pipelined(buckets: Iterator[tuple[Any, torch.Tensor]], group: torch.distributed.ProcessGroup):
    """Broadcast each (item, buffer) of `buckets`, up to IN_FLIGHT at once; yields each item once its buffer
    has arrived (or been sent)."""
    travelling: collections.deque = collections.deque()
    for item, buffer in buckets:
        travelling.append((item, start_broadcast(group, buffer)))
        if len(travelling) >= IN_FLIGHT:
            done, work = travelling.popleft()
            work.wait()
            yield done
    while travelling:
        done, work = travelling.popleft()
        work.wait()
        yield done


class GroupBuckets:
    """Buckets as gloo broadcasts over the group, IN_FLIGHT of them travelling at once (any hosts)."""

    paths: tuple[str, ...] = ()  # no files

    @staticmethod
    def plan(params: Sequence[Param], bucket_bytes: int) -> list[range]:
        return plan_buckets(params, bucket_bytes)

    def sender_ring(self, largest: int) -> list[torch.Tensor]:
        # Reused safely: `pipelined` has waited for bucket k - IN_FLIGHT before bucket k is filled.
        return [torch.empty(largest, dtype=torch.uint8) for _ in range(IN_FLIGHT)]

    def send(self, group: torch.distributed.ProcessGroup, filled: Iterator[torch.Tensor]) -> None:
        for _ in pipelined(((None, buffer) for buffer in filled), group):
            pass

    def receive(self, group: torch.distributed.ProcessGroup, sizes: Sequence[int]) -> Iterator[torch.Tensor]:
        # A fresh buffer per bucket: vLLM's layerwise reload keeps views of a layer's weights until the layer is
        # complete, so a buffer is never reused.
        fresh = (torch.empty(size, dtype=torch.uint8) for size in sizes)
        yield from pipelined(((buffer, buffer) for buffer in fresh), group)

    def packing(self) -> contextlib.AbstractContextManager:
        """How the sender packs: on the caller's threads (its engines load on other hosts' cores)."""
        return contextlib.nullcontext()

    def loaded(self) -> None:
        """A received bucket is the engine's own: nothing to copy out."""

    def close(self) -> None:
        """Nothing outlives a round."""


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """The calling thread's torch operations on one thread while inside; its count is restored after. OpenMP's
    thread count is a thread's own setting, so the process's other threads keep theirs."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _pace(group: torch.distributed.ProcessGroup) -> None:
    """A barrier of the group (gloo's broadcast does not wait for its receivers; an all-reduce does)."""
    group.allreduce([torch.zeros(1, dtype=torch.uint8)]).wait()


class SharedMemoryBuckets:
    """Buckets through shared-memory files of one host; the group carries no bytes, it only paces the round.

    Bucket k goes into file k % 2, then every member passes barrier k. An engine reaches barrier k + 1 only after
    loading bucket k, so the sender never overwrites a bucket an engine still reads. Every member has mapped the
    files by barrier 0, so the sender removes them there: a member that dies later leaves nothing in /dev/shm. A
    sender ended before barrier 0 is first asked to remove them (`release_shared_memory`); one killed outright
    leaves them to the next sender of its host (`remove_orphaned_buckets`).
    vLLM's layerwise reload keeps the tensors it is given until their layer is complete, so buckets hold whole
    decoder layers and the engine copies out whatever vLLM still keeps after each bucket (or every bucket, without
    `_layerwise_buffers`)."""

    COUNT = 2

    def __init__(self, paths: Sequence[str], size: int, owner: bool) -> None:
        self.paths = list(paths)
        self.owner = owner
        self.buffers = [torch.from_file(path, shared=True, size=max(size, 1), dtype=torch.uint8) for path in paths]

    @staticmethod
    def plan(params: Sequence[Param], bucket_bytes: int) -> list[range]:
        return plan_buckets(params, bucket_bytes, together=decoder_layer)

    @classmethod
    def create(cls, size: int) -> SharedMemoryBuckets:
        """The sender's files of `size` bytes each (in /dev/shm where the host has it), after removing the files
        of senders of this host that died before removing theirs."""
        folder = bucket_folder()
        remove_orphaned_buckets(folder)
        stem = f"{BUCKET_FILE_PREFIX}{os.getpid()}-{_pid_namespace()}-{uuid.uuid4().hex[:12]}"
        paths = [os.path.join(folder, f"{stem}-{k}") for k in range(cls.COUNT)]
        with _owned_lock:
            _owned.update(paths)
        return cls(paths, size, owner=True)

    def sender_ring(self, largest: int) -> list[torch.Tensor]:
        return self.buffers

    def packing(self) -> contextlib.AbstractContextManager:
        """How the sender packs: on one torch thread. Its engines load each bucket on this host's cores meanwhile,
        and the load is the round's longer half: a team of sender threads on those cores preempts the engines' own
        (each of their parallel regions then waits for its slowest thread)."""
        return one_torch_thread()

    def send(self, group: torch.distributed.ProcessGroup, filled: Iterator[torch.Tensor]) -> None:
        for index, _ in enumerate(filled):
            _pace(group)
            if index == 0:
                self._unlink()  # every member has mapped them: the mappings outlive the names
        _pace(group)

    def receive(self, group: torch.distributed.ProcessGroup, sizes: Sequence[int]) -> Iterator[torch.Tensor]:
        buffered = _layerwise_buffers()
        for k, size in enumerate(sizes):
            _pace(group)
            view = self.buffers[k % len(self.buffers)][:size]
            yield view if buffered is not None else view.clone()
        _pace(group)

    def loaded(self) -> None:
        """After a bucket's load: copy out of the files what vLLM still keeps of them."""
        buffered = _layerwise_buffers()
        if buffered is None:
            return  # every bucket was copied out whole
        files = {buffer.untyped_storage().data_ptr() for buffer in self.buffers}
        for info in list(buffered.values()):
            for _, bound in info.loaded_weights:
                for key, value in bound.arguments.items():
                    if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() in files:
                        bound.arguments[key] = value.clone()

    def close(self) -> None:
        """Unmap the files; the sender also removes them (if it has not yet)."""
        self.buffers = []
        self._unlink()

    def _unlink(self) -> None:
        if self.owner:
            _remove(self.paths)


BUCKET_FILE_PREFIX = "forgeflow-weights-"
# This process's bucket files that are still named: what release_shared_memory removes (from any thread).
_owned: set[str] = set()
_owned_lock = threading.Lock()
_OWNER = re.compile(rf"^{BUCKET_FILE_PREFIX}(\d+)-(\d+)-")


def bucket_folder() -> str:
    """Where senders of this host put their bucket files."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _pid_namespace() -> int:
    """This process's pid namespace (0 where unknown): a pid names a process only within its namespace, and hosts
    whose containers share /dev/shm may run several."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _remove(paths: Sequence[str]) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        with _owned_lock:
            _owned.discard(path)


def release_shared_memory() -> list[str]:
    """Remove every bucket file this process created and has not yet removed; the paths removed. For a process
    about to be ended in the middle of a round (a killed sender cannot remove its files itself)."""
    with _owned_lock:
        paths = sorted(_owned)
    _remove(paths)
    return paths


def remove_orphaned_buckets(folder: str) -> list[str]:
    """Remove the bucket files in `folder` whose sender, a process of this pid namespace, is gone; the paths
    removed. A sender killed before its engines had mapped its files leaves them behind."""
    namespace = _pid_namespace()
    removed = []
    for name in os.listdir(folder):
        owner = _OWNER.match(name)
        if owner is None or int(owner.group(2)) != namespace or psutil.pid_exists(int(owner.group(1))):
            continue
        path = os.path.join(folder, name)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            removed.append(path)
    return removed


def round_plan(params: Sequence[Param], bucket_bytes: int, shared_memory: bool) -> tuple[list[range], list[int]]:
    """A round's buckets and their byte sizes, cut the same way by the sender and its engines (whole decoder
    layers through shared memory)."""
    buckets = (SharedMemoryBuckets if shared_memory else GroupBuckets).plan(params, bucket_bytes)
    return buckets, [sum(nbytes(params[k]) for k in bucket) for bucket in buckets]


def _layerwise_buffers() -> Any:
    """vLLM's record of the tensors its layerwise reload keeps until their layer is complete, or None. Only the
    engine's end calls it (in vLLM's worker, where vLLM is imported already)."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    except ImportError:
        return None
    return LAYERWISE_INFO


def unpacked(buffer: torch.Tensor, metas: Sequence[Param]) -> Iterator[tuple[str, torch.Tensor]]:
    """The parameters `metas` packed one after another in `buffer`, as views of it."""
    offset = 0
    for meta in metas:
        size = nbytes(meta)
        yield meta.name, buffer[offset : offset + size].view(meta.dtype).view(meta.shape)
        offset += size


@dataclass
class BucketSender:
    """A trainer rank's end of a group. Every trainer rank iterates the source (gathering a sharded parameter is a
    collective); the sender, which `join` made, also streams each bucket and drives its engines through `client`.

    Args:
        source: the weights; `metadata()` must agree with iteration element for element.
        client: the engines' side; None on a rank that only gathers.
        group: the group `join` opened; None on a rank that only gathers.
        bucket_bytes: the largest bucket, unless one parameter (or decoder layer, in shared memory) is larger.
        shared_memory: every engine runs on this host; buckets go through shared-memory files.
    """

    source: Source
    client: EngineClient | None = None
    group: torch.distributed.ProcessGroup | None = None
    bucket_bytes: int = 0
    shared_memory: bool = False

    @classmethod
    def join(
        cls, source: Source, client: EngineClient, rendezvous: EngineRendezvous, shared_memory: bool = False
    ) -> BucketSender:
        """Open the group as its rank 0 while the engines behind `client` join it as ranks
        `rendezvous.rank_offset` onwards; the sender of that group."""
        # The engines wait in their rendezvous until the sender has joined: both at once.
        with ThreadPoolExecutor(1, thread_name_prefix="forge-weights-init") as pool:
            joined = pool.submit(client.init_weight_transfer_engine, dataclasses.asdict(rendezvous))
            group = open_group(
                rendezvous.master_address, rendezvous.master_port, 0, rendezvous.world_size,
                rendezvous.master_address, rendezvous.timeout_s,
            )  # fmt: skip
            joined.result()
        return cls(source, client, group, rendezvous.bucket_bytes, shared_memory)

    def send_weights(self) -> None:
        """One round: every engine holds the source's weights when it returns (a rank that only gathers has
        taken its part in every gather)."""
        self.send_buckets()
        self.finish()

    def send_buckets(self) -> None:
        """A round but its end: every engine has loaded the source's weights, and serves them from `finish`. A rank
        that only gathers takes its part in every gather. When sending fails, the rest of the source is still
        iterated before the error is raised, so no other trainer rank waits in a gather this rank left."""
        params = self.source.metadata()
        pairs = iter(self.source)
        if self.group is None:
            for _ in pairs:
                pass
            return
        assert self.client is not None, "join gives a sender its client"
        try:
            self._send(params, pairs)
        except BaseException:
            for _ in pairs:
                pass
            raise

    def finish(self, weight_version: str | None = None) -> None:
        """End the round: the engines serve the weights sent, as `weight_version` (None: the client's)."""
        if self.client is not None and self.group is not None:
            self.client.finish_weight_update(weight_version)

    def _send(self, params: list[Param], pairs: Iterator[tuple[str, torch.Tensor]]) -> None:
        assert self.client is not None and self.group is not None
        buckets, sizes = round_plan(params, self.bucket_bytes, self.shared_memory)
        path = SharedMemoryBuckets.create(max(sizes, default=0)) if self.shared_memory else GroupBuckets()
        self.client.start_weight_update()
        pool = ThreadPoolExecutor(1, thread_name_prefix="forge-weights-update")
        try:
            update = BucketUpdate.of(params, path.paths)
            received = pool.submit(self.client.update_weights, dataclasses.asdict(update))
            with path.packing():
                path.send(self.group, self._filled(params, pairs, buckets, path.sender_ring(max(sizes, default=0))))
            received.result()
        finally:
            # A failed broadcast leaves the engines waiting in theirs: never join their call here.
            pool.shutdown(wait=False)
            path.close()

    @staticmethod
    def _filled(
        params: list[Param], pairs: Iterator[tuple[str, torch.Tensor]], buckets: list[range], ring: list[torch.Tensor]
    ) -> Iterator[torch.Tensor]:
        """Each bucket packed into the next buffer of `ring` (the path's: it says when one may be refilled)."""
        for index, bucket in enumerate(buckets):
            metas = [params[k] for k in bucket]
            buffer = ring[index % len(ring)][: sum(nbytes(m) for m in metas)]
            for (_, slot), k in zip(unpacked(buffer, metas), bucket, strict=True):
                name, tensor = next(pairs)
                expected = params[k]
                if name != expected.name or tuple(tensor.shape) != expected.shape:
                    raise ValueError(
                        f"weight source: parameter {k} is {name} {tuple(tensor.shape)}, its metadata said "
                        f"{expected.name} {expected.shape}"
                    )
                slot.copy_(tensor.detach())  # cast to the wire dtype and packed in one copy
            yield buffer
        if next(pairs, None) is not None:
            raise ValueError(f"weight source: more parameters than its metadata's {len(params)}")

    def shutdown(self) -> None:
        self.group = None
