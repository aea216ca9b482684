"""Which runner runs a stage: chosen here, and only here, from the stage's record and the run's config.

    runner = runner_for(cfg, "grpo")          # ClusterRunner | TaskProcessRunner | TrainerGroupRunner
    result = runner.run(plan, log, cancel)    # forge_core.run.runner: the interface, deadline, classification

Every stage runs on the run's Ray cluster. A stage whose record names a flow runner (`Stage.flow_runner`) is
served by the flow run's long-lived parts when FlowResources.serves says so:
- "task_process" (rollout, evaluate): a thread of the task's process, sampling with the run's engine actors;
- "trainer_group" (GRPO with `grpo.trainer_lifetime: flow`): an order to the run's trainer group.
Every other stage gets its own worker launch, a gang on the Ray cluster (forge_core.run.cluster_runner).
"""

from __future__ import annotations

from forge_core.config import RunConfig
from forge_core.run.cluster_runner import ClusterRunner
from forge_core.run.in_process import TaskProcessRunner
from forge_core.run.resources import FlowResources
from forge_core.run.runner import FlowProcessRunner, Runner
from forge_core.run.trainer_group import TrainerGroupRunner
from forge_core.stages import FlowRunner, stage_named

# The flow runners by Stage.flow_runner.
FLOW_RUNNERS: dict[FlowRunner, type[FlowProcessRunner]] = {
    "task_process": TaskProcessRunner,
    "trainer_group": TrainerGroupRunner,
}


def runner_for(cfg: RunConfig, stage: str) -> Runner:
    """The runner of `stage` in the run `cfg` describes."""
    record = stage_named(stage)
    if record.flow_runner is not None:
        resources = FlowResources.of(cfg)
        if resources.serves(record):
            return FLOW_RUNNERS[record.flow_runner](cfg, stage, resources)
    return ClusterRunner(cfg, stage)
