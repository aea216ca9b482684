"""The environment protocol: an episode starts from a dataset row and answers each model turn.

    env = environment_from_config(cfg.rollout.env)             # forge_core.envs.build
    state = env.start(prompt, sample_index)                    # one episode from one rl_prompts/eval row
    step = state.step(model_text)                              # after every model turn:
        Observation(text, ...)   # append this to the context (a game state, an error), the model goes on
        ToolRequest(call)        # run this tool call (batched with the other episodes' calls), then
        state.tool_result(call, outcome) -> Observation | End
        End(reward)              # the episode is over; `reward` is the environment's own, or None
    state.close()

The driver (forge_core.envs.episodes) owns batching, limits, tokenization, tool timeouts and the token mask:
an environment sees only text, so it runs on any tokenizer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from forge_core.envs.parsers import ToolCall
from forge_core.rewards.isolation import CallOutcome
from forge_core.rollout.types import Prompt


@dataclass(frozen=True)
class Observation:
    """Text appended after a model turn; `tool`/`latency_s`/`error` describe the tool call it answers, if any."""

    text: str
    tool: str = ""
    latency_s: float = 0.0
    error: str = ""
    error_kind: str = ""  # "", "raised", "timeout", "crashed", "malformed"


@dataclass(frozen=True)
class ToolRequest:
    call: ToolCall


@dataclass(frozen=True)
class End:
    """The episode is over; `reward` is the environment's own (read by the `environment` reward), or None."""

    reward: float | None = None
    error: str = ""  # why the environment ended it abnormally (e.g. its step raised), "" otherwise


Step = Observation | ToolRequest | End


class EpisodeState(ABC):
    """One running episode (see module docstring)."""

    @abstractmethod
    def step(self, model_text: str) -> Step:
        """The environment's answer to the model's latest turn."""

    def tool_result(self, call: ToolCall, outcome: CallOutcome) -> Observation | End:
        # Only environments with tools return a ToolRequest; one that does without this is a programming error.
        raise TypeError(
            f"{type(self).__name__}.step returned a ToolRequest, but the state has no tool_result to take the "
            "outcome: implement tool_result, or never return ToolRequest"
        )

    def close(self) -> None:
        """Release what the episode holds (idempotent)."""


def check_kwargs(kwargs: dict, accepted: tuple[str, ...], environment: str) -> None:
    """ValueError naming `rollout.env.kwargs` keys an environment does not take."""
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise ValueError(f"rollout.env.kwargs: {unknown} unknown to {environment}; it takes {', '.join(accepted)}")


class Environment(ABC):
    """Starts episodes; `name` and `describe()` go into every rollout row's lineage."""

    name: str = "environment"

    @abstractmethod
    def start(self, prompt: Prompt, sample_index: int) -> EpisodeState:
        """A new episode on this row; `sample_index` tells the group's episodes apart."""

    def describe(self) -> dict:
        return {"name": self.name}

    def run_tools(self, calls: list[ToolCall]) -> list[CallOutcome]:
        """One outcome per call, in order: a turn's tool calls of every episode, in one batch."""
        raise TypeError(
            f"{type(self).__name__} was asked to run tool calls but has no tools: implement run_tools, or never "
            "return ToolRequest from its episodes"
        )
