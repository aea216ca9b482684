"""Weights from the trainer to running vLLM engines through a collective group, on vLLM's weight-transfer API.

vLLM defines the contract (vllm.distributed.weight_transfer): an engine's workers take
`init_weight_transfer_engine`, `start_weight_update`, `update_weights` and `finish_weight_update`, driven by a
trainer-side engine through a client. vLLM ships NCCL backends for GPUs; this module registers a CPU one, `gloo`,
with vLLM's factories when imported:

    LLM(..., weight_transfer_config={"backend": "gloo"}, worker_extension_cls=REGISTRATION)   # EngineOptions does
    sender = GlooTrainerEngine.trainer_init(GlooTrainerInit(..., rank=0), client=client, source=source)
    sender.send_weights()                                # every engine behind `client` now holds the weights

The bytes travel as forge_core.rollout.weight_buckets streams them: buckets of at most `bucket_bytes`, each one
gloo broadcast that the engines cut along the same plan and load with `load_weights`, or shared-memory files when
every engine is on the sender's host. A trainer rank uses that module's `BucketSender` without vLLM;
`GlooTrainerEngine` is the same sender behind vLLM's trainer-side API. Importing `REGISTRATION` registers the
backend in vLLM's worker processes too.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

from forge_core.faults import maybe_kill_in_transfer
from forge_core.rollout.engine import TRANSFER_BACKEND, TRANSFER_REGISTRATION
from forge_core.rollout.weight_buckets import (
    BucketSender,
    BucketUpdate,
    EngineRendezvous,
    GroupBuckets,
    SharedMemoryBuckets,
    open_group,
    round_plan,
    unpacked,
)
from forge_core.timings import WEIGHT_TRANSFER_TIMEOUT_S

BACKEND = TRANSFER_BACKEND
REGISTRATION = TRANSFER_REGISTRATION


class Registered:
    """vLLM's worker extension whose only effect is this module's import (the backend's registration)."""


@dataclass
class GlooInit(EngineRendezvous, WeightTransferInitInfo):
    """An engine's part in a group as vLLM parses it (EngineRendezvous's fields)."""


@dataclass
class GlooUpdate(BucketUpdate, WeightTransferUpdateInfo):
    """One round's parameters as vLLM parses them (BucketUpdate's fields)."""


@dataclass
class GlooTrainerInit(TrainerInitInfo):
    """The sender's side of a group: its rendezvous (it hosts the store), the group's size, the bucket size."""

    backend: ClassVar[str] = BACKEND
    master_address: str
    master_port: int
    world_size: int
    bucket_bytes: int
    timeout_s: float = WEIGHT_TRANSFER_TIMEOUT_S
    # Every engine of the group runs on this host: the buckets go through shared memory (SharedMemoryBuckets).
    shared_memory: bool = False

    def engines_rendezvous(self) -> EngineRendezvous:
        """What the sender's engines are told."""
        return EngineRendezvous.of_sender(
            self.master_address, self.master_port, self.world_size, self.bucket_bytes, self.timeout_s
        )


# ---- the engine side (in vLLM's worker) -------------------------------------------------------------------------


class GlooEngine(WeightTransferEngine[GlooInit, GlooUpdate]):
    """A vLLM worker's end of a group: receives each bucket and loads its parameters."""

    init_info_cls = GlooInit
    update_info_cls = GlooUpdate
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: torch.distributed.ProcessGroup | None = None
        self.bucket_bytes = 0

    def init_transfer_engine(self, init_info: GlooInit) -> None:
        rank = init_info.rank_offset + self.parallel_config.rank
        self.bucket_bytes = init_info.bucket_bytes
        self.group = open_group(
            init_info.master_address, init_info.master_port, rank, init_info.world_size, init_info.listen_address,
            init_info.timeout_s,
        )  # fmt: skip

    def start_weight_update(self) -> None:
        """Start vLLM's layerwise reload: each layer takes checkpoint-format weights, processed once complete."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def receive_weights(self, update_info: GlooUpdate) -> None:
        if self.group is None:
            raise RuntimeError("the gloo weight transfer was not initialized: call init_weight_transfer_engine first")
        params = update_info.params()
        shared = bool(update_info.segments)
        buckets, sizes = round_plan(params, self.bucket_bytes, shared)
        path: GroupBuckets | SharedMemoryBuckets = GroupBuckets()
        if shared:
            path = SharedMemoryBuckets(update_info.segments, max(sizes, default=0), owner=False)
        try:
            for loaded, buffer in enumerate(path.receive(self.group, sizes), start=1):
                self.model.load_weights(list(unpacked(buffer, [params[k] for k in buckets[loaded - 1]])))
                path.loaded()
                maybe_kill_in_transfer(loaded)
        finally:
            path.close()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class synchronizes an accelerator after each update; a gloo broadcast has completed already.
        self.receive_weights(self.parse_update_info(update_info))

    def shutdown(self) -> None:
        self.group = None


# ---- the trainer side, behind vLLM's API ------------------------------------------------------------------------


class GlooTrainerEngine(TrainerWeightTransferEngine[GlooTrainerInit]):
    """vLLM's trainer-side engine of the `gloo` backend: a BucketSender (the sender's, or a rank's that only
    gathers)."""

    init_info_cls = GlooTrainerInit

    def __init__(
        self, *, client: VLLMWeightSyncClient, source: WeightSource | None, is_sender: bool, sender: BucketSender
    ) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.sender = sender

    @classmethod
    def trainer_init(
        cls, init_info: GlooTrainerInit, *, client: VLLMWeightSyncClient, source: WeightSource | None = None
    ) -> GlooTrainerEngine:
        if source is None:
            raise ValueError("the gloo weight transfer streams a WeightSource; pass source=")
        if init_info.is_sender:
            sender = BucketSender.join(source, client, init_info.engines_rendezvous(), init_info.shared_memory)
        else:
            sender = BucketSender(source)
        return cls(client=client, source=source, is_sender=init_info.is_sender, sender=sender)

    def send_weights(self) -> None:
        self.sender.send_weights()

    def shutdown(self) -> None:
        self.sender.shutdown()


class GeneratorClient:
    """A VLLMWeightSyncClient over a Generator of this process; after a round trip the generator serves the
    new version and reports the round trip as its reload time."""

    def __init__(self, generator: Any, version: str = "") -> None:
        self.generator, self.version = generator, version
        self._started = 0.0

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.generator.weight_transfer("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        self._started = time.perf_counter()
        self.generator.weight_transfer("start_weight_update")

    def update_weights(self, update_info: dict) -> None:
        self.generator.weight_transfer("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.generator.weight_transfer("finish_weight_update")
        self.generator.weight_transfer("shutdown_weight_transfer_engine")
        self.generator.weights_received(weight_version or self.version, time.perf_counter() - self._started)


def _register() -> None:
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, GlooEngine)
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, GlooTrainerEngine)


_register()
