"""Data parallel generation for one stage: several vLLM engines, each in a replica process of its own, behind one
EngineRouter (router.py) that splits the prompts over pipes.

    with open_generator(policy_dir, engine, num_engines=2, policy_version=v) as gen:   # an EngineRouter
        samples = gen.generate(prompts, sampling, seed=7)   # the same samples as one engine (per-prompt seeds)

`open_generator` returns a plain in-process `Generator` for one engine. For several, each replica is a
spawned process that owns one `Generator`; it gets its own environment before vLLM is imported, so each
engine has its own cores on CPU (`VLLM_CPU_OMP_THREADS_BIND`) or its own GPUs (`CUDA_VISIBLE_DEVICES`,
`tensor_parallel_size` GPUs each): `replica_layouts`, which the flow's engine services use too. The replicas
start concurrently and generate concurrently; one that dies is dropped and its prompts go to the others
(router.py). Closing the router ends the replica processes.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import pickle
import traceback
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from forge_core.config.schema import SamplingConfig
from forge_core.launch.devices import visible_devices
from forge_core.rollout.engine import EngineOptions, on_cpu
from forge_core.rollout.generator import Generator
from forge_core.rollout.protocol import EngineLost, GenerationEngine
from forge_core.rollout.router import EngineRouter
from forge_core.rollout.types import Prompt, Sample

log = logging.getLogger(__name__)


class ReplicaError(EngineLost):
    """A replica process failed to start, died, or its engine failed; the message carries its traceback."""


def open_generator(
    policy_dir: str | Path, engine: EngineOptions, num_engines: int = 1, *, policy_version: str
) -> GenerationEngine:
    """One engine in this process (a Generator), or `num_engines` replica processes behind an EngineRouter."""
    if num_engines < 1:
        raise ValueError(f"rollout.num_engines={num_engines}: must be >= 1")
    if num_engines == 1:
        return Generator(policy_dir, engine, policy_version=policy_version)
    return start_pool(policy_dir, engine, num_engines, policy_version=policy_version)


@dataclasses.dataclass(frozen=True)
class ReplicaLayout:
    """What one replica process gets: its engine options, extra environment, and (CPU) the cores it may use."""

    options: EngineOptions
    env: dict[str, str]
    cpus: tuple[int, ...] | None = None

    def apply(self) -> None:
        """Give this process the replica's environment and cores; call before vLLM is imported (its
        scheduler and worker processes inherit both)."""
        os.environ.update(self.env)
        if self.cpus is not None:
            os.sched_setaffinity(0, self.cpus)


def replica_layouts(engine: EngineOptions, num_engines: int) -> list[ReplicaLayout]:
    """Disjoint cores per replica on CPU (the replica process, its scheduler and its worker all stay on
    them, and `cpu_threads` applies within them), disjoint GPUs per replica otherwise."""
    if on_cpu():
        if engine.cpu_threads not in ("all", "auto"):
            raise ValueError(
                f"rollout.cpu_threads={engine.cpu_threads!r} with rollout.num_engines={num_engines}: each engine "
                "gets its own share of the cores; use cpu_threads=auto or all with several engines"
            )
        cpus = sorted(os.sched_getaffinity(0))
        per_replica = len(cpus) // num_engines
        if per_replica < engine.tensor_parallel_size:
            raise ValueError(
                f"rollout.num_engines={num_engines} x tensor_parallel_size={engine.tensor_parallel_size} "
                f"needs at least that many CPUs; this process may use {len(cpus)}"
            )
        shares = [tuple(cpus[i * per_replica : (i + 1) * per_replica]) for i in range(num_engines)]
        return [ReplicaLayout(engine, {}, share) for share in shares]
    devices = visible_devices()
    needed = num_engines * engine.tensor_parallel_size
    if len(devices) < needed:
        raise ValueError(
            f"rollout.num_engines={num_engines} x tensor_parallel_size={engine.tensor_parallel_size} = "
            f"{needed} GPUs, but {len(devices)} are visible ({devices}); lower one of them"
        )
    tp = engine.tensor_parallel_size
    return [
        ReplicaLayout(engine, {"CUDA_VISIBLE_DEVICES": ",".join(devices[i * tp : (i + 1) * tp])})
        for i in range(num_engines)
    ]


def start_pool(
    policy_dir: str | Path, engine: EngineOptions, num_engines: int, *, policy_version: str
) -> EngineRouter:
    """`num_engines` replica processes, each with its own Generator on its share of the machine, behind one
    EngineRouter; closing the router ends them."""
    context = mp.get_context("spawn")
    replicas: list[ReplicaClient] = []
    try:
        # Start every replica first, then wait: their start-ups overlap.
        for index, layout in enumerate(replica_layouts(engine, num_engines)):
            replicas.append(ReplicaClient.start(context, index, Path(policy_dir), policy_version, layout))
        for replica in replicas:
            replica.wait_ready()
    except BaseException:
        for replica in replicas:
            replica.close()
        raise
    return EngineRouter(replicas)


class ReplicaClient:
    """One replica process over a pipe: an EngineConnection (protocol.py) whose `close` ends the process."""

    def __init__(self, index: int, process: Any, conn: Connection, policy_version: str):
        self.index = index
        self.process = process
        self.conn = conn
        self.policy_version = policy_version
        self.startup_s = 0.0
        self.reload_s = 0.0

    @property
    def name(self) -> str:
        return f"replica-{self.index}"

    @property
    def pid(self) -> int:
        return int(self.process.pid)

    @classmethod
    def start(
        cls, context, index: int, policy_dir: Path, policy_version: str, layout: ReplicaLayout
    ) -> ReplicaClient:
        parent, child = context.Pipe()
        process = context.Process(
            target=_replica_main,
            args=(child, str(policy_dir), policy_version, layout),
            name=f"forge-rollout-replica-{index}",
            daemon=False,  # it spawns vLLM's own processes, which daemonic processes may not do
        )
        process.start()
        child.close()
        return cls(index, process, parent, policy_version)

    def wait_ready(self) -> None:
        self.startup_s = self._reply("start")

    def generate(self, prompts: Sequence[Prompt], sampling: SamplingConfig, seed: int) -> list[Sample]:
        return self._call("generate", list(prompts), sampling, seed)

    def reload(self, policy_dir: str | os.PathLike, policy_version: str) -> float:
        self.reload_s = self._call("reload", str(policy_dir), policy_version)
        self.policy_version = policy_version
        return self.reload_s

    def _call(self, method: str, *args):
        try:
            self.conn.send((method, args))
        except OSError as exc:  # the replica is gone: its end of the pipe is closed
            raise self._died() from exc
        return self._reply(method)

    def _reply(self, what: str):
        status, payload = self._recv()
        if status == "ok":
            return payload
        exc, formatted = payload
        failure = ReplicaError(f"rollout replica {self.index} failed to {what}:\n{formatted}")
        if isinstance(exc, ValueError):
            # A user error (bad prompt, bad folder) stays a ValueError, so the launcher does not retry it.
            raise exc from failure
        raise failure

    def _recv(self):
        try:
            return self.conn.recv()
        except (EOFError, OSError) as exc:
            raise self._died() from exc

    def _died(self) -> ReplicaError:
        self.process.join(timeout=1)
        return ReplicaError(
            f"rollout replica {self.index} (pid {self.process.pid}) died with exit code {self.process.exitcode}"
        )

    def close(self) -> None:
        """End the replica process (idempotent)."""
        if self.process.is_alive():
            try:
                self.conn.send(("close", ()))
            except (BrokenPipeError, OSError):
                pass
            self.process.join(timeout=60)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout=10)
        self.conn.close()


def _picklable(exc: BaseException) -> BaseException | None:
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001 - any failure to pickle means: send the traceback text only
        return None
    return exc


def _replica_main(conn: Connection, policy_dir: str, policy_version: str, layout: ReplicaLayout) -> None:
    """Body of a replica process: own cores and environment, one Generator, then serve calls until closed."""
    layout.apply()
    try:
        generator = Generator(policy_dir, layout.options, policy_version=policy_version)
    except BaseException as exc:  # noqa: BLE001 - whatever stops the start-up is reported to the parent
        conn.send(("error", (_picklable(exc), traceback.format_exc())))
        return
    conn.send(("ok", generator.startup_s))
    try:
        while True:
            method, args = conn.recv()
            if method == "close":
                return
            try:
                conn.send(("ok", getattr(generator, method)(*args)))
            except Exception as exc:  # noqa: BLE001 - the parent re-raises it (ValueError) or wraps it
                conn.send(("error", (_picklable(exc), traceback.format_exc())))
    except EOFError:
        return  # the parent went away
    finally:
        generator.close()
