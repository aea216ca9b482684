"""Several engine services behind one client: prompts split across the live engines, a dead engine's
prompts re-routed to the others (load redirect).

    router = EngineService.ensure_engines(state_dir, cfg.rollout, policy_dir, version)   # num_engines services
    samples = router.serving(version, cfg.rollout.sampling).generate(prompts, seed=7)
    router.close()                                   # disconnects; the services keep running

Every prompt's samples are drawn with its own seed (sampling.request_seed), so they are the same whichever
engine serves it: re-routing changes no sample. An engine that dies mid-request (the connection ends, or its
pid is gone) is dropped with a warning naming it, and its unfinished prompts go to the live ones; only when
no engine is left does `generate` raise EngineServiceError (retryable: the stage's retry calls
`ensure_engines`, which restarts the dead ones).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Self

from forge_core.config.schema import SamplingConfig
from forge_core.rollout.pool import shard_bounds
from forge_core.rollout.service.client import EngineClient, ServedGenerator
from forge_core.rollout.service.state import EngineServiceError, PolicyVersionMismatch
from forge_core.rollout.types import Prompt, Sample

log = logging.getLogger(__name__)


class EngineRouter:
    """The live engines of a flow, with EngineClient's generate/serving/close (module docstring)."""

    def __init__(self, clients: Sequence[EngineClient]):
        assert clients, "a router needs at least one engine"
        self.live: list[EngineClient] = list(clients)
        self.dead: list[str] = []  # names of the engines dropped since this router was made
        self.startup_s = max(c.startup_s for c in clients)  # they start concurrently
        self.reload_s = max(c.reload_s for c in clients)

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.live]

    @property
    def policy_version(self) -> str:
        """The version every live engine reports; PolicyVersionMismatch when they disagree."""
        versions = {c.name: c.policy_version for c in self.live}
        if len(set(versions.values())) != 1:
            raise PolicyVersionMismatch(
                f"the flow's engines serve different policy versions: "
                f"{ {name: v[:16] for name, v in versions.items()} }; load one version into all of them "
                "(EngineService.ensure_engines)"
            )
        return next(iter(versions.values()))

    def generate(
        self, prompts: Sequence[Prompt], seed: int, sampling: SamplingConfig, expected_version: str
    ) -> list[Sample]:
        """`group_size` samples per prompt in prompt order, as one engine would return them.

        Every engine checks `expected_version` itself (PolicyVersionMismatch); a ValueError (a bad prompt)
        is raised as is; an engine that fails or dies is dropped and its prompts go to the others.
        """
        by_prompt: list[list[Sample]] = [[] for _ in prompts]
        pending = list(range(len(prompts)))
        while pending:
            if not self.live:
                raise EngineServiceError(
                    f"no engine of the flow is left (dead: {', '.join(self.dead)}) with {len(pending)} of "
                    f"{len(prompts)} prompts unfinished; a retry restarts them (EngineService.ensure_engines)"
                )
            pending = self._generate_round(prompts, pending, by_prompt, seed, sampling, expected_version)
        return [sample for samples in by_prompt for sample in samples]

    def _generate_round(
        self,
        prompts: Sequence[Prompt],
        pending: list[int],
        by_prompt: list[list[Sample]],
        seed: int,
        sampling: SamplingConfig,
        expected_version: str,
    ) -> list[int]:
        """Split the `pending` prompt indices across the live engines; returns those still unfinished."""
        shares = [
            (client, pending[start:end])
            for client, (start, end) in zip(self.live, shard_bounds(len(pending), len(self.live)))
            if end > start
        ]
        with ThreadPoolExecutor(len(shares), thread_name_prefix="forge-engine-route") as pool:
            futures = [
                pool.submit(client.generate, [prompts[i] for i in share], seed, sampling, expected_version)
                for client, share in shares
            ]
        unfinished: list[int] = []
        failure: BaseException | None = None
        for (client, share), future in zip(shares, futures):
            error = future.exception()
            if isinstance(error, EngineServiceError):
                self._drop(client, error, len(share))
                unfinished += share
            elif error is not None:
                failure = failure or error
            else:
                self._place(future.result(), share, by_prompt, sampling.group_size, client.name)
        if failure is not None:
            raise failure
        return sorted(unfinished)

    @staticmethod
    def _place(
        samples: list[Sample], share: list[int], by_prompt: list[list[Sample]], group_size: int, name: str
    ) -> None:
        assert len(samples) == len(share) * group_size, (
            f"engine {name} returned {len(samples)} samples for {len(share)} prompts x {group_size}"
        )
        for position, index in enumerate(share):
            by_prompt[index] = samples[position * group_size : (position + 1) * group_size]

    def _drop(self, client: EngineClient, error: EngineServiceError, prompts: int) -> None:
        self.live.remove(client)
        self.dead.append(client.name)
        client.close()
        first_line = str(error).splitlines()[0] if str(error) else repr(error)
        log.warning(
            "engine %s (pid %d) is dead: %s; re-routing its %d unfinished prompts to %s",
            client.name,
            client.pid,
            first_line,
            prompts,
            ", ".join(self.names) or "no engine (none left)",
        )

    def serving(self, policy_version: str, sampling: SamplingConfig | None = None) -> ServedGenerator:
        """These engines behind the Generator interface of stage code, pinned to `policy_version`."""
        return ServedGenerator(self, policy_version, sampling)

    def close(self) -> None:
        """Disconnect from every engine; the services keep running."""
        for client in self.live:
            client.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
