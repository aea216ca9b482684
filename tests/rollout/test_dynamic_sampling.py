"""DAPO's dynamic sampling in the rollout stage (forge_core.rollout.dynamic through forge_core.run.rollout):
extra rounds until enough groups are informative or the bound is hit, every generated row kept in the
Parquet with its round and `kept` flag, the manifest's counts, the prompt-stream slots, and determinism per
seed. The stage tests run real vLLM on the tiny model (this module's own in-process engine); the first tests
check the round logic alone on hand-made round tables."""

from __future__ import annotations

import pyarrow as pa
import pytest

from forge_core.config import config_from_dict, config_to_dict
from forge_core.config.schema import AdvantageConfig, DynamicSamplingConfig
from forge_core.rollout import ROLLOUTS_TABLE, iteration_indices
from forge_core.rollout.dynamic import DynamicSampling, informative_groups
from forge_core.run.rollout import plan_rollout, run_rollout
from forge_core.run.scaffold import stage_context
from forge_core.run.spec import StageSpec
from forge_core.trainers.grpo import rollouts_to_rl_batch
from tests.rollout.conftest import MAX_NEW_TOKENS, run_config_dict

PER_ITERATION = 6
CONTAINS_DIGIT = "tests.rollout.rewards_for_tests:contains_digit"  # passes about half the samples


def round_table(slot: int, round_index: int, informative: list[bool], per_round: int = 3) -> pa.Table:
    """A scored round of `per_round` groups of 2 samples: informative groups get rewards (1, 0), the others
    (0.5, 0.5). Group ids follow the stage's rule: slot * per_round + j."""
    groups, rewards = [], []
    for j in range(per_round):
        groups += [slot * per_round + j] * 2
        rewards += [1.0, 0.0] if informative[j] else [0.5, 0.5]
    return pa.table({
        "group_id": pa.array(groups, pa.int64()),
        "reward": rewards,
        "sampling_round": pa.array([round_index] * len(groups), pa.int32()),
        "kept": [True] * len(groups),
    })


def test_rounds_stop_once_the_target_is_met_and_keep_informative_groups_first():
    plan = [[False, True, False], [False, False, True], [True, True, True], [True, True, True]]
    calls = []

    def generate(slot: int, round_index: int) -> pa.Table:
        calls.append((slot, round_index))
        return round_table(slot, round_index, plan[round_index])

    rounds = DynamicSampling(DynamicSamplingConfig(enabled=True, target_groups=3, max_extra_rounds=3), 3)
    table, metrics = rounds.run(iteration=2, generate=generate)
    # 1 + 1 + 3 informative groups: the target of 3 is met in round 2, so round 3 never runs.
    assert calls == [(8, 0), (9, 1), (10, 2)]  # iteration 2 owns slots 8..11
    assert metrics["dynamic_sampling/rounds"] == 3 and metrics["dynamic_sampling/target_reached"] == 1
    assert metrics["dynamic_sampling/groups_generated"] == 9 and metrics["dynamic_sampling/groups_kept"] == 3
    assert metrics["dynamic_sampling/informative_generated"] == 5
    # Kept: the first three informative groups in generation order (24+1, 27+2, 30+0), every row still there.
    flags = zip(table.column("group_id").to_pylist(), table.column("kept").to_pylist())
    kept = sorted({g for g, k in flags if k})
    assert kept == [25, 29, 30] and table.num_rows == 18
    assert metrics["dynamic_sampling/informative_kept"] == 3


def test_rounds_stop_at_the_bound_and_fill_the_batch_with_uninformative_groups():
    rounds = DynamicSampling(DynamicSamplingConfig(enabled=True, target_groups=2, max_extra_rounds=1), 3)
    table, metrics = rounds.run(0, lambda slot, r: round_table(slot, r, [False, False, r == 1]))
    assert metrics["dynamic_sampling/rounds"] == 2 and metrics["dynamic_sampling/target_reached"] == 0
    flags = dict(zip(table.column("group_id").to_pylist(), table.column("kept").to_pylist()))
    assert flags == {0: True, 1: True, 2: False, 3: False, 4: False, 5: True}  # informative 5, then 0 and 1


def test_disabled_is_one_round_on_the_iterations_own_slot():
    rounds = DynamicSampling(DynamicSamplingConfig(enabled=False, max_extra_rounds=5), 3)
    table, metrics = rounds.run(4, lambda slot, r: round_table(slot, r, [False, False, False]))
    assert rounds.slot(4, 0) == 4 and metrics["dynamic_sampling/rounds"] == 1
    assert all(table.column("kept").to_pylist())


# ---- the stage on real vLLM -------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def policy_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FORGE_POLICY_CACHE", str(tmp_path / "policy-cache"))


def dynamic_spec(world, key: str, rewards: list[dict], group_size: int, **dynamic) -> StageSpec:
    sampling = {"group_size": group_size, "temperature": 1.0, "max_new_tokens": MAX_NEW_TOKENS}
    config = run_config_dict(world.store_root, rewards=rewards, sampling=sampling,
                             dynamic_sampling={"enabled": True, **dynamic})
    return StageSpec(
        stage="rollout",
        config=config_to_dict(config_from_dict(config)),
        inputs={"policy": world.stage_uri, "data": world.data_uri},
        output_uri=world.store.artifact_uri("rollouts", key),
        params={"iteration": 1},
    )


def informative_by_round(table: pa.Table) -> list[int]:
    rounds = table.column("sampling_round").to_pylist()
    return [
        len(informative_groups(table.filter(pa.array([x == r for x in rounds])))) for r in range(max(rounds) + 1)
    ]


@pytest.mark.integration
def test_stage_generates_rounds_until_the_target_then_trains_on_the_kept_groups(world, generator):
    max_extra = 4
    # Groups of 2 on a reward that passes about half the samples: a group is informative half the time, so
    # reaching all 6 takes more than one round.
    spec = dynamic_spec(world, "dynamic-target", [{"name": CONTAINS_DIGIT, "weight": 1.0}], group_size=2,
                        target_groups=PER_ITERATION, max_extra_rounds=max_extra)
    table = run_rollout(plan_rollout(stage_context(spec)), generator)
    metrics = world.store.read_manifest(spec.output_uri).metrics
    stored = world.store.reader(spec.output_uri).read_table(ROLLOUTS_TABLE)
    assert stored.to_pylist() == table.to_pylist()

    per_round = informative_by_round(table)
    rounds = len(per_round)
    assert metrics["dynamic_sampling/rounds"] == rounds and 1 < rounds <= 1 + max_extra
    # The stop rule: it generated another round only while the target was unmet.
    assert all(sum(per_round[: r + 1]) < PER_ITERATION for r in range(rounds - 1))
    assert metrics["dynamic_sampling/target_reached"] == float(sum(per_round) >= PER_ITERATION) == 1.0
    assert metrics["dynamic_sampling/groups_generated"] == rounds * PER_ITERATION
    assert metrics["dynamic_sampling/groups_kept"] == PER_ITERATION
    assert metrics["dynamic_sampling/informative_kept"] == PER_ITERATION
    assert metrics["samples"] == table.num_rows == rounds * PER_ITERATION * 2  # every generated row stays

    # Round r samples the slot 1 * (1 + max_extra) + r of the prompt stream: prompts and group ids.
    prompts = world.store.reader(world.data_uri).read_table("rl_prompts.parquet")
    for r in range(rounds):
        slot = (1 + max_extra) + r
        rows = table.filter(pa.array([x == r for x in table.column("sampling_round").to_pylist()]))
        expected = prompts.take(pa.array(iteration_indices(prompts.num_rows, PER_ITERATION, slot, seed=3)))
        assert rows.column("prompt_id").to_pylist()[::2] == expected.column("prompt_id").to_pylist()
        groups = list(range(slot * PER_ITERATION, (slot + 1) * PER_ITERATION))
        assert rows.column("group_id").to_pylist()[::2] == groups

    # GRPO trains on the kept groups alone: all informative, none dropped for zero variance.
    rollouts = rollouts_to_rl_batch(stored, AdvantageConfig())
    assert rollouts.batch.batch_size == PER_ITERATION * 2
    assert rollouts.stats["advantage/kept_frac"] == 1.0
    assert rollouts.stats["rollout/generated_samples"] == table.num_rows

    # Deterministic per seed: the same stage under another key generates the same rounds and keeps the same.
    again_spec = dynamic_spec(world, "dynamic-target-again", [{"name": CONTAINS_DIGIT, "weight": 1.0}],
                              group_size=2, target_groups=PER_ITERATION, max_extra_rounds=max_extra)
    again = run_rollout(plan_rollout(stage_context(again_spec)), generator)
    for column in ("group_id", "response_ids", "reward", "sampling_round", "kept"):
        assert again.column(column).to_pylist() == table.column(column).to_pylist(), column


@pytest.mark.integration
def test_stage_stops_at_the_bound_when_no_group_is_informative(world, generator):
    # The untrained policy never writes the right answer: every exact_answer reward is 0.
    spec = dynamic_spec(world, "dynamic-bound", [{"name": "exact_answer", "weight": 1.0}], group_size=2,
                        target_groups=2, max_extra_rounds=2)
    table = run_rollout(plan_rollout(stage_context(spec)), generator)
    metrics = world.store.read_manifest(spec.output_uri).metrics
    assert set(table.column("reward").to_pylist()) == {0.0}
    assert metrics["dynamic_sampling/rounds"] == 3 and metrics["dynamic_sampling/target_reached"] == 0.0
    assert table.num_rows == 3 * PER_ITERATION * 2
    # The batch is still prompts_per_iteration groups: the first ones generated, all uninformative.
    flags = zip(table.column("group_id").to_pylist(), table.column("kept").to_pylist())
    kept_groups = sorted({g for g, k in flags if k})
    assert kept_groups == list(range(3 * PER_ITERATION, 4 * PER_ITERATION))  # iteration 1's first slot is 3
    assert metrics["dynamic_sampling/groups_kept"] == PER_ITERATION
    assert metrics["dynamic_sampling/informative_kept"] == 0
