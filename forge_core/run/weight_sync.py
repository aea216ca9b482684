"""A new policy from the flow's trainer group to its engines without the store
(`rollout.weight_sync.transport: group`).

    router = engines.serve(policy, stage, push=trainer_pusher(resources, policy))   # forge_core.run.engines

When the engines must serve a policy the trainer group holds (HeldPolicy), each engine behind gets it from a
trainer rank on its node (else rank 0): the rank streams buckets without importing vLLM
(forge_core.rollout.weight_buckets), the engines load them through vLLM's weight-transfer API (gloo, or shared
memory when all of a sender's engines share its node). Every rank takes part, since gathering a sharded
parameter is a collective; the tensors sent are the export's (dtype and names), so the engines serve the same
version as the store.

A push needs the trainer group idle, else the engines take the store's copy. A failed push ends the trainer
group (a rank may wait in a gather that never completes) and marks the engines that took part failed (part of
their weights may be new), so `EngineActors.serve` restarts them from the store.

In grpo.mode=sync a GRPO order pushes its own policy while rank 0 writes the export (ExportPush, planned by
`export_push_plan`), so the engines already serve it when the next stage asks. There a failed push leaves the
stage and the group running (its sender still takes its part in every gather) and only marks its engines failed.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any

import torch

from forge_core.artifacts.policy import PolicyRef
from forge_core.compute.actors import call_all
from forge_core.engine.distributed import full_tensors
from forge_core.models.hf import titan_to_hf_state_dict
from forge_core.rollout.weight_buckets import BucketSender, EngineRendezvous, Param
from forge_core.run.resources import FlowResources
from forge_core.run.scaffold import HeldPolicy

log = logging.getLogger(__name__)

MIB = 2**20


@dataclass(frozen=True)
class EngineTarget:
    """An engine a sender serves: its Ray actor (a hosted EngineHost), where it listens, its workers."""

    actor: Any
    address: str
    workers: int
    name: str


@dataclass(frozen=True)
class WeightPush:
    """One trainer rank's part in a push: the policy, and for a sender its group's rendezvous and engines."""

    stage_uri: str
    version: str
    bucket_bytes: int
    timeout_s: float
    master_address: str = ""
    master_port: int = 0
    engines: tuple[EngineTarget, ...] = ()
    shared_memory: bool = False  # every engine runs on the sender's node: the buckets go through shared memory
    # A rank other than rank 0 sends: a push alongside the export gathers the weights again on every rank, since
    # only rank 0's export holds them whole.
    every_rank_gathers: bool = True


# ---- on a trainer rank ------------------------------------------------------------------------------------------


class HeldPolicySource:
    """The weights of a trainer's model (a weight_buckets Source), named as in the exported HF folder: `metadata`
    declares the export dtype; iteration yields each parameter gathered (collective) but not cast, since the
    sender casts as it packs. `gathered`: the full weights gathered already (rank 0's export, in the model's
    order), iterated instead (no collective)."""

    def __init__(self, engine: Any, gathered: Mapping[str, torch.Tensor] | None = None) -> None:
        self.engine = engine
        self.dtype = engine.export_dtype
        self.gathered = gathered

    def _hf(self, key: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        return titan_to_hf_state_dict({key: tensor}, self.engine.model_config)

    def metadata(self) -> list[Param]:
        params = []
        for key, value in self.engine.model.state_dict().items():
            shell = torch.empty(value.shape, dtype=self.dtype, device="meta")
            params += [Param(name, t.dtype, tuple(t.shape)) for name, t in self._hf(key, shell).items()]
        return params

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The full tensors, renamed, in the model's dtype (the export's, when `gathered`): the sender casts each as
        it packs it."""
        pairs = self.gathered.items() if self.gathered is not None else full_tensors(self.engine.model.state_dict().items())
        for key, full in pairs:
            yield from self._hf(key, full.detach()).items()


class EngineGroupClient:
    """A sender's engines (a weight_buckets EngineClient): each step on every engine at once, through Ray."""

    def __init__(self, engines: tuple[EngineTarget, ...], version: str, timeout_s: float) -> None:
        self.engines = engines
        self.version = version
        self.timeout_s = timeout_s

    def _on_every_engine(self, method: str, args_of) -> list:
        args = [args_of(k, target) for k, target in enumerate(self.engines)]
        names = [target.name for target in self.engines]
        return call_all([target.actor for target in self.engines], method, args, names, self.timeout_s)

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        offsets = [init_info["rank_offset"] + sum(t.workers for t in self.engines[:k]) for k in range(len(self.engines))]
        self._on_every_engine(
            "init_weight_transfer_engine",
            lambda k, target: ({**init_info, "rank_offset": offsets[k], "listen_address": target.address},),
        )

    def start_weight_update(self) -> None:
        self._on_every_engine("start_weight_update", lambda k, target: ())

    def update_weights(self, update_info: dict) -> None:
        self._on_every_engine("update_weights", lambda k, target: (update_info,))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._on_every_engine("finish_weight_update", lambda k, target: (weight_version or self.version,))


class RankPush:
    """This rank's part in one push of `engine`'s weights (collective: every rank gathers): `send()` streams them,
    `finish(version)` makes the engines serve them. A rank without engines in `push` only gathers."""

    def __init__(self, engine: Any, push: WeightPush, gathered: Mapping[str, torch.Tensor] | None = None) -> None:
        self.push = push
        source = HeldPolicySource(engine, gathered)
        self.sender = BucketSender(source)
        if push.engines:
            world = 1 + sum(target.workers for target in push.engines)
            rendezvous = EngineRendezvous.of_sender(
                push.master_address, push.master_port, world, push.bucket_bytes, push.timeout_s
            )
            client = EngineGroupClient(push.engines, push.version, push.timeout_s)
            self.sender = BucketSender.join(source, client, rendezvous, push.shared_memory)

    def send(self) -> None:
        """Every engine has loaded the weights when this returns (raising on this rank's failure, once this rank
        has taken its part in every gather)."""
        self.sender.send_buckets()

    def finish(self, version: str | None = None) -> None:
        """The engines serve the weights sent as `version` (None: the push's)."""
        try:
            self.sender.finish(version)
        finally:
            self.sender.shutdown()

    def close(self) -> None:
        self.sender.shutdown()


def push_held_weights(held: HeldPolicy, push: WeightPush) -> float:
    """This rank's part in `push`: the seconds it took; RuntimeError when it holds another policy. Imports
    nothing of vLLM."""
    if not held.holds(push.stage_uri):
        raise RuntimeError(f"weight push of {push.stage_uri}: this rank holds {held.stage_uri or 'no policy'}")
    started = time.perf_counter()
    rank_push = RankPush(held.engine, push)
    try:
        rank_push.send()
    except BaseException:
        rank_push.close()
        raise
    rank_push.finish()
    return time.perf_counter() - started


class ExportPush:
    """This rank's part in pushing a GRPO stage's policy to the engines while rank 0 writes its export (a trainer
    group's order in grpo.mode=sync, when the engines wait for this policy): they load it alongside the write and
    serve it once the commit has given its version, so no engine serves a version the store does not hold. A push
    that fails does not fail the stage: `failed` says why, and the flow restarts those engines from the store.
    """

    def __init__(self, engine: Any, push: WeightPush) -> None:
        self.failed: str | None = None
        self.seconds = 0.0
        self._push = push
        self._engine = engine
        self._rank: RankPush | None = None

    def _fail(self, step: str, exc: BaseException) -> None:
        self.failed = self.failed or f"{step}: {type(exc).__name__}: {exc}"
        log.warning("weight push of %s alongside its export failed (%s)", self._push.stage_uri, self.failed)

    def send(self, exported: Mapping[str, torch.Tensor]) -> dict:
        """Collective: join the engines' group (a sender) and stream the weights; the phase metric. `exported`:
        the weights rank 0 writes (export_weights' `alongside` argument), which rank 0 sends when it is the only
        sender; otherwise every rank gathers them again. A sender that fails still takes its part in every
        gather."""
        started = time.perf_counter()
        gathered = None if self._push.every_rank_gathers else exported
        if gathered is not None and not self._push.engines:  # rank 0 alone sends, from its export
            return {}
        try:
            self._rank = RankPush(self._engine, self._push, gathered)
        except Exception as exc:  # noqa: BLE001 - the stage goes on; the flow restarts the engines
            self._fail("rendezvous", exc)
            self._rank = RankPush(self._engine, dataclasses.replace(self._push, engines=()), gathered)
        try:
            self._rank.send()
        except Exception as exc:  # noqa: BLE001 - as above; send_buckets drained the source first
            self._fail("send", exc)
        self.seconds = time.perf_counter() - started
        return {"phase/push_s": self.seconds}

    def finish(self, version: str) -> str | None:
        """After the commit: the engines serve the weights sent as `version`, the committed policy's. Returns why
        this rank's part failed, None when it did not."""
        if self._rank is None:  # took no part (rank 0 sent alone)
            return None
        if self.failed is not None:
            self._rank.close()
            return self.failed
        try:
            self._rank.finish(version)
        except Exception as exc:  # noqa: BLE001 - as in send
            self._fail("finish", exc)
        return self.failed


# ---- on the flow's side -----------------------------------------------------------------------------------------


def trainer_pusher(resources: FlowResources, policy: PolicyRef):
    """The `push` of EngineActors.serve for `policy`; None with `rollout.weight_sync.transport: store`."""
    if resources.cfg.rollout.weight_sync.transport != "group":
        return None
    return lambda behind: push_policy(resources, behind, policy)


def push_policy(resources: FlowResources, behind: list, policy: PolicyRef) -> float | None:
    """Bring the engines `behind` to `policy` from the run's trainer group; the seconds it took, None when the
    group does not hold it, is busy, or the push failed."""
    with resources.lock:
        trainer = resources.trainer_group
    if trainer is None or trainer.lost() is not None:
        return None
    if not trainer.busy.acquire(blocking=False):
        log.info("weight sync: the trainer group is training; the engines take %s from the store", policy.stage_uri)
        return None
    try:
        held = trainer.ranks[0].call("held_stage", timeout=trainer.call_timeout_s)
        if held != policy.stage_uri.rstrip("/"):
            return None
        seconds, senders = _push(trainer, behind, policy, resources.cfg.rollout)
    except Exception as exc:  # noqa: BLE001 - the store is the fallback; the group may be stuck in a gather
        log.warning(
            "weight sync of %s to %s failed (%s: %s); ending the trainer group, the engines are restarted from the "
            "store", policy.stage_uri, ", ".join(engine.name for engine in behind), type(exc).__name__, exc,
        )  # fmt: skip
        for engine in behind:  # part of their weights may be new: a restart is the one known state
            engine.failed = engine.failed or f"interrupted weight transfer ({type(exc).__name__})"
        trainer.busy.release()
        with resources.lock:
            current = resources.trainer_group is trainer
        if current:
            resources.stop_trainer_group(failing=True)
        return None
    trainer.busy.release()
    for engine in behind:
        engine.refresh(engine.host.call("describe"))
    log.info(
        "weight sync: %s to %d engine(s) from the trainer group in %.2f s (no store; %s)", policy.stage_uri,
        len(behind), seconds, senders,
    )  # fmt: skip
    return seconds


def plan_pushes(trainer: Any, behind: list, stage_uri: str, version: str, rollout: Any) -> tuple[list[WeightPush], str]:
    """Each rank's part in pushing `stage_uri`'s policy (as `version`) to the engines `behind`: every engine gets
    it from the first trainer rank on its node, else rank 0. Returns the parts and who sends to whom."""
    sync = rollout.weight_sync
    first_rank_on = {}
    for k, rank in enumerate(trainer.ranks):
        first_rank_on.setdefault(rank.place.node_id, k)
    served: dict[int, list[EngineTarget]] = {}
    receivers: dict[int, list[str]] = {}
    engine_nodes: dict[int, list[str]] = {}
    for engine in behind:
        target = EngineTarget(engine.host.actor, engine.host.place.address, rollout.tensor_parallel_size, engine.name)
        sender = first_rank_on.get(engine.host.place.node_id, 0)
        served.setdefault(sender, []).append(target)
        receivers.setdefault(sender, []).append(f"engine {engine.index}")
        engine_nodes.setdefault(sender, []).append(engine.host.place.node_id)
    every_rank_gathers = set(served) != {0}
    common = {"stage_uri": stage_uri, "version": version, "bucket_bytes": sync.bucket_mb * MIB,
              "timeout_s": sync.timeout_s}  # fmt: skip
    pushes = []
    for k, rank in enumerate(trainer.ranks):
        if k in served:
            port = rank.call("free_port", rank.place.address, timeout=trainer.call_timeout_s)
            same_node = all(node == rank.place.node_id for node in engine_nodes[k])
            pushes.append(WeightPush(**common, master_address=rank.place.address, master_port=port,
                                     engines=tuple(served[k]), shared_memory=same_node,
                                     every_rank_gathers=every_rank_gathers))  # fmt: skip
            if same_node:
                receivers[k].append("shared memory")
        else:
            pushes.append(WeightPush(**common, every_rank_gathers=every_rank_gathers))
    senders = "; ".join(f"rank {k} -> {', '.join(receivers[k])}" for k in sorted(receivers))
    return pushes, senders


def export_push_plan(resources: FlowResources, trainer: Any, stage_uri: str) -> list[tuple[WeightPush, list]] | None:
    """Each trainer rank's part in pushing the policy of the GRPO stage `stage_uri` to the run's engines while it
    is exported (ExportPush), with the engines (HostedEngine) it sends to; None unless the engines serve that
    policy next and sit idle until then (grpo.mode=sync, rollout.weight_sync.transport=group, the run's own live
    engines)."""
    cfg = resources.cfg
    if cfg.rollout.weight_sync.transport != "group" or cfg.grpo.mode != "sync":
        return None
    with resources.engines_lock:
        engines = resources.flow_engines
    behind = engines.live() if engines is not None else []
    if not behind:
        return None
    try:
        pushes, senders = plan_pushes(trainer, behind, stage_uri, "", cfg.rollout)
    except Exception as exc:  # noqa: BLE001 - the order then reports the rank; the engines take the store's copy
        log.warning("weight sync: no push of %s alongside its export (%s: %s)", stage_uri, type(exc).__name__, exc)
        return None
    log.info("weight sync: %s goes to %d engine(s) while it is exported (%s)", stage_uri, len(behind), senders)
    by_name = {engine.name: engine for engine in behind}
    return [(push, [by_name[target.name] for target in push.engines]) for push in pushes]


def _push(trainer: Any, behind: list, policy: PolicyRef, rollout: Any) -> tuple[float, str]:
    """Every rank's part at once; returns the seconds and who sent to whom. Raises the first rank's error at
    once: the others may wait in a collective for it until the caller ends the group."""
    pushes, senders = plan_pushes(trainer, behind, policy.stage_uri, policy.version, rollout)
    started = time.monotonic()
    # Bounded: the rendezvous, then every bucket, each within timeout_s on its own.
    bound = rollout.weight_sync.timeout_s * 4
    pool = ThreadPoolExecutor(len(pushes), thread_name_prefix="forge-weight-push")
    try:
        calls = [pool.submit(rank.call, "push_weights", push, timeout=bound) for rank, push in zip(trainer.ranks, pushes)]
        for call in as_completed(calls):
            call.result()
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    return time.monotonic() - started, senders
