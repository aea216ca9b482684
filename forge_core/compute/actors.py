"""Long-lived objects hosted on nodes of a pool: the run's engines, its trainer ranks.

    host = Hosted.start(cluster, HostRequest(pool="gpu-a", gpus=1), MyObject, args, wait_s=60, name="trainer")
    call = host.stream("run", spec_uri, log_sink=print)   # the object's run(spec_uri, log=...) on its node
    call.wait(1.0)                               # (True, its return value) once done, (False, None) while it runs
    host.call("stop_order", "deadline")          # another method, while `run` still runs
    host.lost()                                  # why the host is gone (its actor or node died), None while alive
    host.close(10)                               # the object's close(), then the actor and its group end

    group = HostGroup.reserve(cluster, HostRequest("gpu-a", gpus=1), nodes=2, per_node=2, wait_s=60, name="engines")
    hosts = [group.host(k, MyObject, args, f"engine-{k}") for k in range(4)]   # two on each of two nodes
    ...; [h.close(10) for h in hosts]; group.close()

A host is a Ray actor in a placement-group bundle holding the object's GPUs; Ray ends it when the process that
started it dies. The object is built on the node from an importable class; `stream` needs a method taking a
`log` keyword (a one-line callable). Methods run on the actor's threads, so `call` works during a `stream`.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from forge_core.compute.cluster import POOL_LABEL, ComputeCluster
from forge_core.compute.gang import NodePlace, PlacementUnavailable
from forge_core.compute.tuning import flow_thread_setting, process_start_environment, take_cpu_share
from forge_core.launch.errors import RetryableStageError
from forge_core.timings import ACTOR_REVIVE_PAUSE_S

log = logging.getLogger(__name__)

_END = object()


@dataclass(frozen=True)
class HostRequest:
    """Where a hosted object runs: a node of `pool` (any node when None) with these resources held for it."""

    pool: str | None
    gpus: int = 0
    cpus: float = 1.0

    def bundle(self) -> dict[str, float]:
        return {"CPU": self.cpus, **({"GPU": float(self.gpus)} if self.gpus else {})}


@ray.remote(max_concurrency=8)
class _Host:
    def __init__(self, factory: type, args: tuple, env: dict[str, str], sharing: int) -> None:
        os.environ.update(env)  # a Ray node's processes have that node's environment, not the flow's
        if warning := take_cpu_share(sharing, env):
            log.warning("%s", warning)
        self._factory, self._args = factory, args
        self._built: Any = None

    @property
    def _object(self) -> Any:
        # Built at the first call, not in __init__: Ray keeps only the text of an error raised while an actor is
        # created, while a call's error reaches the caller as itself (a user's ValueError stays fatal).
        if self._built is None:
            self._built = self._factory(*self._args)
        return self._built

    def build(self) -> None:
        """Build the object now (its constructor's exception reaches the caller as itself)."""
        assert self._object is not None

    def place(self) -> NodePlace:
        gpu_ids = tuple(str(g) for g in ray.get_gpu_ids())
        return NodePlace(0, ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), gpu_ids)

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self._object, method)(*args)

    def stream(self, method: str, *args: Any):
        lines: queue.SimpleQueue = queue.SimpleQueue()
        outcome: dict[str, Any] = {}

        def run() -> None:
            try:
                outcome["value"] = getattr(self._object, method)(*args, log=lines.put)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller as the call's error
                outcome["error"] = exc
            lines.put(_END)

        threading.Thread(target=run, name=f"hosted-{method}", daemon=True).start()
        while True:
            batch = [lines.get()]
            while not lines.empty():
                batch.append(lines.get())
            ended = batch[-1] is _END
            if batch := [line for line in batch if line is not _END]:
                yield ("log", batch)
            if ended:
                break
        if "error" in outcome:
            raise outcome["error"]
        yield ("value", outcome.get("value"))


class StreamCall:
    """One `stream` call in progress: its lines go to `log` as they come; `wait` gives its value."""

    def __init__(self, host: Hosted, method: str, args: tuple, log_sink) -> None:
        self.host = host
        self._done = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None
        self._log = log_sink
        self._thread = threading.Thread(
            target=self._relay, args=(method, args), name=f"hosted-{host.name}-{method}", daemon=True
        )
        self._thread.start()

    def _relay(self, method: str, args: tuple) -> None:
        try:
            for ref in self.host.actor.stream.options(num_returns="streaming").remote(method, *args):
                kind, payload = ray.get(ref)
                if kind == "log":
                    for line in payload:
                        self._log(line)
                else:
                    self._value = payload
        except ray.exceptions.RayTaskError as exc:  # the method raised: its own exception
            self._error = exc.as_instanceof_cause()
        except Exception as exc:  # noqa: BLE001 - the actor or its node is gone
            self.host.mark_lost(_first_line(exc))
            self._error = exc
        finally:
            self._done.set()

    def wait(self, timeout: float) -> tuple[bool, Any]:
        """(True, value) once the call ended (its exception raised), (False, None) while it runs."""
        if not self._done.wait(timeout):
            return False, None
        if self._error is not None:
            raise self._error
        return True, self._value


class HostLost(RetryableStageError):
    """A hosted object cannot be reached any more: its actor or its node died."""


class HostGroup:
    """Room for hosted objects on `nodes` nodes of a pool: one placement group, one bundle per node (STRICT_SPREAD)
    holding `per_node` objects' resources; object `k` goes into bundle `k // per_node`. Ray re-places a dead
    node's bundles on a live node when it can, so a replacement can be hosted in the same slot."""

    def __init__(self, group, request: HostRequest, per_node: int, name: str) -> None:
        self.group = group
        self.request = request
        self.per_node = per_node
        self.name = name

    @classmethod
    def reserve(
        cls, cluster: ComputeCluster, request: HostRequest, nodes: int, per_node: int, wait_s: float, name: str
    ) -> HostGroup:
        """Reserve the group; PlacementUnavailable when the cluster cannot give it within `wait_s`."""
        selector = [{POOL_LABEL: request.pool}] * nodes if request.pool else None
        bundle = {key: value * per_node for key, value in request.bundle().items()}
        group = placement_group(
            [dict(bundle) for _ in range(nodes)],
            strategy="STRICT_SPREAD" if nodes > 1 else "PACK",
            bundle_label_selector=selector,
            name=f"forgeflow-{name}",
        )
        ready, _ = ray.wait([group.ready()], timeout=wait_s)
        if not ready:
            remove_placement_group(group)
            where = f"node(s) of pool {request.pool!r}" if request.pool else "node(s)"
            raise PlacementUnavailable(
                f"{name}: the cluster could not give {nodes} {where} with {request.gpus * per_node} GPU(s) and "
                f"{request.cpus * per_node:g} CPU(s) each within {wait_s:g} s; {cluster.describe_pool(request.pool)}. "
                "Fix: add or free nodes of the pool, or ask for fewer nodes or GPUs"
            )
        return cls(group, request, per_node, name)

    def host(
        self, index: int, factory: type, args: tuple, name: str, restarts: int = 0, env: Mapping[str, str] | None = None
    ) -> Hosted:
        """Build `factory(*args)` in slot `index`; raises the constructor's exception when it fails.
        `restarts`: how often Ray rebuilds it in its slot after its process or node died (see `Hosted.revive`).
        `env` is set in the object's process before it is built."""
        actor = _Host.options(
            max_restarts=restarts,
            runtime_env={"env_vars": process_start_environment()},
            num_cpus=0,  # the bundle holds the CPUs (forge_core.compute.tuning)
            num_gpus=self.request.gpus,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.group, placement_group_bundle_index=index // self.per_node
            ),
        ).remote(factory, args, {**(env or {}), **flow_thread_setting()}, self.per_node)
        try:
            _get(actor.build.remote(), name)
            place = _get(actor.place.remote(), name)
        except BaseException:
            ray.kill(actor)
            raise
        return Hosted(actor, None, place, name)

    def close(self) -> None:
        """Give the group's resources back (its objects are closed first by their owner)."""
        try:
            remove_placement_group(self.group)
        except Exception as exc:  # noqa: BLE001 - already removed
            log.debug("%s: placement group already removed: %s", self.name, exc)


def _get(ref, name: str, timeout: float | None = None) -> Any:
    """A call's value; the method's own exception when it raised, HostLost when its actor or node died."""
    try:
        return ray.get(ref, timeout=timeout)
    except ray.exceptions.RayTaskError as exc:
        raise exc.as_instanceof_cause() from None
    except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, ray.exceptions.NodeDiedError) as exc:
        raise HostLost(f"{name}: {_first_line(exc)}") from None


def call_all(actors: list, method: str, args: list[tuple], names: list[str], timeout_s: float) -> list:
    """`method(*args[k])` on each `actors[k]` (Hosted.actor) at once, from any process; their values in order.
    Raises the first method's own exception, TimeoutError naming the calls not done within `timeout_s`, or
    HostLost when an actor or its node died."""
    refs = [actor.call.remote(method, *arguments) for actor, arguments in zip(actors, args, strict=True)]
    try:
        return _get(refs, ", ".join(names), timeout_s)
    except ray.exceptions.GetTimeoutError:
        late = [name for name, ref in zip(names, refs) if not ray.wait([ref], timeout=0)[0]]
        raise TimeoutError(f"{', '.join(late)}: {method} not done within {timeout_s:g} s") from None


def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:300]}"


class Hosted:
    """The driver's handle on one hosted object (module docstring)."""

    def __init__(self, actor, group: HostGroup | None, place: NodePlace, name: str) -> None:
        self.actor = actor
        self.group = group  # the group this handle owns (Hosted.start), None when a HostGroup's owner closes it
        self.place = place
        self.name = name
        self._lost: str | None = None

    @classmethod
    def start(
        cls,
        cluster: ComputeCluster,
        request: HostRequest,
        factory: type,
        args: tuple,
        wait_s: float,
        name: str,
    ) -> Hosted:
        """Place and build the object in a group of its own, which `close` removes; PlacementUnavailable when no
        node of the pool had the resources within `wait_s`."""
        group = HostGroup.reserve(cluster, request, nodes=1, per_node=1, wait_s=wait_s, name=name)
        try:
            hosted = group.host(0, factory, args, name)
        except BaseException:
            group.close()
            raise
        hosted.group = group
        return hosted

    def stream(self, method: str, *args: Any, log_sink) -> StreamCall:
        return StreamCall(self, method, args, log_sink)

    def call(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        """The object's `method(*args)`; HostLost (and marked lost) when the actor or its node died."""
        try:
            return _get(self.actor.call.remote(method, *args), self.name, timeout)
        except HostLost as exc:
            self.mark_lost(str(exc))
            raise

    def revive(self, timeout_s: float) -> NodePlace:
        """Wait until Ray has rebuilt a lost object (HostGroup.host's `restarts`); where it runs now. HostLost when
        no restarts are left or it is not back within `timeout_s`. Retries while calls are refused as "temporarily
        unavailable", which lasts until the cluster declares the dead node dead."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            try:
                self.place = ray.get(self.actor.place.remote(), timeout=max(left, 0.0))
                self._lost = None
                return self.place
            except ray.exceptions.ActorUnavailableError as exc:
                if time.monotonic() >= deadline:
                    raise HostLost(f"{self.name}: not back within {timeout_s:g} s: {_first_line(exc)}") from None
                time.sleep(ACTOR_REVIVE_PAUSE_S)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
                raise HostLost(f"{self.name}: not coming back: {_first_line(exc)}") from None

    def mark_lost(self, why: str) -> None:
        self._lost = self._lost or why

    def lost(self) -> str | None:
        return self._lost

    def close(self, timeout: float, *args: Any) -> None:
        """The object's `close(*args)` (bounded by `timeout`), then the actor (and the group it owns) end."""
        if self._lost is None:
            try:
                self.call("close", *args, timeout=timeout)
            except Exception as exc:  # noqa: BLE001 - ended below either way
                log.warning("%s: its close did not finish (%s); ending it", self.name, type(exc).__name__)
        try:
            ray.kill(self.actor)
        except Exception as exc:  # noqa: BLE001 - already gone
            log.debug("%s: actor already gone: %s", self.name, exc)
        if self.group is not None:
            self.group.close()
