"""The one generation protocol: what rollout and evaluation code calls, whoever serves the samples.

    samples = engine.generate(prompts, sampling, seed)   # sampling.group_size samples per prompt, prompt order
    engine.policy_version                                # the weights it serves (policy.weights_version)
    engine.startup_s, engine.reload_s                    # start-up (0 if already running), last reload (0 if none)
    engine.reload(policy_dir, policy_version)            # serve other weights of the same architecture
    engine.close()

Implementations: `Generator` (one vLLM engine in this process) and `EngineRouter` over `EngineConnection`s
such as `HostedEngine` (an engine actor on the Ray cluster). Samples depend on (prompt, sampling, seed) alone,
each prompt seeded by `request_seed`, so every implementation returns the same samples however the prompts
are split. `reload` of the version already served does nothing and returns 0.0.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from forge_core.config.schema import SamplingConfig
from forge_core.launch.errors import RetryableStageError
from forge_core.rollout.types import Prompt, Sample


@runtime_checkable
class GenerationEngine(Protocol):
    """Turns prompts into samples with known weights (module docstring)."""

    @property
    def policy_version(self) -> str: ...

    @property
    def startup_s(self) -> float: ...

    @property
    def reload_s(self) -> float: ...

    def generate(self, prompts: Sequence[Prompt], sampling: SamplingConfig, seed: int) -> list[Sample]: ...

    def reload(self, policy_dir: str | os.PathLike, policy_version: str) -> float: ...

    def close(self) -> None: ...


@runtime_checkable
class EngineConnection(GenerationEngine, Protocol):
    """One engine of a router, with a name and pid for messages; `generate` raises `EngineLost` when the engine
    is gone; `close` ends the connection (and the engine, when the connection owns it)."""

    @property
    def name(self) -> str: ...

    @property
    def pid(self) -> int: ...


class EngineLost(RetryableStageError):
    """An engine is gone (process died, connection ended, or it failed): a router re-routes its prompts."""


class PolicyVersionMismatch(RetryableStageError):
    """A generate request expected another policy version than the one the engine serves."""
