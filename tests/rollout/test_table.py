"""The rollout table: explicit schema, Parquet round trip through the artifact store, statistics, and the
GRPO trainer reading it."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from forge_core.config.schema import AdvantageConfig, RewardComponentConfig
from forge_core.rewards import RewardSet
from forge_core.rollout import RolloutLineage, Sample, rollout_metrics, rollout_schema, rollout_table
from forge_core.rollout.table import ROLLOUTS_TABLE, reward_columns_of


def hand_made_samples() -> list[Sample]:
    texts = [
        ("p0", 10, "<answer>0168</answer>", "stop"),
        ("p0", 10, "<answer>0178</answer>", "stop"),
        ("p1", 11, "<answer>0011", "length"),
        ("p1", 11, "no answer at all", "length"),
    ]
    samples = []
    for i, (pid, group, text, reason) in enumerate(texts):
        response = tuple(range(3, 3 + 2 + i))
        samples.append(
            Sample(
                prompt_id=pid,
                group_id=group,
                sample_index=i % 2,
                prompt_ids=(1, 7, 8),
                response_ids=response,
                response_logprobs=tuple(-0.25 * (j + 1) for j in range(len(response))),
                response_text=text,
                finish_reason=reason,
                ground_truth="0168" if pid == "p0" else "0011",
            )
        )
    return samples


LINEAGE = RolloutLineage(
    policy_uri="file:///store/sft/abc/policy",
    policy_version="f" * 64,
    iteration=2,
    seed=7,
    sampling_params=json.dumps({"temperature": 1.0}),
    reward_versions=json.dumps({"exact_answer": "1", "per_digit": "1"}),
)


def build_table():
    rewards = RewardSet.from_config(
        [RewardComponentConfig(name="exact_answer", weight=1.0), RewardComponentConfig(name="per_digit", weight=0.5)]
    )
    samples = hand_made_samples()
    scored = rewards.score(
        [s.response_text for s in samples], [s.ground_truth for s in samples], [s.ref for s in samples]
    )
    return rollout_table(samples, scored, LINEAGE), rewards


def test_table_has_the_explicit_schema_and_lineage_on_every_row():
    table, _ = build_table()
    assert table.schema == rollout_schema(["reward_exact_answer", "reward_per_digit"])
    assert reward_columns_of(table.schema) == ["reward_exact_answer", "reward_per_digit"]
    assert table.column("reward").to_pylist() == pytest.approx([1.5, 0.375, 0.0, 0.0])
    assert table.column("response_len").to_pylist() == [2, 3, 4, 5]
    assert table.column("prompt_len").to_pylist() == [3] * 4
    for name in ("policy_uri", "policy_version", "iteration", "seed", "sampling_params", "reward_versions"):
        assert table.column(name).to_pylist() == [getattr(LINEAGE, name)] * 4
    assert table.schema.field("response_logprobs").type == pa.list_(pa.float32())


def test_round_trip_through_a_committed_artifact(file_store):
    table, _ = build_table()
    uri = file_store.artifact_uri("rollouts", "roundtrip")
    writer = file_store.writer(uri, kind="rollouts", stage="rollout")
    writer.write_table(ROLLOUTS_TABLE, table)
    writer.commit(config={}, inputs={}, metrics={})
    back = file_store.reader(uri).read_table(ROLLOUTS_TABLE)
    assert back.schema.remove_metadata() == table.schema.remove_metadata()
    assert back.to_pylist() == table.to_pylist()
    assert "response_logprobs" in file_store.read_manifest(uri).schema[ROLLOUTS_TABLE]


def test_metrics_of_a_hand_made_batch():
    table, rewards = build_table()
    metrics = rollout_metrics(table, rewards.primary_column)
    assert metrics["samples"] == 4 and metrics["groups"] == 2
    assert metrics["reward_mean"] == pytest.approx((1.5 + 0.375) / 4)
    assert metrics["pass_rate"] == 0.25  # one exact answer out of four
    assert metrics["group_pass_rate"] == 0.5
    assert metrics["zero_variance_group_fraction"] == 0.5  # group p1 scored 0 and 0
    assert metrics["truncated_fraction"] == 0.5
    assert (metrics["response_len_min"], metrics["response_len_max"], metrics["response_len_mean"]) == (
        2,
        5,
        3.5,
    )
    assert metrics["reward_per_digit_mean"] == pytest.approx((1 + 0.75) / 4)


def test_the_grpo_trainer_reads_the_table():
    """Contract with forge_core.trainers: the columns it reads, aligned logprobs, advantages per group."""
    from forge_core.trainers.grpo import rollouts_to_rl_batch

    table, _ = build_table()
    rollouts = rollouts_to_rl_batch(table, AdvantageConfig(drop_zero_variance_groups=False))
    assert rollouts.stats["rollout/samples"] == 4
    assert rollouts.stats["rollout/response_tokens"] == 14
