"""The long-lived engine service: per-call cost against an in-process Generator, and start-up against reload.

    python -m bench.engine_service            # about 5 min on 2 busy shared cores
    python -m bench.engine_service --quick    # fewer repeats

One process drives both sides on the same model (a Llama of dim 256, 4 layers, the demo tokenizer), the same
engine settings (vLLM in-process engine, fp32) and the same prompts (32 demo prompts x 8 samples x 16 new
tokens, temperature 1, per-prompt seeds: one demo rollout batch), alternating calls after a warm-up:
- value:    `EngineClient.generate` through the service (forge_core.rollout.service: a Unix socket, pickled
            prompts and samples, the engine in another process);
- baseline: `Generator.generate` in this process (what `engine_lifetime: stage` runs): target <= 1.10x.
`details` also holds the same comparison for a single-prompt call (the fixed per-call cost), the service's
start-up (process start, imports, engine) and its in-place reload time (`reload` to another version).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.harness import alternate, median, summarize, write_result
from bench.rollout_throughput import bench_prompts, demo_tokenizer, sampling_config, write_model

MODEL_SIZE = (256, 4)  # (dim, layers)


def perturbed_copy(source: Path, target: Path) -> Path:
    """`source` with other weights (same architecture and tokenizer): the next policy version."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    generator = torch.Generator().manual_seed(1)
    weights = load_file(source / "model.safetensors")
    save_file(
        {k: v + 0.01 * torch.randn(v.shape, generator=generator) for k, v in weights.items()},
        target / "model.safetensors",
        metadata={"format": "pt"},
    )
    return target


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    repeats = 3 if args.quick else 7

    from forge_core.config.schema import RolloutConfig
    from forge_core.rollout import EngineOptions, Generator
    from forge_core.rollout.service import EngineService, stop_services

    with tempfile.TemporaryDirectory(prefix="forge-bench-engine-") as tmp:
        root = Path(tmp)
        tokenizer, examples = demo_tokenizer(root / "tokenizer")
        policy_a = root / "policy-a"
        params = write_model(policy_a, root / "tokenizer", tokenizer, *MODEL_SIZE)
        policy_b = perturbed_copy(policy_a, root / "policy-b")
        prompts = bench_prompts(tokenizer, examples)
        sampling = sampling_config()
        rollout = RolloutConfig(sampling=sampling, engine_in_process=True, kv_cache_gib=1)
        state_dir = root / "engines"
        try:
            start = time.perf_counter()
            client = EngineService.ensure(state_dir, rollout, policy_a, "version-a")
            service_startup_s = time.perf_counter() - start
            engine_startup_in_service_s = client.ping()["engine_startup_s"]
            reloads = []
            for round_index in range(repeats):
                target, version = (policy_b, "version-b") if round_index % 2 == 0 else (policy_a, "version-a")
                start = time.perf_counter()
                client.reload(target, version)
                reloads.append({"load_call_s": time.perf_counter() - start, "reload_s": client.reload_s})
            client.reload(policy_a, "version-a")

            local = Generator(policy_a, EngineOptions.from_config(rollout), policy_version="version-a")
            seeds = iter(range(10**6))

            def through_service(batch):
                return lambda: client.generate(batch, sampling, next(seeds))

            def in_process(batch):
                return lambda: local.generate(batch, sampling, next(seeds))

            batch_service, batch_local = alternate(
                through_service(prompts), in_process(prompts), warmup=1, repeats=repeats
            )
            one_service, one_local = alternate(
                through_service(prompts[:1]), in_process(prompts[:1]), warmup=1, repeats=repeats
            )
            local.close()
            client.close()
        finally:
            stop_services(state_dir)

    value, baseline = median(batch_service), median(batch_local)
    write_result(
        "engine_service",
        value,
        baseline,
        target="<=1.10",
        unit="s/rollout batch",
        details={
            "model_params": params,
            "batch": f"{len(prompts)} prompts x {sampling.group_size} samples x {sampling.max_new_tokens} tokens",
            "batch_overhead_s": value - baseline,
            "batch_service_s": summarize(batch_service),
            "batch_in_process_s": summarize(batch_local),
            "single_prompt_overhead_s": median(one_service) - median(one_local),
            "single_prompt_service_s": summarize(one_service),
            "single_prompt_in_process_s": summarize(one_local),
            "service_startup_s": service_startup_s,
            "engine_startup_in_service_s": engine_startup_in_service_s,
            "in_process_generator_startup_s": local.startup_s,
            "reload_s": summarize([r["reload_s"] for r in reloads]),
            "load_call_s": summarize([r["load_call_s"] for r in reloads]),
            "startup_over_reload": service_startup_s / statistics.median(r["load_call_s"] for r in reloads),
        },
    )


if __name__ == "__main__":
    main()
