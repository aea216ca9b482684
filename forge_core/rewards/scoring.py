"""A run's reward: a weighted sum of components, each kept in its own column.

    rewards = RewardSet.from_config(cfg.rollout.rewards)
    scored = rewards.score(completions, ground_truths, sample_refs)
    scored.columns["reward_exact_answer"], scored.total        # one value per sample
    rewards.versions()                                          # {"exact_answer": "1", ...}

A component that raises, or returns anything but a finite number, stops scoring with a `RewardFunctionError`
naming the function, the config entry and the sample: a silent zero would look like a worse policy.

A function may take sample facts its text does not carry as keyword parameters named in SAMPLE_FIELDS
(`response_len` in tokens, `finish_reason`, `max_new_tokens`, `env_reward`); the caller passes them per sample:

    scored = rewards.score(texts, truths, refs, contexts=[sample_context(s, max_new_tokens) for s in samples])

With `isolation` set, `score` runs the functions in worker processes (forge_core.rewards.isolation); without
failures the values equal in-process scoring.
"""

from __future__ import annotations

import inspect
import math
import numbers
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from forge_core.config.schema import RewardComponentConfig, RolloutConfig
from forge_core.rewards.isolation import RewardIsolation, no_failures, process_pool
from forge_core.rewards.registry import RewardFunctionError, RewardSpec
from forge_core.rewards.resolve import resolve_reward

COLUMN_PREFIX = "reward_"
TOTAL_COLUMN = "reward"
_SNIPPET_CHARS = 120


# `env_reward` only exists for multi-turn episodes (forge_core.envs): the reward their environment gave.
SAMPLE_FIELDS = ("response_len", "finish_reason", "max_new_tokens", "env_reward")
_EXAMPLE_CONTEXT = {"response_len": 1, "finish_reason": "stop", "max_new_tokens": 1, "env_reward": 0.0}


def example_context(max_new_tokens: int) -> dict[str, Any]:
    """Placeholder sample facts of a short answer under the run's `max_new_tokens`, for scoring text without a
    generated sample (a dry run on reference answers)."""
    return {**_EXAMPLE_CONTEXT, "max_new_tokens": int(max_new_tokens)}


def sample_context(sample: Any, max_new_tokens: int) -> dict[str, Any]:
    """The SAMPLE_FIELDS of one sample or episode (anything with `response_len` and `finish_reason`)."""
    context = {
        "response_len": int(sample.response_len),
        "finish_reason": str(sample.finish_reason),
        "max_new_tokens": int(max_new_tokens),
    }
    if getattr(sample, "env_reward", None) is not None:
        context["env_reward"] = float(sample.env_reward)
    return context


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

    @property
    def sample_fields(self) -> tuple[str, ...]:
        """The SAMPLE_FIELDS the function takes and `kwargs` does not set."""
        try:
            parameters = inspect.signature(self.spec.fn).parameters
        except (TypeError, ValueError):
            return ()
        return tuple(name for name in SAMPLE_FIELDS if name in parameters and name not in self.kwargs)

    def check_kwargs(self) -> None:
        """ValueError now, rather than on the first sample, when `kwargs` do not fit the function."""
        try:
            signature = inspect.signature(self.spec.fn)
        except (TypeError, ValueError):
            return  # builtins without a signature: the first call will tell
        try:
            signature.bind("", "", **self.kwargs, **{k: _EXAMPLE_CONTEXT[k] for k in self.sample_fields})
        except TypeError as exc:
            raise ValueError(
                f"{self.config_key}.kwargs={self.kwargs}: do not fit reward {self.spec.name!r}{signature} "
                f"({exc}); "
                "fix the kwargs or the function's signature fn(completion, ground_truth, **kwargs)"
            ) from exc

    def score(
        self, completion: str, ground_truth: str, sample_ref: str, context: Mapping[str, Any] | None = None
    ) -> float:
        fields = self.sample_fields
        if fields and context is not None and any(name not in context for name in fields):
            missing = [name for name in fields if name not in context]
            raise RewardFunctionError(
                f"reward {self.spec.name!r} ({self.config_key}) needs {missing} of each sample, which sample "
                f"{sample_ref} does not have (env_reward: only multi-turn episodes, rollout.env); drop the "
                "component or configure rollout.env"
            )
        if fields and context is None:
            raise RewardFunctionError(
                f"reward {self.spec.name!r} ({self.config_key}) needs {list(fields)} of each sample, but the "
                f"caller passed no sample context for {sample_ref}; score with contexts=[sample_context(...)]"
            )
        try:
            value = self.spec.fn(completion, ground_truth, **self.kwargs, **{k: context[k] for k in fields})
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
    """Per-sample `columns[reward_<name>]` per component and the weighted `total`; `failures` counts what
    isolated scoring could not score ({} in-process)."""

    columns: dict[str, list[float]]
    total: list[float]
    failures: dict[str, int] = field(default_factory=dict)


class RewardSet:
    """The components of a run's reward, in config order. `configs`/`section`: what `from_config` built it
    from (a reward worker rebuilds it from them); `isolation`: score in worker processes when set."""

    configs: list[RewardComponentConfig] | None = None
    section: str = "rollout.rewards"
    isolation: RewardIsolation | None = None

    @classmethod
    def for_stage(cls, rollout: RolloutConfig) -> RewardSet:
        """`rollout.rewards`, isolated as `rollout` configures; `failures` adds up across `score` calls."""
        return cls.from_config(rollout.rewards, isolation=RewardIsolation.from_config(rollout))

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
        self.failures = no_failures()  # every score() call's, added up (isolated scoring only counts any)

    @classmethod
    def from_config(
        cls,
        configs: Sequence[RewardComponentConfig],
        section: str = "rollout.rewards",
        isolation: RewardIsolation | None = None,
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
        rewards = cls(components)
        rewards.configs, rewards.section, rewards.isolation = list(configs), section, isolation
        return rewards

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
        self,
        completions: Sequence[str],
        ground_truths: Sequence[str],
        sample_refs: Sequence[str],
        contexts: Sequence[Mapping[str, Any]] | None = None,
    ) -> ScoredRewards:
        """Every component on every sample; `contexts`: one `sample_context` per sample, needed when a
        component takes sample facts. Raises RewardFunctionError (module docstring)."""
        contexts = [None] * len(completions) if contexts is None else contexts
        if not len(completions) == len(ground_truths) == len(sample_refs) == len(contexts):
            raise ValueError(
                f"score: {len(completions)} completions, {len(ground_truths)} ground truths, "
                f"{len(sample_refs)} sample refs and {len(contexts)} contexts; pass one of each per sample"
            )
        items = list(zip(completions, ground_truths, sample_refs, contexts))
        if self.isolation is not None:
            per_sample, failures = process_pool().score(self, items, self.isolation)
            self.failures = {k: self.failures[k] + n for k, n in failures.items()}
        else:
            per_sample, failures = [self.score_sample(*item) for item in items], {}
        columns = {c.column: [values[k] for values in per_sample] for k, c in enumerate(self.components)}
        total = [0.0] * len(items)
        for component in self.components:
            values = columns[component.column]
            total = [acc + component.weight * value for acc, value in zip(total, values)]
        return ScoredRewards(columns=columns, total=total, failures=failures)

    def score_sample(
        self, completion: str, ground_truth: str, sample_ref: str, context: Mapping[str, Any] | None
    ) -> list[float]:
        """Every component's value on one sample, in component order (what a reward worker computes)."""
        return [c.score(completion, ground_truth, sample_ref, context) for c in self.components]
