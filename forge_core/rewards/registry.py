"""The table of built-in reward functions: their names, versions, and the optional ones backed by a package.

    @register_reward("exact_answer", version="1")      # how forge_core.rewards.builtin adds the built-ins
    def exact_answer(completion: str, ground_truth: str, tag: str = "answer") -> float: ...

Name lookup is forge_core.rewards.resolve, which imports the built-ins first; this module imports no other
reward module, so builtin can import it without a cycle.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol


class RewardFn(Protocol):
    def __call__(self, completion: str, ground_truth: str, **kwargs) -> float: ...


@dataclass(frozen=True)
class RewardSpec:
    """A resolved reward function: the name it was asked for, the callable and its version."""

    name: str
    fn: RewardFn
    version: str


@dataclass(frozen=True)
class OptionalReward:
    """A built-in reward backed by a package that forgeflow does not require."""

    module: str  # importable module name
    distribution: str  # what to pip install
    factory: Callable[[], RewardFn]  # builds the function once the module imports


class RewardFunctionError(ValueError):
    """A reward function failed on a sample (raised, or returned a non-number)."""


_BUILTINS: dict[str, RewardSpec] = {}
_OPTIONAL: dict[str, OptionalReward] = {}


def register_reward(name: str, version: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator adding a built-in reward under `name`; bump `version` whenever its scores change."""

    def decorate(fn: RewardFn) -> RewardFn:
        if name in _BUILTINS or name in _OPTIONAL:
            raise ValueError(f"reward {name!r} is registered twice; pick another name")
        _BUILTINS[name] = RewardSpec(name=name, fn=fn, version=version)
        return fn

    return decorate


def register_optional_reward(
    name: str, module: str, distribution: str, factory: Callable[[], RewardFn]
) -> None:
    """Add a built-in reward that needs `module`; resolving it without that module is a ValueError."""
    if name in _BUILTINS or name in _OPTIONAL:
        raise ValueError(f"reward {name!r} is registered twice; pick another name")
    _OPTIONAL[name] = OptionalReward(module=module, distribution=distribution, factory=factory)


def registered(name: str) -> RewardSpec | OptionalReward | None:
    """The built-in (or optional) reward registered under `name`, None for any other name."""
    return _BUILTINS.get(name) or _OPTIONAL.get(name)


def registered_names() -> list[str]:
    """Every name registered so far, optional rewards included (whether or not their package is installed)."""
    return sorted([*_BUILTINS, *_OPTIONAL])
