"""Which runner runs a stage: chosen here, and only here, from the stage's record and the run's config.

    runner = runner_for(cfg, "grpo")          # LaunchRunner | TaskProcessRunner | TrainerJobRunner
    result = runner.run(plan, log, cancel)    # forge_core.run.runner: the interface, deadline, classification

A stage whose registry record names a lifetime setting (`Stage.lifetime_key`: `rollout.engine_lifetime` for
rollout and evaluate, `grpo.trainer_lifetime` for GRPO) and whose setting is "flow" is served by the flow run's
long-lived process named by `Stage.flow_runner` (its FlowResources: forge_core.run.resources): a thread of the
task's process talking to the flow's engines, or an order to the flow's trainer job. Every other stage, and
every stage with "stage", gets its own worker launch. The lifetimes stay where they were (`rollout.*`,
`grpo.*`) rather than moving under `launch.<stage>`: they belong to the shared process, not to one stage (one
engine lifetime serves both rollout and evaluate, which must agree), and existing configs keep working.
A runner that places a stage on another machine (a Prefect deployment on a pool's worker) is one more
implementation of forge_core.run.runner.Runner, chosen here.
"""

from __future__ import annotations

from forge_core.config import RunConfig
from forge_core.run.in_process import TaskProcessRunner
from forge_core.run.resources import FlowResources
from forge_core.run.runner import LaunchRunner, Runner
from forge_core.run.trainer_job import TrainerJobRunner
from forge_core.stages import stage_named

_FLOW_RUNNERS = {runner.serves: runner for runner in (TaskProcessRunner, TrainerJobRunner)}


def runner_for(cfg: RunConfig, stage: str) -> Runner:
    """The runner of `stage` in the run `cfg` describes (module docstring)."""
    record = stage_named(stage)
    if record.flow_runner is not None:
        resources = FlowResources.of(cfg)
        if resources.lifetime(record) == "flow":
            return _FLOW_RUNNERS[record.flow_runner](cfg, stage, resources)
    return LaunchRunner(cfg, stage)
