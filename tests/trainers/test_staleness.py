"""Sync/async GRPO modes: the rollout schedule (who samples iteration k, the bound never exceeded), the GRPO
stage's per-row staleness check and metrics (forge_core.trainers.staleness through run/grpo.read_rollouts),
the config rules, and the correction: stale rows give a first-step ratio != 1 and a working loss."""

from __future__ import annotations

import math

import pyarrow as pa
import pytest
import torch
from grpo_helpers import (
    MAX_NEW,
    demo_tokenizer,
    grpo_test_config,
    intra_op_threads,
    plain_policy,
    rollout_table,
    write_rollouts_artifact,
)

from forge_core.config import ConfigError, load_config
from forge_core.engine import Engine, destroy_distributed
from forge_core.losses.grpo import build_policy_loss
from forge_core.run.grpo import GRPOInputs, read_rollouts
from forge_core.run.plan import plan_stage
from forge_core.storage import ObjectStore
from forge_core.trainers.grpo import GRPOTrainer, rollouts_to_rl_batch
from forge_core.trainers.staleness import (
    STALENESS_MAX,
    STALENESS_MEAN,
    check_staleness,
    rollouts_to_start,
    sampling_policy_index,
)


def simulate_flow(iterations: int, mode: str, max_staleness: int) -> list[tuple[int, list[tuple[int, int]]]]:
    """What flows/post_train.py starts before each GRPO iteration k: [(k, [(rollout iteration, sampler)])]."""
    started, schedule = 0, []
    for k in range(iterations):
        ready = rollouts_to_start(k, started, iterations, mode, max_staleness)
        started += len(ready)
        schedule.append((k, ready))
    return schedule


@pytest.mark.parametrize(
    ("max_staleness", "samplers"),
    [(0, [0, 1, 2, 3, 4]), (1, [0, 0, 1, 2, 3]), (2, [0, 0, 0, 1, 2])],
)
def test_policy_that_samples_each_iteration(max_staleness, samplers):
    assert [sampling_policy_index(k, "async", max_staleness) for k in range(5)] == samplers


def test_sync_is_async_with_staleness_zero_and_ignores_nothing_else():
    assert simulate_flow(5, "sync", 1) == simulate_flow(5, "async", 0)
    assert simulate_flow(3, "sync", 0) == [(0, [(0, 0)]), (1, [(1, 1)]), (2, [(2, 2)])]
    # async S=1: rollouts 0 and 1 start right after SFT (both from policy 0), then one per committed policy.
    assert simulate_flow(4, "async", 1) == [(0, [(0, 0), (1, 0)]), (1, [(2, 1)]), (2, [(3, 2)]), (3, [])]


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("max_staleness", [0, 1, 2, 3])
@pytest.mark.parametrize("iterations", [1, 2, 5])
def test_schedule_never_exceeds_the_bound(mode, max_staleness, iterations):
    bound = 0 if mode == "sync" else max_staleness
    started_at: dict[int, int] = {}
    for k, ready in simulate_flow(iterations, mode, max_staleness):
        for iteration, sampler in ready:
            assert sampler <= k, "a rollout may only start from a committed policy (0..k)"
            assert 0 <= iteration - sampler <= bound
            started_at[iteration] = k
        assert k in started_at, f"iteration {k}'s rollouts must have started before it trains"
    assert sorted(started_at) == list(range(iterations))


def _lineage_table(iterations: list[int], samplers: list[int]) -> pa.Table:
    return pa.table({
        "iteration": pa.array(iterations, pa.int32()),
        "policy_iteration": pa.array(samplers, pa.int32()),
    })


def test_staleness_metrics_and_bound(tmp_path):
    async_1 = grpo_test_config(tmp_path, "grpo.mode=async", "grpo.max_staleness=1", "grpo.correction.type=tis").grpo
    metrics = check_staleness(_lineage_table([3, 3, 3, 3], [2, 2, 3, 3]), async_1, source="rollouts.parquet")
    assert metrics == {STALENESS_MEAN: 0.5, STALENESS_MAX: 1.0}

    with pytest.raises(ValueError) as too_stale:
        check_staleness(_lineage_table([3, 3], [1, 3]), async_1, source="s3://b/rollouts/k/rollouts.parquet")
    message = str(too_stale.value)
    for expected in ("s3://b/rollouts/k/rollouts.parquet", "staleness up to 2", "policy_iteration",
                     "grpo.max_staleness=1", "grpo.max_staleness>=2"):
        assert expected in message, message

    sync = grpo_test_config(tmp_path).grpo
    assert check_staleness(_lineage_table([2, 2], [2, 2]), sync, "x")[STALENESS_MAX] == 0.0
    with pytest.raises(ValueError, match="grpo.mode=sync"):
        check_staleness(_lineage_table([2], [1]), sync, "x")
    with pytest.raises(ValueError, match="policy_iteration=3 > iteration=2"):
        check_staleness(_lineage_table([2], [3]), async_1, "x")
    # A table without the lineage columns (hand-made) counts as on-policy.
    assert check_staleness(pa.table({"reward": [1.0]}), sync, "x") == {STALENESS_MEAN: 0.0, STALENESS_MAX: 0.0}


def test_config_rules_for_mode_and_max_staleness():
    assert load_config(None, ["grpo.mode=async", "grpo.max_staleness=0"]).grpo.max_staleness == 0
    assert load_config(None, ["grpo.max_staleness=0"]).grpo.mode == "sync"
    with pytest.raises(ConfigError, match=r"grpo.max_staleness=3 with grpo.mode=sync.*set grpo.mode=async"):
        load_config(None, ["grpo.max_staleness=3"])
    with pytest.raises(ConfigError, match="grpo.max_staleness=-1: must be >= 0"):
        load_config(None, ["grpo.mode=async", "grpo.max_staleness=-1"])


def test_async_with_staleness_needs_a_correction_or_an_explicit_override():
    with pytest.raises(ConfigError) as refused:
        load_config(None, ["grpo.mode=async", "grpo.max_staleness=2", "grpo.correction.tis_cap=0"])
    assert len(refused.value.errors) == 2  # both problems at once, as the loader reports everything
    message = str(refused.value)
    for expected in ("grpo.correction.type='none' with grpo.mode=async, grpo.max_staleness=2",
                     "grpo.correction.type to one of ['tis', 'mis', 'geo_mask', 'icepop']",
                     "grpo.allow_uncorrected_async=true", "grpo.correction.tis_cap=0.0: must be > 0"):
        assert expected in message, message
    for correction in ("tis", "mis", "geo_mask", "icepop"):
        cfg = load_config(None, ["grpo.mode=async", "grpo.max_staleness=2", f"grpo.correction.type={correction}"])
        assert cfg.grpo.correction.type == correction
    overridden = load_config(None, ["grpo.mode=async", "grpo.max_staleness=2", "grpo.allow_uncorrected_async=true"])
    assert overridden.grpo.correction.type == "none"
    # Staleness 0 (sync, or async with a bound of 0) has nothing stale to correct.
    assert load_config(None, ["grpo.mode=async", "grpo.max_staleness=0"]).grpo.correction.type == "none"
    assert load_config(None).grpo.correction.type == "none"


def test_mode_is_not_part_of_the_grpo_key(tmp_path):
    """Sync and async with any bound plan the same GRPO artifact for the same inputs: async S=0 re-uses (and
    reproduces) sync's artifacts, and switching mode re-uses every iteration whose rollouts are the same."""
    store = ObjectStore(f"file://{tmp_path}/store")
    inputs = {}
    for name in ("policy", "rollouts"):
        writer = store.writer(store.artifact_uri(name, name), kind=name, stage=name)
        writer.write_json("x.json", {name: 1})
        writer.commit(config={}, inputs={}, metrics={})
        inputs[name] = store.artifact_uri(name, name)
    keys = {
        plan_stage(load_config(None, overrides), store, "grpo", inputs, {"iteration": 1}).key
        for overrides in (
            [],
            ["grpo.mode=async", "grpo.max_staleness=0"],
            ["grpo.mode=async", "grpo.max_staleness=2", "grpo.allow_uncorrected_async=true"],
        )
    }
    assert len(keys) == 1


def _with_lineage(table: pa.Table, iteration: int, sampler: int) -> pa.Table:
    n = table.num_rows
    return table.append_column("iteration", pa.array([iteration] * n, pa.int32())).append_column(
        "policy_iteration", pa.array([sampler] * n, pa.int32())
    )


def test_grpo_stage_reads_staleness_into_its_metrics_and_refuses_too_stale_rows(tmp_path):
    cfg = grpo_test_config(tmp_path, "grpo.mode=async", "grpo.max_staleness=1", "grpo.correction.type=tis")
    store = ObjectStore.from_config(cfg.storage)
    tokenizer = demo_tokenizer(tmp_path)
    table = rollout_table(plain_policy(cfg, tokenizer.vocab_size, seed=3), tokenizer, "file:///policy-1/policy")
    policy_uri = store.artifact_uri("grpo", "policy-1")

    stale_by_one = write_rollouts_artifact(store, store.artifact_uri("rollouts", "s1"), _with_lineage(table, 2, 1))
    stats = read_rollouts(store, cfg, GRPOInputs(policy_uri, stale_by_one, None)).stats
    assert stats[STALENESS_MEAN] == 1.0 and stats[STALENESS_MAX] == 1.0

    stale_by_two = write_rollouts_artifact(store, store.artifact_uri("rollouts", "s2"), _with_lineage(table, 3, 1))
    with pytest.raises(ValueError, match=r"rollouts/s2/rollouts.parquet: .* staleness up to 2"):
        read_rollouts(store, cfg, GRPOInputs(policy_uri, stale_by_two, None))


@pytest.fixture
def distributed_cleanup():
    with intra_op_threads(1):
        yield
    destroy_distributed()


def test_stale_rows_get_a_ratio_off_one_and_a_working_loss(tmp_path, distributed_cleanup):
    """Rows sampled by policy v-1 train policy v (one update later): the first step's ratio against the stored
    generator logprobs is not 1 (on-policy rows give exactly 1, tests/trainers/test_grpo_trainer.py), and the
    clipped loss, its metrics and the update stay finite."""
    cfg = grpo_test_config(tmp_path, "grpo.epochs=1", "grpo.mini_batch_size=32", "grpo.micro_batch_size=8")
    tokenizer = demo_tokenizer(tmp_path)
    vocab = tokenizer.vocab_size
    sampler = plain_policy(cfg, vocab, seed=3)
    table = rollout_table(sampler, tokenizer, "file:///policy-0/policy")
    rollouts = rollouts_to_rl_batch(table, cfg.grpo.advantage)

    torch.manual_seed(0)
    newer = {k: v + 0.02 * torch.randn_like(v) for k, v in sampler.state_dict().items()}  # "one update later"
    engine = Engine.Config.from_run_config(cfg, vocab, cfg.grpo.optimizer, total_steps=1).build()
    engine.load_full_state_dict(newer)
    trainer = GRPOTrainer(engine, cfg.grpo, build_policy_loss(cfg.grpo.loss, MAX_NEW))
    history = trainer.fit(rollouts.batch, seed=11)

    first = history[0]
    assert trainer.step == 1
    assert abs(first["policy/ratio_mean"] - 1.0) > 1e-3, first
    assert first["policy/logprob_gap_max"] > 1e-3, first
    assert first["policy/ratio_max"] > 1.0
    for name in ("loss", "policy/loss", "policy/clip_low_frac", "policy/clip_high_frac", "policy/ratio_mean"):
        assert math.isfinite(first[name]), (name, first)
    assert all(torch.isfinite(weight).all() for weight in engine.full_state_dict().values())


def test_rollout_stage_records_its_sampler_index_on_policy_by_default():
    from forge_core.run.rollout import policy_iteration_param
    from forge_core.run.spec import StageSpec

    def spec(**params) -> StageSpec:
        return StageSpec("rollout", {}, {}, "file:///store/rollouts/k", params)

    assert policy_iteration_param(spec(iteration=2), 2) == 2  # absent: on-policy, as before async existed
    assert policy_iteration_param(spec(iteration=2, policy_iteration=0), 2) == 0
    for bad in (3, -1, "1", True):
        with pytest.raises(ValueError, match=rf"params.policy_iteration={bad!r} with params.iteration=2"):
            policy_iteration_param(spec(iteration=2, policy_iteration=bad), 2)
