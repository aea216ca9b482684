"""Data parallel generation: several vLLM engines, each in its own process, splitting the prompts.

    with open_generator(policy_dir, sampling, engine, num_engines=2) as gen:   # a GeneratorPool
        samples = gen.generate(prompts, seed=7)      # same samples as one engine (per-prompt seeds)

`open_generator` returns a plain in-process `Generator` for one engine. For several, each replica is a
spawned process that owns one `Generator`; it gets its own environment before vLLM is imported, so each
engine has its own cores on CPU (`VLLM_CPU_OMP_THREADS_BIND`) or its own GPUs (`CUDA_VISIBLE_DEVICES`,
`tensor_parallel_size` GPUs each). Prompts are cut into contiguous shards, one per replica, and the replicas
generate concurrently.
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
from typing import Any, Self

from forge_core.config.schema import SamplingConfig
from forge_core.rollout.engine import EngineOptions, on_cpu
from forge_core.rollout.generator import Generator, check_prompt_lengths
from forge_core.rollout.types import Prompt, Sample

log = logging.getLogger(__name__)


class ReplicaError(RuntimeError):
    """A replica process failed; the message carries its traceback."""


def open_generator(
    policy_dir: str | Path, sampling: SamplingConfig, engine: EngineOptions, num_engines: int = 1
) -> Generator | GeneratorPool:
    """One engine in this process, or a pool of `num_engines` replica processes (same interface)."""
    if num_engines < 1:
        raise ValueError(f"rollout.num_engines={num_engines}: must be >= 1")
    if num_engines == 1:
        return Generator(policy_dir, sampling, engine)
    return GeneratorPool(policy_dir, sampling, engine, num_engines)


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
    import torch

    devices = _visible_gpus(torch.cuda.device_count())
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


def _visible_gpus(count: int) -> list[str]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        return [d.strip() for d in visible.split(",") if d.strip()]
    return [str(i) for i in range(count)]


def shard_bounds(num_items: int, num_shards: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) ranges, sizes differing by at most one."""
    base, extra = divmod(num_items, num_shards)
    bounds, start = [], 0
    for index in range(num_shards):
        end = start + base + (1 if index < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


class GeneratorPool:
    """`num_engines` Generator replicas in spawned processes, behind the Generator interface."""

    def __init__(
        self, policy_dir: str | Path, sampling: SamplingConfig, engine: EngineOptions, num_engines: int
    ):
        self.policy_dir = Path(policy_dir)
        self.sampling = sampling
        self.engine = engine
        self._replicas: list[_Replica] = []
        context = mp.get_context("spawn")
        try:
            # Start every replica first, then wait: their start-ups overlap.
            for index, layout in enumerate(replica_layouts(engine, num_engines)):
                self._replicas.append(_Replica.start(context, index, self.policy_dir, sampling, layout))
            startups = [replica.wait_ready() for replica in self._replicas]
        except BaseException:
            self.close()
            raise
        self.startup_s = max(startups)
        self.max_model_len = self._replicas[0].max_model_len

    def generate(
        self, prompts: Sequence[Prompt], seed: int, sampling: SamplingConfig | None = None
    ) -> list[Sample]:
        check_prompt_lengths(prompts, sampling or self.sampling, self.max_model_len)
        shards = [prompts[start:end] for start, end in shard_bounds(len(prompts), len(self._replicas))]
        busy = [
            (replica, replica.send("generate", list(shard), seed, sampling))
            for replica, shard in zip(self._replicas, shards)
            if shard
        ]
        return [sample for replica, _ in busy for sample in replica.receive()]

    def reload(self, policy_dir: str | Path | None = None) -> float:
        for replica in self._replicas:
            replica.send("reload", None if policy_dir is None else str(policy_dir))
        seconds = max(replica.receive() for replica in self._replicas)
        if policy_dir is not None:
            self.policy_dir = Path(policy_dir)
        return seconds

    def close(self) -> None:
        replicas, self._replicas = self._replicas, []
        for replica in replicas:
            replica.stop()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


@dataclasses.dataclass
class _Replica:
    index: int
    process: Any
    conn: Connection
    max_model_len: int = 0

    @classmethod
    def start(cls, context, index: int, policy_dir: Path, sampling, layout: ReplicaLayout):
        parent, child = context.Pipe()
        process = context.Process(
            target=_replica_main,
            args=(child, str(policy_dir), sampling, layout),
            name=f"forge-rollout-replica-{index}",
            daemon=False,  # it spawns vLLM's own processes, which daemonic processes may not do
        )
        process.start()
        child.close()
        return cls(index=index, process=process, conn=parent)

    def wait_ready(self) -> float:
        status, payload = self._recv()
        if status != "ready":
            raise ReplicaError(f"rollout replica {self.index} failed to start:\n{payload}")
        startup_s, self.max_model_len = payload
        return startup_s

    def send(self, method: str, *args) -> None:
        self.conn.send((method, args))

    def receive(self):
        status, payload = self._recv()
        if status == "ok":
            return payload
        exc, formatted = payload
        failure = ReplicaError(f"rollout replica {self.index} failed:\n{formatted}")
        if isinstance(exc, ValueError):
            # A user error (bad prompt, bad folder) stays a ValueError, so the launcher does not retry it.
            raise exc from failure
        raise failure

    def _recv(self):
        try:
            return self.conn.recv()
        except EOFError as exc:
            self.process.join(timeout=1)
            raise ReplicaError(
                f"rollout replica {self.index} (pid {self.process.pid}) died with exit code "
                f"{self.process.exitcode}"
            ) from exc

    def stop(self) -> None:
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


def _replica_main(conn: Connection, policy_dir: str, sampling: SamplingConfig, layout: ReplicaLayout) -> None:
    """Body of a replica process: own cores and environment, one Generator, then serve calls until closed."""
    layout.apply()
    options = layout.options
    try:
        generator = Generator(policy_dir, sampling, options)
    except BaseException:  # noqa: BLE001 - whatever stops the start-up is reported to the parent
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", (generator.startup_s, generator.max_model_len)))
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
