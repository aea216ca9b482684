"""The rollout engines on the Ray cluster: `rollout.num_engines` vLLM engine actors behind one EngineRouter.

    engines = EngineActors.start(cluster, cfg, seed)      # reserves launch.rollout.nnodes nodes of its pool
    router = engines.serve(policy)                        # every engine serves policy.version (started or reloaded)
    samples = router.generate(prompts, sampling, seed)    # a lost engine's prompts go to the others (router.py)
    engines.placement()                                   # the pool and each engine's Ray node, for manifests
    engines.close()                                       # every engine actor ends, the nodes are given back

Engines are spread evenly over `launch.rollout.nnodes` nodes of the pool, each fetching the policy from the
store itself. A lost engine is EngineLost to the router, which re-routes its prompts; the next `serve` brings it
back in its slot (Ray restarts a dead actor up to ENGINE_RESTARTS times; one whose vLLM died is replaced), so a
flow-lifetime set of engines heals at the next stage. Ray ends the actors when their starting process dies.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from forge_core.artifacts.policy import (
    PolicyRef,
    committed_policy_version,
    fetch_policy,
    policy_cache_root,
    release_policy,
)
from forge_core.compute.actors import Hosted, HostGroup, HostLost, HostRequest
from forge_core.compute.cluster import ComputeCluster
from forge_core.config import RunConfig
from forge_core.config.schema import SamplingConfig
from forge_core.engine.preflight import preflight
from forge_core.faults import fault_environment, maybe_hang_engine, set_current_stage
from forge_core.rollout.engine import EngineOptions
from forge_core.rollout.generator import Generator
from forge_core.rollout.protocol import EngineLost, PolicyVersionMismatch
from forge_core.rollout.router import EngineRouter
from forge_core.rollout.types import Prompt, Sample
from forge_core.rollout.weight_transfer import GeneratorClient
from forge_core.storage import ObjectStore
from forge_core.timings import ENGINE_CLOSE_S

log = logging.getLogger(__name__)

# How often Ray restarts an engine in its slot after its process or node died, before the stage fails.
ENGINE_RESTARTS = 3


class EngineHost:
    """What an engine actor holds: a Generator on the policy it fetched itself.

    Every vLLM call runs on the host's one engine thread: each thread entering vLLM's CPU kernels gets its own
    OpenMP team, so calls from the actor's changing threads would oversubscribe the node's cores.
    """

    def __init__(self, cfg: RunConfig, stage_uri: str, seed: int, index: int, stage: str = "") -> None:
        _serving_stage(stage)
        preflight(cfg, ["rollout"], checks=())  # this node can run the engine (GPUs, vLLM build)
        self.cfg = cfg
        self.index = index
        self.store = ObjectStore.from_config(cfg.storage)
        self.policy = self._fetch(stage_uri)
        options = EngineOptions.from_config(cfg.rollout, seed=seed)
        self._engine_thread = ThreadPoolExecutor(1, thread_name_prefix=f"forge-engine-{index}")
        self.generator = self._on_engine_thread(
            Generator, self.policy.local_dir, options, policy_version=self.policy.version
        )
        self._transfer = GeneratorClient(self.generator)

    def _on_engine_thread(self, fn, *args, **kwargs):
        return self._engine_thread.submit(fn, *args, **kwargs).result()

    def _fetch(self, stage_uri: str) -> PolicyRef:
        return fetch_policy(self.store, stage_uri, cache_root=policy_cache_root(self.cfg.logging.dir))

    def describe(self) -> dict:
        return {
            "pid": os.getpid(),
            "policy_version": self.generator.policy_version,
            "startup_s": self.generator.startup_s,
            "reload_s": self.generator.reload_s,
        }

    def serve(self, stage_uri: str, stage: str = "") -> dict:
        """Serve the policy of `stage_uri` to `stage` from now on; a no-op when it is served already."""
        _serving_stage(stage)
        if committed_policy_version(self.store, stage_uri) == self.generator.policy_version:
            return self.describe()
        policy = self._fetch(stage_uri)
        self._on_engine_thread(self.generator.reload, policy.local_dir, policy.version)
        if policy.local_dir != self.policy.local_dir:
            release_policy(self.policy)
        self.policy = policy
        return self.describe()

    def reload(self, policy_dir: str, policy_version: str) -> dict:
        """Serve `policy_version` from a folder of this node (Generator.reload)."""
        self._on_engine_thread(self.generator.reload, policy_dir, policy_version)
        return self.describe()

    # The engine side of a weight transfer (driven by forge_core.run.weight_sync), each step on the engine thread.

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._on_engine_thread(self._transfer.init_weight_transfer_engine, init_info)

    def start_weight_update(self) -> None:
        self._on_engine_thread(self._transfer.start_weight_update)

    def update_weights(self, update_info: dict) -> None:
        self._on_engine_thread(self._transfer.update_weights, update_info)

    def finish_weight_update(self, policy_version: str) -> dict:
        """End the transfer: the engine serves `policy_version` from now on."""
        self._on_engine_thread(self._transfer.finish_weight_update, policy_version)
        return self.describe()

    def generate(
        self, prompts: Sequence[Prompt], sampling: SamplingConfig, seed: int, expected_version: str
    ) -> list[Sample]:
        if expected_version != self.generator.policy_version:
            raise PolicyVersionMismatch(
                f"engine pid {os.getpid()} serves policy {self.generator.policy_version[:16]}, the request expected "
                f"{expected_version[:16]}"
            )
        maybe_hang_engine(self.index)  # on the calling thread: a hung request leaves the engine thread free
        return self._on_engine_thread(self.generator.generate, prompts, sampling, seed)

    def close(self) -> None:
        self._on_engine_thread(self.generator.close)
        self._engine_thread.shutdown(wait=False)
        release_policy(self.policy)


def _serving_stage(stage: str) -> None:
    """Record the stage being served, for FORGE_FAULT's `@<stage>` (forge_core.faults)."""
    if stage:
        set_current_stage(stage)


# Brings live engines to a policy without the store, or leaves them as they are (forge_core.run.weight_sync).
WeightPusher = Callable[[list["HostedEngine"]], None]


class HostedEngine:
    """An EngineConnection to one engine actor; calls raise EngineLost when the actor or its node is gone."""

    def __init__(self, host: Hosted, index: int, info: dict) -> None:
        self.host = host
        self.index = index
        self.refresh(info)

    def refresh(self, info: dict) -> None:
        """Take `EngineHost.describe`'s answer."""
        self.failed: str | None = None  # why its vLLM died, when it did
        self.pid = int(info["pid"])
        self.policy_version = info["policy_version"]
        self.startup_s = float(info["startup_s"])
        self.reload_s = float(info["reload_s"])

    @property
    def name(self) -> str:
        return f"engine {self.index} (pid {self.pid} on Ray node {self.host.place.node_id[:8]})"

    def _call(self, method: str, *args):
        try:
            return self.host.call(method, *args)
        except HostLost as exc:
            raise EngineLost(f"{self.name} is gone: {exc}") from None
        except EngineLost as exc:  # its vLLM died inside a live actor: replaced at the next serve
            self.failed = str(exc)
            raise

    def generate(self, prompts: Sequence[Prompt], sampling: SamplingConfig, seed: int) -> list[Sample]:
        return self._call("generate", list(prompts), sampling, seed, self.policy_version)

    def serve(self, stage_uri: str, stage: str = "") -> float:
        """Serve the policy of `stage_uri` to `stage`, fetched on the engine's node; returns the reload seconds."""
        return self._loaded(self._call("serve", stage_uri, stage))

    def reload(self, policy_dir, policy_version: str) -> float:
        """Serve `policy_version` from `policy_dir`, a folder the engine's node sees; returns the reload seconds."""
        return self._loaded(self._call("reload", str(policy_dir), policy_version))

    def _loaded(self, info: dict) -> float:
        self.policy_version = info["policy_version"]
        self.reload_s = float(info["reload_s"])
        return self.reload_s

    def close(self) -> None:
        """Nothing to disconnect: the actor is EngineActors'."""


class EngineActors:
    """The engine actors of a stage or a flow run. Stages may share them: `serve` calls take turns, and a stage
    whose engines another stage has since moved to other weights gets PolicyVersionMismatch (retryable)."""

    def __init__(self, cfg: RunConfig, seed: int, group: HostGroup) -> None:
        self.cfg = cfg
        self.seed = seed
        self.group = group
        self.pool = cfg.launch.rollout.pool or ""  # "": any node of the cluster
        self.slots: list[HostedEngine | None] = [None] * cfg.rollout.num_engines
        self._serving = threading.Lock()

    @classmethod
    def start(cls, cluster: ComputeCluster, cfg: RunConfig, seed: int) -> EngineActors:
        """Reserve the engines' nodes (PlacementUnavailable after launch.pool_wait_s); they start at `serve`."""
        resources = cfg.launch.rollout
        per_node = cfg.rollout.num_engines // resources.nnodes
        request = HostRequest(
            None if cluster.embedded else resources.pool, gpus=resources.gpus_per_node // per_node
        )
        group = HostGroup.reserve(
            cluster, request, nodes=resources.nnodes, per_node=per_node, wait_s=cfg.launch.pool_wait_s,
            name="engines",
        )  # fmt: skip
        return cls(cfg, seed, group)

    def serve(self, policy: PolicyRef, stage: str = "", push: WeightPusher | None = None) -> EngineRouter:
        """Bring every engine to `policy` (a lost one restarted in its slot) and return the router over them.
        `push`, when given, first gets the live engines behind `policy` to update without the store; whatever it
        leaves behind is fetched."""
        with self._serving, ThreadPoolExecutor(len(self.slots), thread_name_prefix="forge-engine-ensure") as pool:
            live = self.live()
            served_already = {engine.index for engine in live if engine.policy_version == policy.version}
            behind = [engine for engine in live if engine.index not in served_already]
            if push is not None and behind:
                push(behind)
            list(pool.map(lambda index: self._serve_slot(index, policy, stage, served_already), range(len(self.slots))))
            return EngineRouter([engine for engine in self.slots if engine is not None])

    def live(self) -> list[HostedEngine]:
        """The engines started and not known to be lost or failed."""
        return [
            engine for engine in self.slots
            if engine is not None and engine.host.lost() is None and not engine.failed
        ]  # fmt: skip

    def _serve_slot(self, index: int, policy: PolicyRef, stage: str, served_already: set[int]) -> None:
        engine = self.slots[index]
        if engine is not None and engine.host.lost() is None and not engine.failed:
            try:
                engine.serve(policy.stage_uri, stage)
                # It was running already: this stage paid no start-up, and no reload when an earlier stage had
                # brought it to this policy (the protocol's 0s; the engine itself reports its last reload).
                engine.startup_s = 0.0
                if index in served_already:
                    engine.reload_s = 0.0
                return
            except EngineLost:
                pass  # its actor, node or vLLM died since it last answered (e.g. between stages): healed below
        if engine is not None and engine.failed:
            log.warning("%s: its vLLM died (%s); starting a new engine in its place", engine.name, engine.failed)
            engine.host.close(0.0)
            engine = None
        if engine is None:
            self.slots[index] = self._start_engine(index, policy, stage)
            return
        lost = engine.host.lost()
        place = engine.host.revive(self.cfg.launch.pool_wait_s)  # HostLost (retryable) when it is not back
        log.info("%s was lost (%s); Ray restarted it on node %s (%s)", engine.name, lost, place.node_id[:8],
                 place.address)  # fmt: skip
        engine.refresh(engine.host.call("describe"))
        engine.serve(policy.stage_uri, stage)

    def _start_engine(self, index: int, policy: PolicyRef, stage: str) -> HostedEngine:
        started = time.monotonic()
        name = f"engine-{index}"
        args = (self.cfg, policy.stage_uri, self.seed, index, stage)
        host = self.group.host(index, EngineHost, args, name, restarts=ENGINE_RESTARTS, env=fault_environment())
        engine = HostedEngine(host, index, host.call("describe"))
        log.info(
            "%s up in %.1f s on Ray node %s (%s) of pool %r", engine.name, time.monotonic() - started,
            host.place.node_id[:8], host.place.address, self.pool,
        )  # fmt: skip
        return engine

    def placement(self) -> dict:
        """The pool and each engine's Ray node, as manifests record them."""
        nodes = [engine.host.place.record(engine.index) for engine in self.slots if engine is not None]
        return {"placement": "ray", "pool": self.pool, "served_by": "engines", "nodes": nodes,
                "flow_run": self.cfg.launch.run_id}  # fmt: skip

    def close(self, timeout_s: float = ENGINE_CLOSE_S) -> None:
        """End every engine (each gets `timeout_s` to shut vLLM down; concurrently) and give the nodes back."""
        engines = [engine for engine in self.slots if engine is not None]
        self.slots = [None] * len(self.slots)
        if engines:
            with ThreadPoolExecutor(len(engines), thread_name_prefix="forge-engine-close") as pool:
                list(pool.map(lambda engine: engine.host.close(timeout_s), engines))
        self.group.close()
