"""The rollout stage: samples this iteration's prompts from a policy with the run's engines and scores them.

    python -m forge_core.run rollout --spec <output_uri>/_specs/<attempt>.json

Inputs:
  policy   a committed `sft` or `grpo` artifact; its `policy/` HF folder is what vLLM serves.
  data     a committed `data` artifact; the prompts come from its `rl_prompts.parquet`.
Params:
  iteration         int >= 0, default 0: picks slot k of a per-epoch permutation of the prompts fixed by the
                    seed (with `rollout.dynamic_sampling`, 1 + max_extra_rounds slots per iteration).
  policy_iteration  int in [0, iteration], default iteration (on-policy): the policy input's index (SFT = 0),
                    recorded on every row for the GRPO stage's staleness check.

Output (kind `rollouts`): `rollouts.parquet`, one row per sample or, with `rollout.env`, per multi-turn episode
(forge_core.rollout.table), and a manifest with reward, length, throughput and engine metrics.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

import pyarrow as pa

from forge_core.artifacts.policy import PolicyRef, release_policy
from forge_core.config import RunConfig
from forge_core.config.schema import SamplingConfig
from forge_core.data.schemas import TABLES
from forge_core.envs import (
    Environment,
    EpisodeBatch,
    environment_from_config,
    environment_json,
    episode_limits,
    episode_metrics,
    observation_encoder,
    run_episodes,
)
from forge_core.rewards import RewardSet, sample_context
from forge_core.rollout.dynamic import DynamicSampling
from forge_core.rollout.prompts import check_prompt_table, iteration_indices, prompts_from_table
from forge_core.rollout.protocol import GenerationEngine
from forge_core.rollout.router import EngineRouter
from forge_core.rollout.sampling import rollout_seed, sampling_json
from forge_core.rollout.table import ROLLOUTS_TABLE, RolloutLineage, rollout_metrics, rollout_table
from forge_core.rollout.types import Prompt, Sample
from forge_core.run.engines import stage_engines, stage_policy
from forge_core.run.scaffold import StageContext
from forge_core.run.spec import StageSpec
from forge_core.storage import ArtifactError, ObjectStore

log = logging.getLogger(__name__)

PROMPTS_SPLIT = "rl_prompts"


@dataclass(frozen=True)
class RolloutPlan:
    """Everything the stage decided before starting vLLM: inputs resolved, prompts picked, rewards built."""

    ctx: StageContext  # the checked stage run: config, store, inputs, clock
    iteration: int
    policy_iteration: int
    seed: int
    prompts: list[Prompt]  # round 0's; dynamic sampling draws later rounds from prompt_table
    rewards: RewardSet
    policy: PolicyRef
    prompt_table: pa.Table | None = None  # rl_prompts, for dynamic sampling's extra rounds
    environment: Environment | None = None  # rollout.env: multi-turn episodes instead of single samples

    @property
    def cfg(self) -> RunConfig:
        return self.ctx.cfg

    @property
    def store(self) -> ObjectStore:
        return self.ctx.store

    @property
    def output_uri(self) -> str:
        return self.ctx.output_uri

    @property
    def inputs(self) -> dict[str, str]:
        return self.ctx.inputs

    @property
    def rounds(self) -> DynamicSampling:
        return DynamicSampling(self.cfg.rollout.dynamic_sampling, self.cfg.rollout.prompts_per_iteration)

    def round_prompts(self, slot: int, round_index: int) -> list[Prompt]:
        if round_index == 0:
            return self.prompts
        assert self.prompt_table is not None, "a plan for dynamic sampling keeps its prompt table"
        return iteration_prompts(self.prompt_table, self.cfg.rollout.prompts_per_iteration, slot, self.seed)


def iteration_param(spec: StageSpec) -> int:
    value = spec.params.get("iteration", 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"stage spec {spec.output_uri}: params.iteration={value!r}; give an int >= 0")
    return value


def policy_iteration_param(spec: StageSpec, iteration: int) -> int:
    """The sampling policy's index; `iteration` (on-policy) when absent."""
    value = spec.params.get("policy_iteration", iteration)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= iteration:
        raise ValueError(
            f"stage spec {spec.output_uri}: params.policy_iteration={value!r} with params.iteration={iteration}; "
            f"give the policy input's index, an int in [0, {iteration}] (a rollout cannot come from a policy "
            "newer than the one it trains)"
        )
    return value


def read_prompt_split(store: ObjectStore, data_uri: str, split: str) -> pa.Table:
    """A prompts table (`rl_prompts` or `eval`) of a committed data artifact, verified."""
    file_name = TABLES[split][0]
    source = f"inputs.data={data_uri}/{file_name}"
    try:
        table = store.reader(data_uri).read_table(file_name)
    except (ArtifactError, FileNotFoundError) as exc:
        raise ValueError(f"{source}: cannot read the data artifact's {split} table: {exc}") from exc
    check_prompt_table(table, source)
    if table.num_rows == 0:
        raise ValueError(f"{source}: no prompts; the data stage must produce at least one {split} row")
    return table


def iteration_prompts(table: pa.Table, per_iteration: int, iteration: int, seed: int) -> list[Prompt]:
    indices = iteration_indices(table.num_rows, per_iteration, iteration, seed)
    return prompts_from_table(table.take(pa.array(indices)), first_group_id=iteration * per_iteration)


def engine_metrics(cfg: RunConfig, generator: GenerationEngine) -> dict:
    """How the engine was had: started by this stage (`engine_startup_s`) or the flow's, reloaded
    (`engine_reload_s`, 0 when it served the policy already); also as `phase/engine_start_s`, `phase/sync_s`.
    Behind a router, also what it failed over (`EngineRouter.failover_metrics`)."""
    failover = generator.failover_metrics() if isinstance(generator, EngineRouter) else {}
    return {
        **failover,
        "engine_lifetime": cfg.rollout.engine_lifetime,
        "engine_startup_s": float(generator.startup_s),
        "engine_reload_s": float(generator.reload_s),
        "phase/engine_start_s": float(generator.startup_s),
        "phase/sync_s": float(generator.reload_s),
    }


def plan_rollout(ctx: StageContext) -> RolloutPlan:
    """Resolve and check everything that can fail cheaply, before an engine is started."""
    cfg, store = ctx.cfg, ctx.store
    iteration = iteration_param(ctx.spec)
    policy_iteration = policy_iteration_param(ctx.spec, iteration)
    rewards = RewardSet.for_stage(cfg.rollout)  # a bad reward fails before vLLM starts
    # so does a bad environment
    environment = environment_from_config(cfg.rollout.env, cfg.rollout.worker_env_allow)
    seed = rollout_seed(cfg.seed, cfg.rollout.sampling)
    table = read_prompt_split(store, ctx.input("data"), PROMPTS_SPLIT)
    per_iteration = cfg.rollout.prompts_per_iteration
    first_slot = DynamicSampling(cfg.rollout.dynamic_sampling, per_iteration).slot(iteration, 0)
    prompts = iteration_prompts(table, per_iteration, first_slot, seed)
    policy = stage_policy(ctx, environment)
    return RolloutPlan(
        ctx=ctx,
        iteration=iteration,
        policy_iteration=policy_iteration,
        seed=seed,
        prompts=prompts,
        rewards=rewards,
        policy=policy,
        prompt_table=table,
        environment=environment,
    )


@dataclass
class Generation:
    """Generation time and tokens summed over a stage's rounds (and, with an environment, their episodes)."""

    seconds: float = 0.0
    tokens: int = 0
    episodes: EpisodeBatch | None = None
    reward_s: float = 0.0  # the reward functions' time

    def add_episodes(self, batch: EpisodeBatch) -> None:
        self.seconds += batch.generation_s
        self.tokens += batch.model_tokens
        if self.episodes is None:
            self.episodes = EpisodeBatch(episodes=[])
        self.episodes.episodes += batch.episodes
        self.episodes.generate_calls += batch.generate_calls
        self.episodes.generation_s += batch.generation_s
        self.episodes.tool_s += batch.tool_s


def generate_samples(
    generator: GenerationEngine,
    prompts: list[Prompt],
    sampling: SamplingConfig,
    seed: int,
    environment: Environment | None,
    cfg: RunConfig,
    policy_dir,
    totals: Generation,
) -> list[Sample]:
    """Single samples, or with `rollout.env` whole episodes, adding their time and tokens to `totals`."""
    if environment is not None:
        batch = run_episodes(
            generator, prompts, environment, sampling, seed, observation_encoder(policy_dir),
            episode_limits(cfg.rollout.env),
        )
        totals.add_episodes(batch)
        return list(batch.episodes)
    start = time.perf_counter()
    samples = generator.generate(prompts, sampling, seed)
    totals.seconds += time.perf_counter() - start
    totals.tokens += sum(s.response_len for s in samples)
    return samples


def sample_round(
    plan: RolloutPlan,
    generator: GenerationEngine,
    prompts: list[Prompt],
    lineage: RolloutLineage,
    sampling_round: int,
    totals: Generation,
) -> pa.Table:
    """Generate and score one round of prompts: its rows of the rollout table."""
    sampling = plan.cfg.rollout.sampling
    samples = generate_samples(
        generator, prompts, sampling, plan.seed, plan.environment, plan.cfg, plan.policy.local_dir, totals
    )
    start = time.perf_counter()
    scored = plan.rewards.score(
        [s.response_text for s in samples],
        [s.ground_truth for s in samples],
        [s.ref for s in samples],
        contexts=[sample_context(s, sampling.max_new_tokens) for s in samples],
    )
    totals.reward_s += time.perf_counter() - start
    return rollout_table(samples, scored, lineage, sampling_round=sampling_round)


def run_rollout(plan: RolloutPlan, generator: GenerationEngine) -> pa.Table:
    """Generate (in rounds, with dynamic sampling), score, write `rollouts.parquet` and commit; returns the table."""
    sampling = plan.cfg.rollout.sampling
    lineage = RolloutLineage(
        policy_uri=plan.policy.uri,
        policy_version=plan.policy.version,
        iteration=plan.iteration,
        seed=plan.seed,
        sampling_params=sampling_json(sampling, plan.seed),
        reward_versions=json.dumps(plan.rewards.versions(), sort_keys=True),
        policy_iteration=plan.policy_iteration,
        environment=environment_json(plan.environment, plan.cfg.rollout.env) if plan.environment else None,
    )
    generation = Generation()

    def generate(slot: int, index: int) -> pa.Table:
        return sample_round(plan, generator, plan.round_prompts(slot, index), lineage, index, generation)

    # Reward and length statistics below are over every generated row (all samples of this policy).
    table, dynamic_metrics = plan.rounds.run(plan.iteration, generate)
    generation_s = generation.seconds
    metrics = {
        **rollout_metrics(table, plan.rewards.primary_column),
        **dynamic_metrics,
        "prompts": dynamic_metrics["dynamic_sampling/groups_generated"],
        "iteration": plan.iteration,
        "policy_iteration": plan.policy_iteration,
        "generation_s": generation_s,
        "tokens_per_s": generation.tokens / generation_s if generation_s > 0 else 0.0,
        **engine_metrics(plan.cfg, generator),
        "num_engines": plan.cfg.rollout.num_engines,
        "policy_version": plan.policy.version,
        "policy_manifest_sha256": plan.policy.manifest_sha256,
        "reward_versions": plan.rewards.versions(),
        "reward_weights": plan.rewards.weights(),
        "primary_reward": plan.rewards.primary_column,
        **plan.rewards.failures,  # reward/timeouts, reward/crashes, reward/zeroed (forge_core.rewards.isolation)
        **(episode_metrics(generation.episodes) if generation.episodes is not None else {}),
        # The rollout side's phases (engine_metrics adds the engine's; the GRPO stage records its own).
        "phase/sample_s": generation_s,
        "phase/reward_s": generation.reward_s,
        "wall_s": plan.ctx.wall_s(),
    }
    writer = plan.ctx.writer()
    writer.write_table(ROLLOUTS_TABLE, table)
    writer.commit(config=plan.ctx.config, inputs=plan.inputs, metrics=metrics)
    log.info(
        "committed %s: %d samples, reward %.3f +- %.3f, pass rate %.3f, %.0f tokens/s",
        plan.output_uri,
        table.num_rows,
        metrics["reward_mean"],
        metrics["reward_std"],
        metrics["pass_rate"],
        metrics["tokens_per_s"],
    )
    return table


def run(ctx: StageContext) -> None:
    """Sample this iteration's prompts from the policy, score them, commit `rollouts`."""
    plan = plan_rollout(ctx)
    try:
        with stage_engines(plan.cfg, plan.policy, seed=plan.seed, stage=plan.ctx.stage.name) as generator:
            run_rollout(plan, generator)
    finally:
        release_policy(plan.policy)  # an engine actor keeps its own lease
