"""The evaluate stage: scores a policy on held-out prompts with the run's engines.

    python -m forge_core.run evaluate --spec <output_uri>/_specs/<attempt>.json

Inputs:
  policy   a committed `sft` or `grpo` artifact (its `policy/` HF folder is what gets evaluated).
  data     a committed `data` artifact; the prompts are the first `eval.num_prompts` rows of `eval.parquet`.
Generation is greedy when `eval.pass_k == 1`, else `pass_k` samples per prompt at the rollout temperature,
scored with the rollout's rewards. With `rollout.env` each sample is a whole episode and the metrics add `env/*`.

Output `<output_uri>` (kind `eval`): `results.parquet` (one row per prompt: responses, per-sample rewards,
passed) and a manifest whose metrics hold accuracy, mean_reward, n (prompts), k and length statistics.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from forge_core.artifacts.policy import PolicyRef, release_policy
from forge_core.config import RunConfig
from forge_core.envs import Environment, environment_from_config, environment_json, episode_metrics
from forge_core.rewards import RewardSet
from forge_core.rollout.evaluation import RESULTS_TABLE, EvalOutcome, evaluate, score_evaluation
from forge_core.rollout.prompts import prompts_from_table
from forge_core.rollout.protocol import GenerationEngine
from forge_core.rollout.sampling import evaluation_sampling
from forge_core.rollout.types import Prompt
from forge_core.run.engines import stage_engines, stage_policy
from forge_core.run.rollout import Generation, engine_metrics, generate_samples, read_prompt_split
from forge_core.run.scaffold import StageContext

log = logging.getLogger(__name__)

EVAL_SPLIT = "eval"


@dataclass(frozen=True)
class EvalPlan:
    ctx: StageContext  # the checked stage run: config, store, inputs, clock
    prompts: list[Prompt]
    rewards: RewardSet
    policy: PolicyRef
    environment: Environment | None = None  # rollout.env: evaluate whole episodes

    @property
    def cfg(self) -> RunConfig:
        return self.ctx.cfg


def plan_evaluation(ctx: StageContext) -> EvalPlan:
    """Resolve the prompts, rewards and policy before an engine is started."""
    cfg = ctx.cfg
    data_uri = ctx.input("data")
    rewards = RewardSet.for_stage(cfg.rollout)
    environment = environment_from_config(cfg.rollout.env, cfg.rollout.worker_env_allow)
    table = read_prompt_split(ctx.store, data_uri, EVAL_SPLIT)
    if table.num_rows < cfg.eval.num_prompts:
        log.warning(
            "eval.num_prompts=%d but %s has %d eval prompts: evaluating all of them (n=%d in the metrics)",
            cfg.eval.num_prompts,
            data_uri,
            table.num_rows,
            table.num_rows,
        )
    prompts = prompts_from_table(table.slice(0, cfg.eval.num_prompts))
    policy = stage_policy(ctx, environment)
    return EvalPlan(ctx=ctx, prompts=prompts, rewards=rewards, policy=policy, environment=environment)


def run_evaluation(plan: EvalPlan, generator: GenerationEngine) -> EvalOutcome:
    """Generate on the eval prompts, score, write `results.parquet` and commit; returns the outcome."""
    sampling = evaluation_sampling(plan.cfg.eval, plan.cfg.rollout.sampling)
    env_metrics = {}
    if plan.environment is None:
        outcome = evaluate(generator, plan.prompts, plan.rewards, sampling, seed=plan.cfg.seed)
    else:
        totals = Generation()
        samples = generate_samples(
            generator, plan.prompts, sampling, plan.cfg.seed, plan.environment, plan.cfg, plan.policy.local_dir,
            totals,
        )
        outcome = score_evaluation(plan.prompts, samples, plan.rewards, sampling, totals.seconds)
        env_metrics = {
            **episode_metrics(totals.episodes),
            "environment": environment_json(plan.environment, plan.cfg.rollout.env),
        }
    metrics = {
        **outcome.metrics,
        **env_metrics,
        **engine_metrics(plan.cfg, generator),
        "policy_uri": plan.policy.uri,
        "policy_version": plan.policy.version,
        "policy_manifest_sha256": plan.policy.manifest_sha256,
        "reward_versions": plan.rewards.versions(),
        "primary_reward": plan.rewards.primary_column,
        **plan.rewards.failures,  # reward/timeouts, reward/crashes, reward/zeroed (forge_core.rewards.isolation)
        "sampling": sampling.model_dump(),
        "wall_s": plan.ctx.wall_s(),
    }
    writer = plan.ctx.writer()
    writer.write_table(RESULTS_TABLE, outcome.table)
    writer.commit(config=plan.ctx.config, inputs=plan.ctx.inputs, metrics=metrics)
    log.info(
        "committed %s: accuracy %.3f, mean reward %.3f over %d prompts (k=%d)",
        plan.ctx.output_uri,
        metrics["accuracy"],
        metrics["mean_reward"],
        int(metrics["n"]),
        int(metrics["k"]),
    )
    return outcome


def run(ctx: StageContext) -> None:
    """Evaluate the policy on the held-out split and commit the `eval` artifact."""
    plan = plan_evaluation(ctx)
    try:
        with stage_engines(plan.cfg, plan.policy, seed=plan.cfg.seed, stage=plan.ctx.stage.name) as generator:
            run_evaluation(plan, generator)
    finally:
        release_policy(plan.policy)  # an engine actor keeps its own lease
