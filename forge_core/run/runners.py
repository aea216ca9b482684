"""Which runner runs a stage: chosen here, and only here, from the stage's record and the run's config.

    runner = runner_for(cfg, "grpo")          # LaunchRunner | TaskProcessRunner | TrainerJobRunner | PoolRunner
    result = runner.run(plan, log, cancel)    # forge_core.run.runner: the interface, deadline, classification

A stage whose registry record names a lifetime setting (`Stage.lifetime_key`: `rollout.engine_lifetime` for
rollout and evaluate, `grpo.trainer_lifetime` for GRPO) and whose setting is "flow" is served by the flow run's
long-lived process named by `Stage.flow_runner` (its FlowResources: forge_core.run.resources): a thread of the
task's process talking to the flow's engines, or an order to the flow's trainer job. Every other stage, and
every stage with "stage", gets its own worker launch. The lifetimes stay where they were (`rollout.*`,
`grpo.*`) rather than moving under `launch.<stage>`: they belong to the shared process, not to one stage (one
engine lifetime serves both rollout and evaluate, which must agree), and existing configs keep working.
With `launch.placement: pool` every stage runs on its pool's workers instead, started through the `dispatcher`
the Prefect layer hands in (tasks/placement.py): a stage-lifetime stage as node runs of the pool's stage
deployment (forge_core.run.placement.PoolRunner), a flow-lifetime stage as an order to the run's resident on its
pool, which holds the engines or the trainer job there (forge_core.run.resident.ResidentRunner).
"""

from __future__ import annotations

from forge_core.config import RunConfig
from forge_core.run.placement import NodeDispatcher, PoolRunner
from forge_core.run.resident import flow_lifetime_runner
from forge_core.run.resources import FlowResources
from forge_core.run.runner import LaunchRunner, Runner
from forge_core.stages import stage_named


def runner_for(cfg: RunConfig, stage: str, dispatcher: NodeDispatcher | None = None) -> Runner:
    """The runner of `stage` in the run `cfg` describes (module docstring); `dispatcher` starts node runs on
    a pool's workers (needed with launch.placement=pool)."""
    record = stage_named(stage)
    if cfg.launch.placement == "pool" and dispatcher is None:
        raise ValueError(
            f"launch.placement='pool': stage {stage!r} runs on the workers of pool "
            f"{cfg.launch.for_stage(stage).pool!r}, which needs a node dispatcher (the stage tasks pass "
            "tasks.placement's); run the stage through the flow's tasks, or set launch.placement=local"
        )
    if record.flow_runner is not None:
        resources = FlowResources.of(cfg)
        if resources.lifetime(record) == "flow":
            return flow_lifetime_runner(cfg, stage, resources, dispatcher)
    if cfg.launch.placement == "pool":
        return PoolRunner(cfg, stage, dispatcher)
    return LaunchRunner(cfg, stage)
