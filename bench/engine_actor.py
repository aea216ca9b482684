"""The run's engine actor: per-call cost against an in-process Generator, and start-up against reload.

    python -m bench.engine_actor              # about 5 min on 2 busy shared cores
    python -m bench.engine_actor --quick      # fewer repeats

One process drives both sides on the same model (a Llama of dim 256, 4 layers, the demo tokenizer), the same
engine settings (vLLM in-process engine, fp32) and the same prompts (32 demo prompts x 8 samples x 16 new
tokens, temperature 1, per-prompt seeds: one demo rollout batch), alternating calls after a warm-up:
- value:    `EngineRouter.generate` over one engine actor on the embedded Ray cluster (forge_core.rollout.
            actor_engines: prompts and samples through Ray, the engine in an actor process), as rollout and
            evaluate stages sample;
- baseline: `Generator.generate` in this process: target <= 1.10x.
`details` also holds the same comparison for a single-prompt call (the fixed per-call cost), the actor's start-up
(the embedded cluster's start, the placement, the actor's process, imports, the engine) and its in-place reload
time (`reload` to another version).
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


def committed_policy(store, policy_dir: Path) -> str:
    """`policy_dir` committed as a training stage commits its policy; the stage's URI."""
    stage_uri = store.artifact_uri("sft", "bench-policy")
    policy = store.writer(store.join(stage_uri, "policy"), kind="policy", stage="sft")
    for path in sorted(policy_dir.iterdir()):
        policy.put_file(path, path.name)
    policy.commit(config={}, inputs={}, metrics={})
    stage = store.writer(stage_uri, kind="sft", stage="sft")
    stage.write_json("train_summary.json", {"metrics": {}})
    stage.commit(config={}, inputs={}, metrics={})
    return stage_uri


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    repeats = 3 if args.quick else 7

    from forge_core.artifacts.policy import fetch_policy
    from forge_core.compute.cluster import connect
    from forge_core.config import config_from_dict
    from forge_core.rollout import EngineOptions, Generator
    from forge_core.rollout.actor_engines import EngineActors
    from forge_core.storage import ObjectStore

    with tempfile.TemporaryDirectory(prefix="forge-bench-engine-") as tmp:
        root = Path(tmp)
        tokenizer, examples = demo_tokenizer(root / "tokenizer")
        policy_a = root / "policy-a"
        params = write_model(policy_a, root / "tokenizer", tokenizer, *MODEL_SIZE)
        policy_b = perturbed_copy(policy_a, root / "policy-b")
        prompts = bench_prompts(tokenizer, examples)
        sampling = sampling_config()
        cfg = config_from_dict({
            "storage": {"root": f"file://{root}/store"},
            "logging": {"dir": str(root / "runs")},
            "rollout": {"sampling": sampling.model_dump(), "engine_in_process": True, "kv_cache_gib": 1},
        })  # fmt: skip
        store = ObjectStore.from_config(cfg.storage)
        policy = fetch_policy(store, committed_policy(store, policy_a), cache_root=root / "cache")

        start = time.perf_counter()
        cluster = connect(None)
        cluster_startup_s = time.perf_counter() - start
        engines = EngineActors.start(cluster, cfg, seed=0)
        try:
            start = time.perf_counter()
            router = engines.serve(policy)
            actor_startup_s = time.perf_counter() - start
            (engine,) = router.live
            engine_startup_in_actor_s = engine.startup_s
            reloads = []
            for round_index in range(repeats):
                target, version = (policy_b, "version-b") if round_index % 2 == 0 else (policy_a, "version-a")
                start = time.perf_counter()
                router.reload(target, version)
                reloads.append({"load_call_s": time.perf_counter() - start, "reload_s": router.reload_s})
            router.reload(policy.local_dir, policy.version)

            local = Generator(policy.local_dir, EngineOptions.from_config(cfg.rollout), policy_version=policy.version)
            seeds = iter(range(10**6))

            def through_actor(batch):
                return lambda: router.generate(batch, sampling, next(seeds))

            def in_process(batch):
                return lambda: local.generate(batch, sampling, next(seeds))

            batch_actor, batch_local = alternate(through_actor(prompts), in_process(prompts), warmup=1, repeats=repeats)
            one_actor, one_local = alternate(
                through_actor(prompts[:1]), in_process(prompts[:1]), warmup=1, repeats=repeats
            )
            local.close()
        finally:
            engines.close()
            cluster.close()

    value, baseline = median(batch_actor), median(batch_local)
    write_result(
        "engine_actor",
        value,
        baseline,
        target="<=1.10",
        unit="s/rollout batch",
        details={
            "model_params": params,
            "batch": f"{len(prompts)} prompts x {sampling.group_size} samples x {sampling.max_new_tokens} tokens",
            "batch_overhead_s": value - baseline,
            "batch_actor_s": summarize(batch_actor),
            "batch_in_process_s": summarize(batch_local),
            "single_prompt_overhead_s": median(one_actor) - median(one_local),
            "single_prompt_actor_s": summarize(one_actor),
            "single_prompt_in_process_s": summarize(one_local),
            "embedded_cluster_startup_s": cluster_startup_s,
            "actor_startup_s": actor_startup_s,
            "engine_startup_in_actor_s": engine_startup_in_actor_s,
            "in_process_generator_startup_s": local.startup_s,
            "reload_s": summarize([r["reload_s"] for r in reloads]),
            "load_call_s": summarize([r["load_call_s"] for r in reloads]),
            "startup_over_reload": actor_startup_s / statistics.median(r["load_call_s"] for r in reloads),
        },
    )


if __name__ == "__main__":
    main()
