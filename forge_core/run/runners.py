"""Which runner runs a stage: chosen here, and only here, from the stage's record and the run's config.

    runner = runner_for(cfg, "grpo")          # LaunchRunner | ClusterRunner | TaskProcessRunner | TrainerJobRunner
    result = runner.run(plan, log, cancel)    # forge_core.run.runner: the interface, deadline, classification

A stage whose registry record names a lifetime setting (`Stage.lifetime_key`: `rollout.engine_lifetime` for
rollout and evaluate, `grpo.trainer_lifetime` for GRPO) and whose setting is "flow" is served by the flow run's
long-lived process named by `Stage.flow_runner` (its FlowResources: forge_core.run.resources): a thread of the
task's process talking to the flow's engines, or an order to the flow's trainer job; with `launch.placement:
pool` that process runs in the run's resident on a Ray node of the stage's pool (forge_core.run.resident). Every
other stage, and every stage with "stage", gets its own worker launch: here (LaunchRunner), or with pool as a
gang on the Ray cluster (forge_core.run.cluster_runner.ClusterRunner). The lifetimes stay where they were
(`rollout.*`, `grpo.*`) rather than moving under `launch.<stage>`: they belong to the shared process, not to one
stage (one engine lifetime serves both rollout and evaluate, which must agree), and existing configs keep working.
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
        if resources.lifetime(record) == "flow":
            return flow_lifetime_runner(cfg, stage, resources)
    if cfg.launch.placement == "pool":
        return ClusterRunner(cfg, stage)
    return LaunchRunner(cfg, stage)
