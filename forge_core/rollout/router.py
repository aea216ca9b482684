"""Several engines behind one GenerationEngine: prompts split across the live engines, samples gathered in prompt
order, a lost engine's prompts re-routed to the others.

    router = EngineRouter(connections)             # EngineConnection's: actor_engines.HostedEngine
    samples = router.generate(prompts, cfg.rollout.sampling, seed=7)
    router.reload(policy_dir, version)             # every live engine (concurrently)
    router.close()                                 # closes every connection (the engine actors keep running)

Prompts are seeded one by one (sampling.request_seed), so splitting and re-routing change no sample. An engine
lost mid-request (EngineLost) is dropped with a warning and its unfinished prompts go to the live ones; only
when none is left does `generate` raise EngineLost (retryable). Any other error (a ValueError for a bad
prompt, a PolicyVersionMismatch) is raised as is once the round is over.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Self, TypeVar

from forge_core.config.schema import SamplingConfig
from forge_core.rollout.protocol import EngineConnection, EngineLost, PolicyVersionMismatch
from forge_core.rollout.types import Prompt, Sample

log = logging.getLogger(__name__)
T = TypeVar("T")


def shard_bounds(num_items: int, num_shards: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) ranges, sizes differing by at most one."""
    base, extra = divmod(num_items, num_shards)
    bounds, start = [], 0
    for index in range(num_shards):
        end = start + base + (1 if index < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


class EngineRouter:
    """The live engines of a stage or a flow behind the generation protocol (module docstring)."""

    def __init__(self, engines: Sequence[EngineConnection]):
        assert engines, "a router needs at least one engine"
        self.live: list[EngineConnection] = list(engines)
        self.dead: list[str] = []  # names of the engines dropped since this router was made
        self._why_lost: dict[str, str] = {}  # name of a dropped engine -> the first line of its error
        self._first_lost_at: float | None = None  # wall-clock time of the first drop
        self._rerouted_prompts = 0

    @property
    def names(self) -> list[str]:
        return [engine.name for engine in self.live]

    @property
    def policy_version(self) -> str:
        """The version every live engine serves; PolicyVersionMismatch when they disagree."""
        versions = {engine.name: engine.policy_version for engine in self.live}
        if len(set(versions.values())) > 1:
            raise PolicyVersionMismatch(
                f"the engines serve different policy versions: "
                f"{ {name: v[:16] for name, v in versions.items()} }; load one version into all of them "
                "(reload, or EngineActors.serve)"
            )
        return next(iter(versions.values()), "")

    @property
    def startup_s(self) -> float:
        """The engines started concurrently: the slowest one's start-up."""
        return max((engine.startup_s for engine in self.live), default=0.0)

    @property
    def reload_s(self) -> float:
        return max((engine.reload_s for engine in self.live), default=0.0)

    # ---- generation ---------------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Prompt], sampling: SamplingConfig, seed: int) -> list[Sample]:
        """`group_size` samples per prompt in prompt order, as one engine would return them."""
        by_prompt: list[list[Sample]] = [[] for _ in prompts]
        pending = list(range(len(prompts)))
        while pending:
            self._check_some_left(f"with {len(pending)} of {len(prompts)} prompts unfinished")
            pending = self._generate_round(prompts, pending, by_prompt, sampling, seed)
        return [sample for samples in by_prompt for sample in samples]

    def _generate_round(
        self,
        prompts: Sequence[Prompt],
        pending: list[int],
        by_prompt: list[list[Sample]],
        sampling: SamplingConfig,
        seed: int,
    ) -> list[int]:
        """Split the `pending` prompt indices across the live engines; returns those still unfinished."""
        shares = [
            (engine, pending[start:end])
            for engine, (start, end) in zip(self.live, shard_bounds(len(pending), len(self.live)))
            if end > start
        ]
        results = self._on_each(
            [
                (
                    engine,
                    functools.partial(engine.generate, [prompts[i] for i in share], sampling, seed),
                    f"re-routing its {len(share)} unfinished prompts to",
                )
                for engine, share in shares
            ]
        )
        unfinished: list[int] = []
        for (engine, share), samples in zip(shares, results):
            if samples is None:
                unfinished += share
            else:
                _place(samples, share, by_prompt, sampling.group_size, engine.name)
        if self.live:
            self._rerouted_prompts += len(unfinished)
        return sorted(unfinished)

    def failover_metrics(self) -> dict[str, float]:
        """Engines dropped since this router was made, prompts re-routed from them, and when the first was dropped
        (wall-clock seconds; 0 when none was)."""
        return {
            "engines/lost": float(len(self.dead)),
            "engines/rerouted_prompts": float(self._rerouted_prompts),
            "engines/first_lost_at": float(self._first_lost_at or 0.0),
        }

    # ---- weights and lifetime -----------------------------------------------------------------------

    def reload(self, policy_dir: str | os.PathLike, policy_version: str) -> float:
        """Every live engine serves `policy_version` from `policy_dir` (concurrently); returns the slowest
        reload's seconds. A lost engine is dropped; none left is EngineLost."""
        self._check_some_left("to reload")
        reload = [
            (engine, functools.partial(engine.reload, policy_dir, policy_version), "serving on with")
            for engine in self.live
        ]
        seconds = self._on_each(reload)
        self._check_some_left("after the reload")
        return max(s for s in seconds if s is not None)

    def close(self) -> None:
        """Close every connection (the engine actors keep running: their owner ends them)."""
        engines, self.live = self.live, []
        for engine in engines:
            engine.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # ---- the engines --------------------------------------------------------------------------------

    def _on_each(self, jobs: list[tuple[EngineConnection, Callable[[], T], str]]) -> list[T | None]:
        """Every job's call concurrently: each result, None where the engine was lost (it is dropped and the
        warning says `what` happens to its work). Another error is raised once every call has ended."""
        with ThreadPoolExecutor(len(jobs), thread_name_prefix="forge-engine-route") as pool:
            futures: list[Future] = [pool.submit(call) for _, call, _ in jobs]
        results: list[T | None] = []
        failure: BaseException | None = None
        for (engine, _, what), future in zip(jobs, futures):
            error = future.exception()
            results.append(None if error is not None else future.result())
            if isinstance(error, EngineLost):
                self._drop(engine, error, what)
            elif error is not None:
                failure = failure or error
        if failure is not None:
            raise failure
        return results

    def _drop(self, engine: EngineConnection, error: EngineLost, what: str) -> None:
        self.live.remove(engine)
        self.dead.append(engine.name)
        self._first_lost_at = self._first_lost_at or time.time()
        engine.close()
        first_line = str(error).splitlines()[0] if str(error) else repr(error)
        self._why_lost[engine.name] = first_line
        log.warning(
            "engine %s (pid %d) is lost: %s; %s %s",
            engine.name,
            engine.pid,
            first_line,
            what,
            ", ".join(self.names) or "no engine (none left)",
        )

    def _check_some_left(self, doing: str) -> None:
        if not self.live:
            causes = "; ".join(f"{name}: {self._why_lost.get(name, '?')}" for name in self.dead)
            raise EngineLost(
                f"no engine is left (lost: {causes}) {doing}; a retry of the stage starts new ones "
                "(EngineActors.serve restarts a flow's)"
            )


def _place(
    samples: list[Sample], share: list[int], by_prompt: list[list[Sample]], group_size: int, name: str
) -> None:
    assert len(samples) == len(share) * group_size, (
        f"engine {name} returned {len(samples)} samples for {len(share)} prompts x {group_size}"
    )
    for position, index in enumerate(share):
        by_prompt[index] = samples[position * group_size : (position + 1) * group_size]
