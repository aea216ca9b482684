"""A long-lived object hosted on a node of a pool: the flow run's residents (engines, trainer job) on Ray.

    host = Hosted.start(cluster, HostRequest(pool="gpu-a", gpus=1), MyObject, args, wait_s=60, name="engines")
    call = host.stream("run", spec_uri)          # the object's run(spec_uri, log=...) on its node
    call.wait(1.0)                               # its return value once done, None while it runs
    host.call("stop_order", "deadline")          # another method, while `run` still runs
    host.lost()                                  # why the host is gone (its actor or node died), None while alive
    host.close()                                 # the object's close(), then the actor and its group end

The host is a Ray actor in a one-bundle placement group on a node of the pool (the bundle holds the GPUs the
object's work needs; Ray sets the actor's CUDA_VISIBLE_DEVICES to them), owned by the process that started it:
Ray ends it when that process dies. The object is built on the node from an importable class and arguments;
`stream` calls a method that takes a `log` keyword (a callable that takes one line) and sends its lines back
while it runs; `call` calls a method and returns its value. Methods run on the actor's threads, so `call` works
while a `stream` is in progress.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from forge_core.compute.cluster import POOL_LABEL, ComputeCluster
from forge_core.compute.gang import NodePlace, PlacementUnavailable, release_ray_thread_cap

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
    def __init__(self, factory: type, args: tuple) -> None:
        release_ray_thread_cap()
        self._object = factory(*args)

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
            self.host.mark_lost(f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:300]}")
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


class Hosted:
    """The driver's handle on one hosted object (module docstring)."""

    def __init__(self, actor, group, place: NodePlace, name: str) -> None:
        self.actor = actor
        self.group = group
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
        """Place and build the object (module docstring).

        Raises:
            PlacementUnavailable: no node of the pool had the resources within `wait_s`.
        """
        selector = [{POOL_LABEL: request.pool}] if request.pool else None
        group = placement_group([request.bundle()], bundle_label_selector=selector, name=f"forgeflow-{name}")
        ready, _ = ray.wait([group.ready()], timeout=wait_s)
        if not ready:
            remove_placement_group(group)
            where = f"a node of pool {request.pool!r}" if request.pool else "a node"
            raise PlacementUnavailable(
                f"{name}: the cluster could not give {where} with {request.gpus} GPU(s) and {request.cpus:g} CPU(s) "
                f"within {wait_s:g} s; {cluster.describe_pool(request.pool)}. Fix: add or free nodes of the pool, "
                "or lower its GPUs"
            )
        actor = _Host.options(
            num_cpus=0,
            num_gpus=request.gpus,
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0),
        ).remote(factory, args)
        try:
            place = ray.get(actor.place.remote())
        except Exception:
            ray.kill(actor)
            remove_placement_group(group)
            raise
        return cls(actor, group, place, name)

    def stream(self, method: str, *args: Any, log_sink) -> StreamCall:
        return StreamCall(self, method, args, log_sink)

    def call(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        return ray.get(self.actor.call.remote(method, *args), timeout=timeout)

    def mark_lost(self, why: str) -> None:
        self._lost = self._lost or why

    def lost(self) -> str | None:
        return self._lost

    def close(self, timeout: float, *args: Any) -> None:
        """The object's `close(*args)` (bounded by `timeout`), then the actor and its placement group end."""
        if self._lost is None:
            try:
                self.call("close", *args, timeout=timeout)
            except Exception as exc:  # noqa: BLE001 - ended below either way
                log.warning("%s: its close did not finish (%s); ending it", self.name, type(exc).__name__)
        try:
            ray.kill(self.actor)
        except Exception as exc:  # noqa: BLE001 - already gone
            log.debug("%s: actor already gone: %s", self.name, exc)
        try:
            remove_placement_group(self.group)
        except Exception as exc:  # noqa: BLE001 - already removed
            log.debug("%s: placement group already removed: %s", self.name, exc)
