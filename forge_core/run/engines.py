"""Which engines a rollout or evaluate stage samples with: engine actors on the run's Ray cluster.

    with stage_engines(plan.cfg, plan.policy, seed, plan.stage) as generator:   # a GenerationEngine serving plan.policy
        run_rollout(plan, generator)

The engines are actors on the rollout pool's nodes: the flow run's (`rollout.engine_lifetime: flow`, held by its
FlowResources across stages) or the stage's own (`stage`). A policy the run's trainer group holds reaches them
from its ranks, not from the store (forge_core.run.weight_sync). FlowResources.stop_engines ends the stage's
calls into them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from forge_core.artifacts.policy import PolicyRef, fetch_policy, policy_cache_root, policy_ref
from forge_core.config import RunConfig
from forge_core.rollout.protocol import GenerationEngine
from forge_core.run.resources import FlowResources
from forge_core.run.scaffold import StageContext
from forge_core.run.weight_sync import trainer_pusher
from forge_core.storage.manifest import placement_scope


@contextlib.contextmanager
def stage_engines(cfg: RunConfig, policy: PolicyRef, seed: int, stage: str) -> Iterator[GenerationEngine]:
    """The engines serving `policy` to `stage`; `seed` is the engines' own (samples depend on per-request seeds)."""
    resources = FlowResources.of(cfg)
    with resources.engine_actors(seed) as engines:
        router = engines.serve(policy, stage, push=trainer_pusher(resources, policy))
        with placement_scope(engines.placement()):
            yield router


def stage_policy(ctx: StageContext, environment: object | None) -> PolicyRef:
    """The stage's `policy` input, fetched locally only when an environment needs its tokenizer (the engines
    get the weights themselves)."""
    if environment is None:
        return policy_ref(ctx.store, ctx.input("policy"))
    return fetch_policy(ctx.store, ctx.input("policy"), cache_root=policy_cache_root(ctx.cfg.logging.dir))
