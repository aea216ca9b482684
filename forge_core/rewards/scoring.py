"""A run's reward: a weighted sum of components, each kept in its own column.

    rewards = RewardSet.from_config(cfg.rollout.rewards)
    scored = rewards.score(completions, ground_truths, sample_refs)
    scored.columns["reward_exact_answer"], scored.total        # one value per sample
    rewards.versions()                                          # {"exact_answer": "1", ...}

A component function that raises, or returns anything but a finite number, stops scoring with a
`RewardFunctionError` naming the function, the config entry and the sample: a silent zero would look like a
policy that got worse.
"""

from __future__ import annotations

import inspect
import math
import numbers
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from forge_core.config.schema import RewardComponentConfig
from forge_core.rewards.registry import RewardSpec, resolve_reward

COLUMN_PREFIX = "reward_"
TOTAL_COLUMN = "reward"
_SNIPPET_CHARS = 120


class RewardFunctionError(ValueError):
    """A reward function failed on a sample (raised, or returned a non-number)."""


def column_key(name: str) -> str:
    """The column suffix of a reward name: the function name of an import path, in [A-Za-z0-9_]."""
    base = name.rsplit(":", 1)[-1]
    return re.sub(r"\W", "_", base)


@dataclass(frozen=True)
class RewardComponent:
    """One weighted reward term, e.g. `0.5 * per_digit(completion, truth)`."""

    spec: RewardSpec
    weight: float
    kwargs: dict[str, Any] = field(default_factory=dict)
    config_key: str = "rollout.rewards[0]"

    @property
    def column(self) -> str:
        return COLUMN_PREFIX + column_key(self.spec.name)

    def check_kwargs(self) -> None:
        """ValueError now, rather than on the first sample, when `kwargs` do not fit the function."""
        try:
            signature = inspect.signature(self.spec.fn)
        except (TypeError, ValueError):
            return  # builtins without a signature: the first call will tell
        try:
            signature.bind("", "", **self.kwargs)
        except TypeError as exc:
            raise ValueError(
                f"{self.config_key}.kwargs={self.kwargs}: do not fit reward {self.spec.name!r}{signature} "
                f"({exc}); "
                "fix the kwargs or the function's signature fn(completion, ground_truth, **kwargs)"
            ) from exc

    def score(self, completion: str, ground_truth: str, sample_ref: str) -> float:
        try:
            value = self.spec.fn(completion, ground_truth, **self.kwargs)
        except Exception as exc:
            raise RewardFunctionError(
                f"reward {self.spec.name!r} ({self.config_key}) raised {type(exc).__name__}: {exc} on sample "
                f"{sample_ref} (completion {completion[:_SNIPPET_CHARS]!r}, ground truth "
                f"{ground_truth[:_SNIPPET_CHARS]!r}); fix the function or the data"
            ) from exc
        if not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
            raise RewardFunctionError(
                f"reward {self.spec.name!r} ({self.config_key}) returned {value!r} ({type(value).__name__}) "
                "on "
                f"sample {sample_ref} (completion {completion[:_SNIPPET_CHARS]!r}); a reward function must "
                "return a finite float"
            )
        return float(value)


@dataclass(frozen=True)
class ScoredRewards:
    """Per-sample scores: `columns[reward_<name>]` for every component and the weighted `total`."""

    columns: dict[str, list[float]]
    total: list[float]


class RewardSet:
    """The components of a run's reward, in config order."""

    def __init__(self, components: Sequence[RewardComponent]) -> None:
        if not components:
            raise ValueError("rollout.rewards=[]: name at least one reward component, e.g. exact_answer")
        seen: dict[str, str] = {}
        for component in components:
            if component.column in seen:
                raise ValueError(
                    f"{component.config_key}.name={component.spec.name!r}: its column {component.column!r} "
                    "is "
                    f"already used by {seen[component.column]}; each reward function may appear once"
                )
            seen[component.column] = component.config_key
            component.check_kwargs()
        self.components = tuple(components)

    @classmethod
    def from_config(
        cls, configs: Sequence[RewardComponentConfig], section: str = "rollout.rewards"
    ) -> RewardSet:
        components = []
        for index, cfg in enumerate(configs):
            key = f"{section}[{index}]"
            try:
                spec = resolve_reward(cfg.name)
            except ValueError as exc:
                raise ValueError(f"{key}.name: {exc}") from exc
            components.append(
                RewardComponent(spec=spec, weight=float(cfg.weight), kwargs=dict(cfg.kwargs), config_key=key)
            )
        return cls(components)

    @property
    def columns(self) -> list[str]:
        return [c.column for c in self.components]

    @property
    def primary_column(self) -> str:
        """The first component: the one pass rate and accuracy are measured on."""
        return self.components[0].column

    def versions(self) -> dict[str, str]:
        """{reward name: version} of every component, stored with the rollouts."""
        return {c.spec.name: c.spec.version for c in self.components}

    def weights(self) -> dict[str, float]:
        return {c.spec.name: c.weight for c in self.components}

    def score(
        self, completions: Sequence[str], ground_truths: Sequence[str], sample_refs: Sequence[str]
    ) -> ScoredRewards:
        if not len(completions) == len(ground_truths) == len(sample_refs):
            raise ValueError(
                f"score: {len(completions)} completions, {len(ground_truths)} ground truths and "
                f"{len(sample_refs)} sample refs; pass one of each per sample"
            )
        columns: dict[str, list[float]] = {}
        for component in self.components:
            columns[component.column] = [
                component.score(text, truth, ref)
                for text, truth, ref in zip(completions, ground_truths, sample_refs)
            ]
        total = [0.0] * len(completions)
        for component in self.components:
            values = columns[component.column]
            total = [acc + component.weight * value for acc, value in zip(total, values)]
        return ScoredRewards(columns=columns, total=total)
