"""The post-training flow: prepare -> SFT -> evaluate -> N x (rollout -> GRPO -> evaluate) -> summary.

Run it locally (ephemeral Prefect API) or as a deployment:

    python -m flows.post_train configs/demo_cpu.yaml sft.steps=50
    prefect deployment run 'post-train/demo-cpu' --param overrides='["grpo.iterations=2"]'

Stages run one after another in the flow's own thread (no `.submit()`): a cancelled or killed flow then takes
its launches down with it instead of leaving a task `Running` with orphaned ranks.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, field

from prefect import Task, flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run

from forge_core.config import RunConfig, config_to_json, load_config
from forge_core.launch import install_sigterm_handler, terminate_all_live
from forge_core.storage import ObjectStore
from tasks import evaluate, generate_rollouts, prepare_data, train_grpo, train_sft


@dataclass
class EvalPoint:
    label: str
    policy_uri: str
    eval_uri: str
    accuracy: float
    mean_reward: float


@dataclass
class PipelineSummary:
    flow_run_id: str
    data_uri: str
    sft_uri: str
    final_policy_uri: str
    evals: list[EvalPoint] = field(default_factory=list)
    rollouts: list[str] = field(default_factory=list)

    def as_markdown(self) -> str:
        lines = ["| stage | accuracy | mean reward | policy |", "| --- | --- | --- | --- |"]
        for point in self.evals:
            lines.append(
                f"| {point.label} | {point.accuracy:.3f} | {point.mean_reward:.3f} | `{point.policy_uri}` |"
            )
        return "\n".join(
            [
                f"## forgeflow post-training (flow run `{self.flow_run_id}`)",
                "",
                *lines,
                "",
                f"Data: `{self.data_uri}`",
                "",
                f"Final policy: `{self.final_policy_uri}`",
            ]
        )


@dataclass(frozen=True)
class StageTasks:
    prepare: Task
    sft: Task
    rollout: Task
    grpo: Task
    evaluate: Task


def kill_launches(flow, flow_run, state) -> None:
    """Cancellation/crash hook: take down every process tree this flow run launched."""
    terminate_all_live()


def _eval_point(store: ObjectStore, label: str, policy_uri: str, eval_uri: str) -> EvalPoint:
    metrics = store.read_manifest(eval_uri).metrics
    return EvalPoint(label, policy_uri, eval_uri, float(metrics["accuracy"]), float(metrics["mean_reward"]))


def stage_tasks(cfg: RunConfig) -> StageTasks:
    """The stage tasks with each stage's retry budget from `launch.<stage>.retries`."""
    return StageTasks(
        prepare=prepare_data.with_options(retries=cfg.launch.prepare.retries),
        sft=train_sft.with_options(retries=cfg.launch.sft.retries),
        rollout=generate_rollouts.with_options(retries=cfg.launch.rollout.retries),
        grpo=train_grpo.with_options(retries=cfg.launch.grpo.retries),
        evaluate=evaluate.with_options(retries=cfg.launch.evaluate.retries),
    )


def run_pipeline(cfg: RunConfig) -> PipelineSummary:
    """The stage graph; called inside a flow so every stage is a task run."""
    logger = get_run_logger()
    store = ObjectStore.from_config(cfg.storage)
    config_json = config_to_json(cfg)
    t = stage_tasks(cfg)

    data_uri = t.prepare(config_json)
    sft_uri = t.sft(config_json, data_uri)
    summary = PipelineSummary(
        flow_run_id=str(flow_run.get_id() or "local"),
        data_uri=data_uri,
        sft_uri=sft_uri,
        final_policy_uri=sft_uri,
    )
    summary.evals.append(_eval_point(store, "sft", sft_uri, t.evaluate(config_json, sft_uri, data_uri)))
    logger.info("after SFT: accuracy %.3f", summary.evals[-1].accuracy)

    policy_uri = sft_uri
    for iteration in range(cfg.grpo.iterations):
        rollouts_uri = t.rollout(config_json, policy_uri, data_uri, iteration)
        policy_uri = t.grpo(config_json, policy_uri, rollouts_uri, iteration)
        summary.rollouts.append(rollouts_uri)
        eval_uri = t.evaluate(config_json, policy_uri, data_uri)
        point = _eval_point(store, f"grpo-{iteration + 1}", policy_uri, eval_uri)
        summary.evals.append(point)
        logger.info("after GRPO iteration %d: accuracy %.3f", iteration + 1, point.accuracy)
    summary.final_policy_uri = policy_uri

    create_markdown_artifact(markdown=summary.as_markdown(), key="post-train-summary", description="summary")
    return summary


@flow(name="post-train", on_cancellation=[kill_launches], on_crashed=[kill_launches], log_prints=True)
def post_train(config: str = "configs/demo_cpu.yaml", overrides: list[str] | None = None) -> dict:
    """Post-train a model per the YAML `config` with `key=value` `overrides` applied; returns the summary."""
    cfg = load_config(config, list(overrides or []))
    # A SIGTERM to the flow process (worker cancel) must take the launched process trees down with it.
    install_sigterm_handler()
    return asdict(run_pipeline(cfg))


if __name__ == "__main__":
    post_train(sys.argv[1] if len(sys.argv) > 1 else "configs/demo_cpu.yaml", sys.argv[2:])
