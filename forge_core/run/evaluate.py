"""Worker entry point of the evaluate stage (one plain process; vLLM starts its own):

    python -m forge_core.run evaluate --spec <output_uri>/_spec.json

Inputs (`spec.inputs`):
  policy   a committed `sft` or `grpo` artifact (its `policy/` HF folder is what gets evaluated).
  data     a committed `data` artifact; the held-out prompts are the first `eval.num_prompts` rows of its
           `eval.parquet`.
Generation is greedy when `eval.pass_k == 1`, else `pass_k` samples per prompt at the rollout temperature;
the rewards are the rollout's (`rollout.rewards`), so evaluation measures what GRPO optimises.

Output `<output_uri>` (kind `eval`): `results.parquet` (one row per prompt: responses, per-sample rewards,
passed) and a manifest whose metrics hold accuracy, mean_reward, n (prompts), k and length statistics.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field

from forge_core.config import RunConfig, config_to_dict
from forge_core.rewards import RewardSet
from forge_core.rollout.evaluation import RESULTS_TABLE, EvalOutcome, evaluate
from forge_core.rollout.lifetime import stage_generator
from forge_core.rollout.policy import PolicyRef, fetch_policy, release_policy
from forge_core.rollout.prompts import prompts_from_table
from forge_core.rollout.sampling import evaluation_sampling
from forge_core.rollout.types import Prompt
from forge_core.run.rollout import DATA_INPUT, POLICY_INPUT, engine_metrics, read_prompt_split, required_input
from forge_core.run.spec import StageSpec
from forge_core.storage import ObjectStore

log = logging.getLogger(__name__)

STAGE = "evaluate"
KIND = "eval"
EVAL_SPLIT = "eval"


@dataclass(frozen=True)
class EvalPlan:
    cfg: RunConfig
    store: ObjectStore
    output_uri: str
    inputs: dict[str, str]
    prompts: list[Prompt]
    rewards: RewardSet
    policy: PolicyRef
    # perf_counter() when the stage body began: the manifest's wall_s (bench/orchestration_overhead.py)
    started_at: float = field(default_factory=time.perf_counter)


def plan_evaluation(spec: StageSpec) -> EvalPlan | None:
    """Resolve inputs, prompts and rewards; None when the output is already committed."""
    started_at = time.perf_counter()
    cfg = spec.run_config()
    store = ObjectStore.from_config(cfg.storage)
    if store.is_committed(spec.output_uri):
        return None
    policy_uri = required_input(
        spec, POLICY_INPUT, "a committed sft or grpo artifact (the policy to evaluate)"
    )
    data_uri = required_input(spec, DATA_INPUT, "a committed data artifact (eval.parquet)")
    rewards = RewardSet.for_stage(cfg.rollout)
    table = read_prompt_split(store, data_uri, EVAL_SPLIT)
    if table.num_rows < cfg.eval.num_prompts:
        log.warning(
            "eval.num_prompts=%d but %s has %d eval prompts: evaluating all of them (n=%d in the metrics)",
            cfg.eval.num_prompts,
            data_uri,
            table.num_rows,
            table.num_rows,
        )
    prompts = prompts_from_table(table.slice(0, cfg.eval.num_prompts))
    policy = fetch_policy(store, policy_uri, POLICY_INPUT)
    return EvalPlan(
        cfg=cfg,
        store=store,
        output_uri=spec.output_uri,
        inputs={POLICY_INPUT: policy_uri, DATA_INPUT: data_uri},
        prompts=prompts,
        rewards=rewards,
        policy=policy,
        started_at=started_at,
    )


def run_evaluation(plan: EvalPlan, generator) -> EvalOutcome:
    """Generate on the eval prompts, score, write `results.parquet` and commit; returns the outcome."""
    sampling = evaluation_sampling(plan.cfg.eval, plan.cfg.rollout.sampling)
    outcome = evaluate(generator, plan.prompts, plan.rewards, sampling, seed=plan.cfg.seed)
    metrics = {
        **outcome.metrics,
        **engine_metrics(plan.cfg, generator),
        "policy_uri": plan.policy.uri,
        "policy_version": plan.policy.version,
        "policy_manifest_sha256": plan.policy.manifest_sha256,
        "reward_versions": plan.rewards.versions(),
        "primary_reward": plan.rewards.primary_column,
        **plan.rewards.failures,  # reward/timeouts, reward/crashes, reward/zeroed (forge_core.rewards.isolation)
        "sampling": dataclasses.asdict(sampling),
        "wall_s": time.perf_counter() - plan.started_at,
    }
    writer = plan.store.writer(plan.output_uri, kind=KIND, stage=STAGE)
    writer.write_table(RESULTS_TABLE, outcome.table)
    writer.commit(config=config_to_dict(plan.cfg), inputs=plan.inputs, metrics=metrics)
    log.info(
        "committed %s: accuracy %.3f, mean reward %.3f over %d prompts (k=%d)",
        plan.output_uri,
        metrics["accuracy"],
        metrics["mean_reward"],
        int(metrics["n"]),
        int(metrics["k"]),
    )
    return outcome


def main(spec: StageSpec) -> None:
    """The worker process's entry: `run(spec)` with its log lines on stderr."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run(spec)


def run(spec: StageSpec) -> None:
    """Evaluate the policy on the held-out split and commit the `eval` artifact (module docstring).

    Also what a task calls in its own process (forge_core.run.in_process)."""
    plan = plan_evaluation(spec)
    if plan is None:
        log.info("%s is already committed; nothing to do", spec.output_uri)
        return
    try:
        with stage_generator(plan.cfg, plan.policy, seed=plan.cfg.seed) as generator:
            run_evaluation(plan, generator)
    finally:
        release_policy(plan.policy)  # the cache may prune it again (an engine service keeps its own lease)
