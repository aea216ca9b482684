"""Evaluation on held-out prompts: greedy accuracy (pass_k = 1) or pass@k, scored by the run's rewards.

    sampling = evaluation_sampling(cfg.eval, cfg.rollout.sampling)
    outcome = evaluate(generator, prompts, rewards, sampling, seed=cfg.seed)
    outcome.table        # results.parquet: one row per prompt
    outcome.metrics      # accuracy, mean_reward, n, k, ...

A prompt passes when one of its k samples reaches PASS_THRESHOLD on the primary (first) reward component (the
plain pass@k estimate). `accuracy` is the share of prompts that pass, `mean_reward` the mean total reward.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from forge_core.config.schema import SamplingConfig
from forge_core.rewards import TOTAL_COLUMN, RewardSet, sample_context
from forge_core.rollout.protocol import GenerationEngine
from forge_core.rollout.table import PASS_THRESHOLD
from forge_core.rollout.types import Prompt, Sample

RESULTS_TABLE = "results.parquet"


@dataclass(frozen=True)
class EvalOutcome:
    table: pa.Table
    metrics: dict[str, float]


def results_schema(reward_columns: Sequence[str]) -> pa.Schema:
    per_sample = [pa.field(c, pa.list_(pa.float64()), nullable=False) for c in reward_columns]
    return pa.schema(
        [
            pa.field("prompt_id", pa.string(), nullable=False),
            pa.field("prompt", pa.string(), nullable=False),
            pa.field("ground_truth", pa.string(), nullable=False),
            pa.field("responses", pa.list_(pa.string()), nullable=False),
            pa.field("finish_reasons", pa.list_(pa.string()), nullable=False),
            pa.field("response_lens", pa.list_(pa.int32()), nullable=False),
            *per_sample,
            pa.field(TOTAL_COLUMN, pa.list_(pa.float64()), nullable=False),
            pa.field("passed", pa.bool_(), nullable=False),
            pa.field("mean_reward", pa.float64(), nullable=False),
        ]
    )


def evaluate(
    generator: GenerationEngine,
    prompts: Sequence[Prompt],
    rewards: RewardSet,
    sampling: SamplingConfig,
    seed: int,
) -> EvalOutcome:
    """Generate `sampling.group_size` samples per prompt, score them, and summarise per prompt."""
    start = time.perf_counter()
    samples = generator.generate(prompts, sampling, seed)
    return score_evaluation(prompts, samples, rewards, sampling, time.perf_counter() - start)


def score_evaluation(
    prompts: Sequence[Prompt],
    samples: Sequence[Sample],
    rewards: RewardSet,
    sampling: SamplingConfig,
    generation_s: float,
) -> EvalOutcome:
    """Score `sampling.group_size` samples (or episodes) per prompt and summarise per prompt."""
    scored = rewards.score(
        [s.response_text for s in samples],
        [s.ground_truth for s in samples],
        [s.ref for s in samples],
        contexts=[sample_context(s, sampling.max_new_tokens) for s in samples],
    )
    table = results_table(
        prompts, samples, scored.columns, scored.total, sampling.group_size, rewards.primary_column
    )
    metrics = evaluation_metrics(table, rewards.columns, generation_s)
    metrics["k"] = float(sampling.group_size)
    metrics["temperature"] = float(sampling.temperature)
    return EvalOutcome(table=table, metrics=metrics)


def results_table(
    prompts: Sequence[Prompt],
    samples: Sequence[Sample],
    reward_columns: dict[str, list[float]],
    totals: list[float],
    k: int,
    primary_column: str,
) -> pa.Table:
    """One row per prompt; sample j of prompt i is `samples[i * k + j]` (the generator's order)."""
    if len(samples) != len(prompts) * k:
        raise ValueError(f"results_table: {len(samples)} samples for {len(prompts)} prompts x k={k}")
    rows = [slice(i * k, (i + 1) * k) for i in range(len(prompts))]
    for prompt, row in zip(prompts, rows):
        assert all(s.prompt_id == prompt.prompt_id for s in samples[row]), (
            f"samples out of order at {prompt.prompt_id}"
        )
    columns = {
        "prompt_id": [p.prompt_id for p in prompts],
        "prompt": [p.text for p in prompts],
        "ground_truth": [p.ground_truth for p in prompts],
        "responses": [[s.response_text for s in samples[row]] for row in rows],
        "finish_reasons": [[s.finish_reason for s in samples[row]] for row in rows],
        "response_lens": [[s.response_len for s in samples[row]] for row in rows],
        **{name: [values[row] for row in rows] for name, values in reward_columns.items()},
        TOTAL_COLUMN: [totals[row] for row in rows],
        "passed": [max(reward_columns[primary_column][row]) >= PASS_THRESHOLD for row in rows],
        "mean_reward": [float(np.mean(totals[row])) for row in rows],
    }
    return pa.Table.from_pydict(columns, schema=results_schema(list(reward_columns)))


def evaluation_metrics(
    table: pa.Table, reward_columns: Sequence[str], generation_s: float
) -> dict[str, float]:
    totals = np.concatenate([np.asarray(v, dtype=np.float64) for v in table.column(TOTAL_COLUMN).to_pylist()])
    lengths = np.concatenate(
        [np.asarray(v, dtype=np.int64) for v in table.column("response_lens").to_pylist()]
    )
    reasons = [r for row in table.column("finish_reasons").to_pylist() for r in row]
    metrics = {
        "n": float(table.num_rows),
        "accuracy": float(np.mean(table.column("passed").to_pylist())),
        "mean_reward": float(totals.mean()),
        "response_len_mean": float(lengths.mean()),
        "truncated_fraction": float(np.mean([r == "length" for r in reasons])),
        "generation_s": generation_s,
        "tokens_per_s": float(lengths.sum()) / generation_s if generation_s > 0 else 0.0,
    }
    for column in reward_columns:
        values = [x for row in table.column(column).to_pylist() for x in row]
        metrics[f"{column}_mean"] = float(np.mean(values))
    return metrics
