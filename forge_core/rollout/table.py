"""The rollout table (`rollouts.parquet`): one row per sample, an explicit Arrow schema, and its statistics.

| column | type | meaning |
| --- | --- | --- |
| prompt_id | string | the data stage's id of the prompt (join key back to rl_prompts) |
| group_id | int64 | the prompt's position in the run's prompt stream (iteration * P + j) |
| sample_index | int32 | 0 .. group_size-1 within the group |
| prompt_ids, response_ids | list<int32> | the tokens the generator conditioned on and sampled |
| response_logprobs | list<float32> | the generator's logprob of each sampled token (vLLM raw_logprobs) |
| finish_reason | string | "stop" (EOS or stop string) or "length" (max_new_tokens) |
| prompt_len, response_len | int32 | token counts |
| response_text, ground_truth | string | what the rewards scored |
| reward_<name> | float64 | one column per reward component, unweighted |
| reward | float64 | the weighted sum of the components |
| policy_uri, policy_version | string | the policy artifact that sampled; the weights version served |
| iteration, seed | int32, int64 | the GRPO iteration (0-based) these rows train, and the rollout seed |
| policy_iteration | int32 | the sampling policy's index (SFT = 0, after GRPO iteration k = k+1) |
| sampling_params, reward_versions | string | JSON: sampling settings; {reward name: version} |
| sampling_round | int32 | the generation round (0; 1.. are dynamic sampling's extra rounds) |
| kept | bool | GRPO trains on this row (dynamic sampling keeps prompts_per_iteration groups; else all) |

With `rollout.env` a row is one episode and the table also has these columns (a single-turn table has none):

| column | type | meaning |
| --- | --- | --- |
| response_mask | list<int8> | 1 on the model's tokens (they carry loss), 0 on the environment's (context only) |
| turns | list<struct> | per turn: turn, role (model/env), text, start/end (into response_ids), tool, latency_s, error |
| num_turns, model_tokens | int32 | model turns; tokens the model generated |
| tool_calls, tool_errors, tool_timeouts | int32 | tool calls made; failed or malformed ones; ones past their timeout |
| end_reason | string | env (the environment ended it), turn_limit, token_limit |
| env_reward | float64 (null) | the environment's own reward (the `environment` reward component reads it) |
| environment | string | JSON: the environment, its tools/parser/package and the limits (lineage) |

`response_ids` then interleave model and environment tokens (logprob 0.0 on the latter), `response_text` is the
model's text of every turn, and `response_len` counts every token after the prompt.
A row's staleness is `iteration - policy_iteration` (0 in `grpo.mode: sync`). `policy_version` is the weights
checksum the engine confirmed serving when it generated the rows.

    table = rollout_table(samples, scored, lineage)
    metrics = rollout_metrics(table, primary_column="reward_exact_answer")
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from forge_core.rewards import TOTAL_COLUMN, ScoredRewards
from forge_core.rollout.types import Episode, Sample

TOKEN_IDS = pa.list_(pa.int32())
ROLLOUTS_TABLE = "rollouts.parquet"
# A sample "passes" when the primary (first) reward component scores at least this.
PASS_THRESHOLD = 1.0

_SAMPLE_FIELDS = [
    pa.field("prompt_id", pa.string(), nullable=False),
    pa.field("group_id", pa.int64(), nullable=False),
    pa.field("sample_index", pa.int32(), nullable=False),
    pa.field("prompt_ids", TOKEN_IDS, nullable=False),
    pa.field("response_ids", TOKEN_IDS, nullable=False),
    pa.field("response_logprobs", pa.list_(pa.float32()), nullable=False),
    pa.field("finish_reason", pa.string(), nullable=False),
    pa.field("prompt_len", pa.int32(), nullable=False),
    pa.field("response_len", pa.int32(), nullable=False),
    pa.field("response_text", pa.string(), nullable=False),
    pa.field("ground_truth", pa.string(), nullable=False),
]
_LINEAGE_FIELDS = [
    pa.field("policy_uri", pa.string(), nullable=False),
    pa.field("policy_version", pa.string(), nullable=False),
    pa.field("iteration", pa.int32(), nullable=False),
    pa.field("policy_iteration", pa.int32(), nullable=False),
    pa.field("seed", pa.int64(), nullable=False),
    pa.field("sampling_params", pa.string(), nullable=False),
    pa.field("reward_versions", pa.string(), nullable=False),
]
# Which generation round a row came from and whether GRPO trains on it (forge_core.rollout.dynamic).
ROUND_COLUMN = "sampling_round"
KEPT_COLUMN = "kept"
_SELECTION_FIELDS = [
    pa.field(ROUND_COLUMN, pa.int32(), nullable=False),
    pa.field(KEPT_COLUMN, pa.bool_(), nullable=False),
]
# Episodes only (forge_core.envs): the model-token mask the GRPO loss reads, and what happened per turn.
RESPONSE_MASK_COLUMN = "response_mask"
TURN_TYPE = pa.struct(
    [
        pa.field("turn", pa.int32(), nullable=False),
        pa.field("role", pa.string(), nullable=False),
        pa.field("text", pa.string(), nullable=False),
        pa.field("start", pa.int32(), nullable=False),
        pa.field("end", pa.int32(), nullable=False),
        pa.field("tool", pa.string(), nullable=False),
        pa.field("latency_s", pa.float64(), nullable=False),
        pa.field("error", pa.string(), nullable=False),
    ]
)
_EPISODE_FIELDS = [
    pa.field(RESPONSE_MASK_COLUMN, pa.list_(pa.int8()), nullable=False),
    pa.field("turns", pa.list_(TURN_TYPE), nullable=False),
    pa.field("num_turns", pa.int32(), nullable=False),
    pa.field("model_tokens", pa.int32(), nullable=False),
    pa.field("tool_calls", pa.int32(), nullable=False),
    pa.field("tool_errors", pa.int32(), nullable=False),
    pa.field("tool_timeouts", pa.int32(), nullable=False),
    pa.field("end_reason", pa.string(), nullable=False),
    pa.field("env_reward", pa.float64(), nullable=True),
    pa.field("environment", pa.string(), nullable=False),
]


@dataclass(frozen=True)
class RolloutLineage:
    """Where a batch of rollouts came from; repeated on every row so any row stands on its own."""

    policy_uri: str
    policy_version: str
    iteration: int
    seed: int
    sampling_params: str  # JSON
    reward_versions: str  # JSON
    # The sampling policy's index; None = `iteration` (on-policy, sync).
    policy_iteration: int | None = None
    # JSON describing the environment of multi-turn episodes; None = single-turn samples.
    environment: str | None = None

    @property
    def sampler_index(self) -> int:
        return self.iteration if self.policy_iteration is None else self.policy_iteration


def rollout_schema(reward_columns: Sequence[str], episodes: bool = False) -> pa.Schema:
    """The rollout table's schema; `episodes` adds the multi-turn columns (module docstring)."""
    reward_fields = [pa.field(c, pa.float64(), nullable=False) for c in reward_columns]
    return pa.schema(
        [
            *_SAMPLE_FIELDS,
            *reward_fields,
            pa.field(TOTAL_COLUMN, pa.float64(), nullable=False),
            *_LINEAGE_FIELDS,
            *_SELECTION_FIELDS,
            *(_EPISODE_FIELDS if episodes else []),
        ]
    )


def episode_columns(episodes: Sequence[Episode], environment: str) -> dict[str, list]:
    """The multi-turn columns of `episodes` (module docstring)."""
    return {
        RESPONSE_MASK_COLUMN: [list(e.response_mask) for e in episodes],
        "turns": [[dataclasses.asdict(t) for t in e.turns] for e in episodes],
        "num_turns": [e.num_turns for e in episodes],
        "model_tokens": [e.model_tokens for e in episodes],
        "tool_calls": [e.tool_calls for e in episodes],
        "tool_errors": [e.tool_errors for e in episodes],
        "tool_timeouts": [e.tool_timeouts for e in episodes],
        "end_reason": [e.end_reason for e in episodes],
        "env_reward": [e.env_reward for e in episodes],
        "environment": [environment] * len(episodes),
    }


def rollout_table(
    samples: Sequence[Sample], scored: ScoredRewards, lineage: RolloutLineage, sampling_round: int = 0
) -> pa.Table:
    """The rows of `samples` with rewards and lineage, every row `kept`; with `lineage.environment` the samples
    are Episodes and the table has the multi-turn columns."""
    n = len(samples)
    if len(scored.total) != n:
        raise ValueError(f"rollout_table: {n} samples but {len(scored.total)} rewards")
    columns = {
        "prompt_id": [s.prompt_id for s in samples],
        "group_id": [s.group_id for s in samples],
        "sample_index": [s.sample_index for s in samples],
        "prompt_ids": [list(s.prompt_ids) for s in samples],
        "response_ids": [list(s.response_ids) for s in samples],
        "response_logprobs": [list(s.response_logprobs) for s in samples],
        "finish_reason": [s.finish_reason for s in samples],
        "prompt_len": [s.prompt_len for s in samples],
        "response_len": [s.response_len for s in samples],
        "response_text": [s.response_text for s in samples],
        "ground_truth": [s.ground_truth for s in samples],
        **scored.columns,
        TOTAL_COLUMN: scored.total,
        "policy_uri": [lineage.policy_uri] * n,
        "policy_version": [lineage.policy_version] * n,
        "iteration": [lineage.iteration] * n,
        "policy_iteration": [lineage.sampler_index] * n,
        "seed": [lineage.seed] * n,
        "sampling_params": [lineage.sampling_params] * n,
        "reward_versions": [lineage.reward_versions] * n,
        ROUND_COLUMN: [sampling_round] * n,
        KEPT_COLUMN: [True] * n,
    }
    episodes = lineage.environment is not None
    if episodes:
        assert all(isinstance(s, Episode) for s in samples), "a table with an environment holds episodes"
        columns.update(episode_columns(samples, lineage.environment))
    return pa.Table.from_pydict(columns, schema=rollout_schema(list(scored.columns), episodes))


def reward_columns_of(schema: pa.Schema) -> list[str]:
    """The per-component reward columns of a rollout schema, in order."""
    return [name for name in schema.names if name.startswith("reward_") and name != "reward_versions"]


def rollout_metrics(table: pa.Table, primary_column: str) -> dict[str, float]:
    """Reward, pass-rate, group and length statistics of a rollout table (the manifest's metrics).

    pass_rate is the share of samples whose primary reward reaches PASS_THRESHOLD, group_pass_rate the share
    of groups with one such sample, zero_variance_group_fraction the share of groups with equal rewards.
    """
    rewards = np.asarray(table.column(TOTAL_COLUMN).to_pylist(), dtype=np.float64)
    passed = np.asarray(table.column(primary_column).to_pylist(), dtype=np.float64) >= PASS_THRESHOLD
    groups = np.asarray(table.column("group_id").to_pylist())
    lengths = np.asarray(table.column("response_len").to_pylist(), dtype=np.int64)
    truncated = np.asarray([r == "length" for r in table.column("finish_reason").to_pylist()])
    group_ids, group_codes = np.unique(groups, return_inverse=True)
    group_passed = np.zeros(len(group_ids), dtype=bool)
    np.logical_or.at(group_passed, group_codes, passed)
    group_min = np.full(len(group_ids), np.inf)
    group_max = np.full(len(group_ids), -np.inf)
    np.minimum.at(group_min, group_codes, rewards)
    np.maximum.at(group_max, group_codes, rewards)
    group_spread = group_max - group_min
    metrics = {
        "samples": float(table.num_rows),
        "groups": float(len(group_ids)),
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()),
        "pass_rate": float(passed.mean()),
        "group_pass_rate": float(group_passed.mean()),
        "zero_variance_group_fraction": float((group_spread == 0).mean()),
        "response_len_mean": float(lengths.mean()),
        "response_len_min": float(lengths.min()),
        "response_len_max": float(lengths.max()),
        "response_len_p50": float(np.median(lengths)),
        "truncated_fraction": float(truncated.mean()),
        "response_tokens": float(lengths.sum()),
    }
    for column in reward_columns_of(table.schema):
        metrics[f"{column}_mean"] = float(np.mean(table.column(column).to_pylist()))
    return metrics
