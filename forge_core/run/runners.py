"""Which runner runs a stage: chosen here, and only here, from the stage's record and the run's config.

    runner = runner_for(cfg, "grpo")          # LaunchRunner | ClusterRunner | TaskProcessRunner | TrainerJobRunner | TrainerGroupRunner
    result = runner.run(plan, log, cancel)    # forge_core.run.runner: the interface, deadline, classification

A stage whose registry record names a flow runner (`Stage.flow_runner`) may be served by the flow run's own
processes instead of a worker launch of its own:
- the engine-client stages (rollout, evaluate: "task_process") run on a thread of the task's process when the
  run's engines are long-lived (`rollout.engine_lifetime: flow`) or live on the Ray cluster (`launch.placement:
  pool`: engine actors on the rollout pool's nodes, forge_core.run.engines), where a worker launch would only
  relay between the flow and its engines;
- GRPO ("trainer_job") is an order to the run's trainer job with `grpo.trainer_lifetime: flow`; with pool an
  order to the run's trainer group, one Ray actor per rank on the nodes of its pool (forge_core.run.trainer_group).
Every other stage gets its own worker launch: here (LaunchRunner), or with pool as a gang on the Ray cluster
(forge_core.run.cluster_runner.ClusterRunner). The lifetimes stay where they were (`rollout.*`, `grpo.*`) rather
than moving under `launch.<stage>`: they belong to the shared process, not to one stage (one engine lifetime
serves both rollout and evaluate, which must agree), and existing configs keep working.
"""

from __future__ import annotations

from forge_core.config import RunConfig
from forge_core.run.cluster_runner import ClusterRunner
from forge_core.run.in_process import TaskProcessRunner
from forge_core.run.resources import FlowResources
from forge_core.run.runner import FlowProcessRunner, LaunchRunner, Runner
from forge_core.run.trainer_group import TrainerGroupRunner
from forge_core.run.trainer_job import TrainerJobRunner
from forge_core.stages import stage_named

# The flow runners by Stage.flow_runner and launch.placement.
FLOW_RUNNERS: dict[tuple[str, str], type[FlowProcessRunner]] = {
    ("task_process", "local"): TaskProcessRunner,
    ("task_process", "pool"): TaskProcessRunner,  # its engines are Ray actors: forge_core.run.engines
    ("trainer_job", "local"): TrainerJobRunner,
    ("trainer_job", "pool"): TrainerGroupRunner,
}


def runner_for(cfg: RunConfig, stage: str) -> Runner:
    """The runner of `stage` in the run `cfg` describes (module docstring)."""
    record = stage_named(stage)
    if record.flow_runner is not None:
        resources = FlowResources.of(cfg)
        if resources.serves(record):
            return FLOW_RUNNERS[(record.flow_runner, cfg.launch.placement)](cfg, stage, resources)
    if cfg.launch.placement == "pool":
        return ClusterRunner(cfg, stage)
    return LaunchRunner(cfg, stage)
