"""Which runner runs a stage: chosen here, and only here, from the stage's record and the run's config.

    runner = runner_for(cfg, "grpo")          # LaunchRunner | ClusterRunner | TaskProcessRunner | TrainerJobRunner
    result = runner.run(plan, log, cancel)    # forge_core.run.runner: the interface, deadline, classification

A stage whose registry record names a flow runner (`Stage.flow_runner`) may be served by the flow run's own
processes instead of a worker launch of its own:
- the engine-client stages (rollout, evaluate: "task_process") run on a thread of the task's process when the
  run's engines are long-lived (`rollout.engine_lifetime: flow`) or live on the Ray cluster (`launch.placement:
  pool`: engine actors on the rollout pool's nodes, forge_core.run.engines), where a worker launch would only
  relay between the flow and its engines;
- GRPO ("trainer_job") is an order to the run's trainer job with `grpo.trainer_lifetime: flow`; with pool the
  job runs in the run's trainer resident on a Ray node of its pool (forge_core.run.resident).
Every other stage gets its own worker launch: here (LaunchRunner), or with pool as a gang on the Ray cluster
(forge_core.run.cluster_runner.ClusterRunner). The lifetimes stay where they were (`rollout.*`, `grpo.*`) rather
than moving under `launch.<stage>`: they belong to the shared process, not to one stage (one engine lifetime
serves both rollout and evaluate, which must agree), and existing configs keep working.
"""

from __future__ import annotations

from forge_core.config import RunConfig
from forge_core.run.cluster_runner import ClusterRunner
from forge_core.run.resident import flow_lifetime_runner
from forge_core.run.resources import FlowResources
from forge_core.run.runner import LaunchRunner, Runner
from forge_core.stages import stage_named


def runner_for(cfg: RunConfig, stage: str) -> Runner:
    """The runner of `stage` in the run `cfg` describes (module docstring)."""
    record = stage_named(stage)
    if record.flow_runner is not None:
        resources = FlowResources.of(cfg)
        if resources.serves(record):
            return flow_lifetime_runner(cfg, stage, resources)
    if cfg.launch.placement == "pool":
        return ClusterRunner(cfg, stage)
    return LaunchRunner(cfg, stage)
