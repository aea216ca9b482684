"""The one generation protocol: what rollout and evaluation code calls, whoever serves the samples.

    samples = engine.generate(prompts, sampling, seed)   # sampling.group_size samples per prompt, prompt order
    engine.policy_version                                # the weights it serves (policy.weights_version)
    engine.startup_s, engine.reload_s                    # its start-up seconds (0 when it was running already)
                                                         # and its last reload's seconds (0 before any)
    engine.reload(policy_dir, policy_version)            # serve other weights of the same architecture
    engine.close()

Implementations:
- `Generator` (generator.py): one vLLM engine in this process;
- `EngineRouter` (router.py): several engines behind one handle, prompts split across them, a lost engine's
  prompts re-routed to the others; its engines are `EngineConnection`s: `HostedEngine` (actor_engines.py), an
  engine actor on the Ray cluster that owns a Generator.

Samples depend on (prompt, sampling, seed) alone: each prompt is sampled with its own
`request_seed(seed, group_id, prompt_id)` (sampling.py), so every implementation returns the same samples
for the same call, however the prompts are split. `reload` with the version already served does nothing (the
version is the weights' checksum) and returns 0.0.
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
    """One engine of a router, reached over a pipe or a socket: a GenerationEngine with a name and a pid (for
    messages). `generate` raises `EngineLost` when the engine is gone; `close` ends the connection (and the
    engine, when the connection owns it)."""

    @property
    def name(self) -> str: ...

    @property
    def pid(self) -> int: ...


class EngineLost(RetryableStageError):
    """An engine is gone (its process died, its connection ended, or it failed and exits): a router serves its
    unfinished prompts with the others; a retry of the stage starts a new one."""


class PolicyVersionMismatch(RetryableStageError):
    """A generate request expected another policy version than the one the engine serves."""
