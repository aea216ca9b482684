"""Which engines a rollout or evaluate stage samples with: engine actors on the run's Ray cluster.

    with stage_engines(plan.cfg, plan.policy, seed, plan.stage) as generator:   # a GenerationEngine serving plan.policy
        run_rollout(plan, generator)

The engines are actors on the rollout pool's nodes (forge_core.rollout.actor_engines): the flow run's
(`rollout.engine_lifetime: flow`, held by its FlowResources across stages and ended with it) or the stage's own
(`stage`, ended when the stage ends); what the stage commits records the pool and each engine's Ray node. A stop
of the run's engines (FlowResources.stop_engines: a deadline, a cancel) ends the stage's calls into them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from forge_core.artifacts.policy import PolicyRef
from forge_core.config import RunConfig
from forge_core.rollout.protocol import GenerationEngine
from forge_core.run.resources import FlowResources
from forge_core.storage.manifest import placement_scope


@contextlib.contextmanager
def stage_engines(cfg: RunConfig, policy: PolicyRef, seed: int, stage: str) -> Iterator[GenerationEngine]:
    """The engines serving `policy` to `stage` (module docstring); `seed` is the engines' own seed (samples depend
    on the per-request seeds only)."""
    with FlowResources.of(cfg).engine_actors(seed) as engines:
        router = engines.serve(policy, stage)
        with placement_scope(engines.placement()):
            yield router
