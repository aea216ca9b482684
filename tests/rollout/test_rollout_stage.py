"""The rollout and evaluate stages: inputs from committed artifacts, committed outputs with lineage.

The in-process tests run the stage code on the session engine (`plan_*` then `run_*`, exactly what `main`
does after starting vLLM); one test runs `python -m forge_core.run rollout` end to end in its own process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest

from forge_core.artifacts.policy import weights_version
from forge_core.config import config_from_dict, config_to_dict
from forge_core.rewards import RewardSet
from forge_core.rollout import RESULTS_TABLE, ROLLOUTS_TABLE, iteration_indices, rollout_schema
from forge_core.run.evaluate import plan_evaluation, run_evaluation
from forge_core.run.rollout import plan_rollout, run_rollout
from forge_core.run.scaffold import stage_context
from forge_core.run.spec import StageSpec, write_spec
from tests.rollout.conftest import GROUP_SIZE, run_config_dict

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[2]
USER_REWARD = "tests.rollout.rewards_for_tests:contains_digit"
REWARDS = [
    {"name": USER_REWARD, "weight": 1.0},
    {"name": "exact_answer", "weight": 1.0},
    {"name": "per_digit", "weight": 0.5},
]
PER_ITERATION = 6


@pytest.fixture(autouse=True)
def policy_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FORGE_POLICY_CACHE", str(tmp_path / "policy-cache"))


def stage_spec(
    world, stage: str, key: str, params: dict | None = None, rollout: dict | None = None, **eval_cfg
) -> StageSpec:
    config = run_config_dict(world.store_root, rewards=REWARDS, **(rollout or {}))
    config["eval"].update(eval_cfg)
    cfg = config_from_dict(config)
    kind = "rollouts" if stage == "rollout" else "eval"
    return StageSpec(
        stage=stage,
        config=config_to_dict(cfg),
        inputs={"policy": world.stage_uri, "data": world.data_uri},
        output_uri=world.store.artifact_uri(kind, key),
        params=params or {},
    )


def test_rollout_stage_commits_scored_rollouts_with_lineage(world, generator):
    spec = stage_spec(world, "rollout", "iteration-1", {"iteration": 1})
    plan = plan_rollout(stage_context(spec))
    table = run_rollout(plan, generator)
    store = world.store
    assert store.is_committed(spec.output_uri)
    assert stage_context(spec) is None  # committed: a rerun is a no-op

    back = store.reader(spec.output_uri).read_table(ROLLOUTS_TABLE)
    reward_columns = ["reward_contains_digit", "reward_exact_answer", "reward_per_digit"]
    assert back.schema.remove_metadata() == rollout_schema(reward_columns)
    assert back.num_rows == PER_ITERATION * GROUP_SIZE == table.num_rows

    # This iteration's prompts: the second slice of the seed's permutation of rl_prompts.
    prompts = store.reader(world.data_uri).read_table("rl_prompts.parquet")
    expected = prompts.take(pa.array(iteration_indices(prompts.num_rows, PER_ITERATION, 1, seed=3)))
    rows = back.to_pylist()
    assert [r["prompt_id"] for r in rows[::GROUP_SIZE]] == expected.column("prompt_id").to_pylist()
    assert [r["prompt_ids"] for r in rows[::GROUP_SIZE]] == expected.column("prompt_ids").to_pylist()
    assert [r["group_id"] for r in rows[::GROUP_SIZE]] == list(range(PER_ITERATION, 2 * PER_ITERATION))
    assert [r["sample_index"] for r in rows[:GROUP_SIZE]] == list(range(GROUP_SIZE))

    # Lineage on every row.
    policy_uri = store.join(world.stage_uri, "policy")
    assert {r["policy_uri"] for r in rows} == {policy_uri}
    version = weights_version(
        store.read_manifest(policy_uri)
    )  # the checksum of the weights the engine served
    assert {r["policy_version"] for r in rows} == {version}
    assert {(r["iteration"], r["seed"]) for r in rows} == {(1, 3)}
    sampling = json.loads(rows[0]["sampling_params"])
    assert (sampling["group_size"], sampling["seed"], sampling["max_new_tokens"]) == (GROUP_SIZE, 3, 12)
    versions = json.loads(rows[0]["reward_versions"])
    assert versions["exact_answer"] == "1" and versions[USER_REWARD].startswith("src:")

    # Rewards: recomputable from the stored text; the total is the weighted sum.
    rewards = RewardSet.from_config(spec.run_config().rollout.rewards)
    rescored = rewards.score(
        [r["response_text"] for r in rows], [r["ground_truth"] for r in rows], ["x"] * len(rows)
    )
    assert back.column("reward").to_pylist() == pytest.approx(rescored.total)
    assert back.column("reward_contains_digit").to_pylist() == rescored.columns["reward_contains_digit"]

    manifest = store.read_manifest(spec.output_uri)
    assert manifest.kind == "rollouts"
    assert {name: ref.uri for name, ref in manifest.inputs.items()} == {
        "policy": world.stage_uri,
        "data": world.data_uri,
    }
    metrics = manifest.metrics
    assert (metrics["policy_version"], metrics["policy_manifest_sha256"]) == (
        version,
        store.manifest_sha256(policy_uri),
    )
    assert (metrics["engine_lifetime"], metrics["engine_reload_s"]) == ("stage", 0.0)
    passed = back.column("reward_contains_digit").to_pylist()
    assert metrics["pass_rate"] == pytest.approx(sum(passed) / len(passed))
    assert 0 < metrics["pass_rate"] < 1
    for key in (
        "reward_mean",
        "reward_std",
        "response_len_mean",
        "response_len_max",
        "tokens_per_s",
        "truncated_fraction",
    ):
        assert isinstance(metrics[key], float)
    assert metrics["tokens_per_s"] > 0 and metrics["samples"] == back.num_rows


def test_the_grpo_stage_reads_the_rollouts(world, generator):
    from forge_core.config.schema import AdvantageConfig
    from forge_core.trainers.grpo import rollouts_to_rl_batch

    spec = stage_spec(world, "rollout", "iteration-0", {"iteration": 0})
    run_rollout(plan_rollout(stage_context(spec)), generator)
    table = world.store.reader(spec.output_uri).read_table(ROLLOUTS_TABLE)
    batch = rollouts_to_rl_batch(table, AdvantageConfig(drop_zero_variance_groups=False)).batch
    # The generator's logprobs sit where the trainer scores each response token.
    row = table.slice(0, 1).to_pylist()[0]
    start = row["prompt_len"] - 1
    stored = batch.generator_logprobs_BL[0, start : start + row["response_len"]].tolist()
    assert stored == pytest.approx(row["response_logprobs"])


def test_bad_inputs_fail_before_vllm_starts(world):
    spec = stage_spec(world, "rollout", "bad-inputs")
    no_data = StageSpec(spec.stage, spec.config, {"policy": world.stage_uri}, spec.output_uri, spec.params)
    with pytest.raises(ValueError, match="inputs has no 'data' entry"):
        plan_rollout(stage_context(no_data))
    wrong_kind = StageSpec(
        spec.stage, spec.config, {"policy": world.data_uri, "data": world.data_uri}, spec.output_uri
    )
    with pytest.raises(ValueError, match="inputs.policy=.*a 'data' artifact; expected one of"):
        plan_rollout(stage_context(wrong_kind))
    bad_iteration = StageSpec(spec.stage, spec.config, spec.inputs, spec.output_uri, {"iteration": -2})
    with pytest.raises(ValueError, match="params.iteration=-2"):
        plan_rollout(stage_context(bad_iteration))
    config = dict(spec.config)
    config["rollout"] = {**config["rollout"], "rewards": [{"name": "nope:fn", "weight": 1.0, "kwargs": {}}]}
    with pytest.raises(
        ValueError, match=r"rollout.rewards\[0\].name: reward 'nope:fn': cannot import module 'nope'"
    ):
        plan_rollout(stage_context(StageSpec(spec.stage, config, spec.inputs, spec.output_uri)))


def test_evaluate_stage_greedy_accuracy(world, generator):
    spec = stage_spec(world, "evaluate", "greedy")
    outcome = run_evaluation(plan_evaluation(stage_context(spec)), generator)
    results = world.store.reader(spec.output_uri).read_table(RESULTS_TABLE)
    assert results.num_rows == 8
    eval_prompts = world.store.reader(world.data_uri).read_table("eval.parquet")
    assert results.column("prompt_id").to_pylist() == eval_prompts.column("prompt_id").to_pylist()[:8]
    assert all(len(r) == 1 for r in results.column("responses").to_pylist())
    metrics = world.store.read_manifest(spec.output_uri).metrics
    passed = [p[0] == 1.0 for p in results.column("reward_contains_digit").to_pylist()]
    assert metrics["accuracy"] == pytest.approx(sum(passed) / 8) == pytest.approx(outcome.metrics["accuracy"])
    assert results.column("passed").to_pylist() == passed
    totals = [t[0] for t in results.column("reward").to_pylist()]
    assert metrics["mean_reward"] == pytest.approx(sum(totals) / 8)
    assert (metrics["n"], metrics["k"], metrics["temperature"]) == (8, 1, 0.0)
    assert (metrics["reward/timeouts"], metrics["reward/crashes"], metrics["reward/zeroed"]) == (0, 0, 0)
    # Greedy: a second evaluation under another key gives the same answers.
    again_ctx = stage_context(stage_spec(world, "evaluate", "greedy-again"))
    again = run_evaluation(plan_evaluation(again_ctx), generator)
    assert again.table.column("responses").to_pylist() == results.column("responses").to_pylist()


def test_evaluate_stage_pass_at_k(world, generator):
    spec = stage_spec(world, "evaluate", "pass-at-3", pass_k=3, num_prompts=5)
    run_evaluation(plan_evaluation(stage_context(spec)), generator)
    results = world.store.reader(spec.output_uri).read_table(RESULTS_TABLE).to_pylist()
    assert len(results) == 5 and all(len(r["responses"]) == 3 for r in results)
    for row in results:
        assert row["passed"] == any(x == 1.0 for x in row["reward_contains_digit"])
    metrics = world.store.read_manifest(spec.output_uri).metrics
    assert metrics["k"] == 3 and metrics["accuracy"] == pytest.approx(sum(r["passed"] for r in results) / 5)


def test_a_hanging_and_a_crashing_reward_cost_their_samples_and_the_stage_completes(world, generator):
    """User rewards that hang on one sample and segfault on another (rewards_for_tests.py): the stage, run in
    this process as a flow task runs it with flow engines, commits; those two samples score 0 after a retry
    each, the failures are counted in the manifest, every other sample is scored as in-process scoring does."""
    one_sample = {"group_size": 1, "temperature": 1.0, "max_new_tokens": 12}
    probe = plan_rollout(
        stage_context(stage_spec(world, "rollout", "unruly-probe", {"iteration": 2}, {"sampling": one_sample}))
    )
    truths = [p.ground_truth for p in probe.prompts]
    hang_truth, crash_truth = [t for t in truths if truths.count(t) == 1][:2]  # one sample each
    rewards = [
        {"name": USER_REWARD, "weight": 1.0},
        {"name": "tests.rollout.rewards_for_tests:hangs_on", "weight": 1.0, "kwargs": {"truth": hang_truth}},
        {
            "name": "tests.rollout.rewards_for_tests:segfaults_on",
            "weight": 1.0,
            "kwargs": {"truth": crash_truth},
        },
    ]
    config = run_config_dict(world.store_root, rewards=rewards, sampling=one_sample, reward_timeout_s=5.0)
    spec = StageSpec(
        "rollout",
        config_to_dict(config_from_dict(config)),
        {"policy": world.stage_uri, "data": world.data_uri},
        world.store.artifact_uri("rollouts", "unruly-rewards"),
        {"iteration": 2},
    )
    run_rollout(plan_rollout(stage_context(spec)), generator)

    metrics = world.store.read_manifest(spec.output_uri).metrics
    assert (metrics["reward/timeouts"], metrics["reward/crashes"], metrics["reward/zeroed"]) == (2, 2, 2)
    rows = world.store.reader(spec.output_uri).read_table(ROLLOUTS_TABLE).to_pylist()
    assert len(rows) == PER_ITERATION
    columns = ["reward_contains_digit", "reward_hangs_on", "reward_segfaults_on", "reward"]
    for row in rows:
        if row["ground_truth"] in (hang_truth, crash_truth):
            assert [row[c] for c in columns] == [0.0] * 4, row
        else:
            digit = float(any(ch.isdigit() for ch in row["response_text"]))
            assert [row[c] for c in columns] == [digit, 1.0, 1.0, digit + 2.0], row


def test_rollout_worker_end_to_end_matches_the_in_process_stage(world, generator, tmp_path):
    """`python -m forge_core.run rollout` in its own process (its own vLLM engine) commits the same samples
    as the stage code run on the session engine: rollouts depend on (policy, prompts, seed) only.

    The worker runs its engine in-process (one interpreter instead of three: this test's budget); the
    default separate-process engine is what test_pool.py and the flow tests start."""
    in_process = stage_spec(world, "rollout", "e2e-reference", {"iteration": 2})
    reference = run_rollout(plan_rollout(stage_context(in_process)), generator)
    spec = stage_spec(world, "rollout", "e2e-worker", {"iteration": 2}, rollout={"engine_in_process": True})
    spec_uri = write_spec(world.store, spec)
    env = {
        k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"
    }  # rollout.kv_cache_gib decides
    env["PYTHONPATH"] = str(REPO_ROOT)
    proc = subprocess.run(
        [sys.executable, "-m", "forge_core.run", "rollout", "--spec", spec_uri],
        check=False,
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    table = world.store.reader(spec.output_uri).read_table(ROLLOUTS_TABLE)
    for column in ("prompt_id", "group_id", "sample_index", "response_ids", "finish_reason", "reward"):
        assert table.column(column).to_pylist() == reference.column(column).to_pylist(), column
    worker_lp = table.column("response_logprobs").to_pylist()
    reference_lp = reference.column("response_logprobs").to_pylist()
    assert max(abs(a - b) for x, y in zip(worker_lp, reference_lp) for a, b in zip(x, y)) < 1e-4
    metrics = world.store.read_manifest(spec.output_uri).metrics
    assert metrics["engine_startup_s"] > 0
