"""`tool_use`: the built-in tool-calling environment. Each model turn either calls a tool, whose result is
appended as an observation, or answers, which ends the episode for the run's reward functions to score.

    rollout.env: {name: tool_use, tools: [calculator], tool_parser: tag, max_turns: 3}

`rollout.env.kwargs` may set `result_template` (`{result}`) and `error_template` (`{kind}`: raised, timeout,
crashed, too_large, malformed); the full error message goes into the turn record, not the context.
"""

from __future__ import annotations

from collections.abc import Sequence

from forge_core.envs.base import End, Environment, EpisodeState, Observation, Step, ToolRequest, check_kwargs
from forge_core.envs.parsers import ToolCall, parser_named
from forge_core.envs.tools import Tool, ToolRunner, tools_named
from forge_core.rewards.isolation import DEFAULT_MAX_RESULT_BYTES, CallOutcome
from forge_core.rollout.types import Prompt

RESULT_TEMPLATE = "<result>{result}</result>"
ERROR_TEMPLATE = "<result>error: {kind}</result>"
MALFORMED = "malformed"


class ToolUseEnvironment(Environment):
    name = "tool_use"

    def __init__(
        self,
        tools: dict[str, Tool],
        parser: str = "tag",
        timeout_s: float = 5.0,
        max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES,
        env_allow: Sequence[str] = (),
        result_template: str = RESULT_TEMPLATE,
        error_template: str = ERROR_TEMPLATE,
    ) -> None:
        if not tools:
            raise ValueError("rollout.env.tools=[]: the tool_use environment needs at least one tool")
        for key, template, fields in (
            ("result_template", result_template, {"result": "1"}),
            ("error_template", error_template, {"kind": MALFORMED}),
        ):
            try:
                template.format(**fields)
            except (KeyError, IndexError, ValueError) as exc:
                raise ValueError(
                    f"rollout.env.kwargs.{key}={template!r}: {exc}; it may only use {{{next(iter(fields))}}}"
                ) from exc
        self.tools = tools
        self.parser = parser_named(parser)
        self.runner = ToolRunner(tools, timeout_s, max_result_bytes, env_allow)
        self.result_template = result_template
        self.error_template = error_template

    @classmethod
    def from_config(cls, env, env_allow: Sequence[str] = ()) -> ToolUseEnvironment:
        """The `rollout.env` section's environment; `env_allow`: rollout.worker_env_allow."""
        check_kwargs(env.kwargs, ("result_template", "error_template"), "the tool_use environment")
        return cls(
            tools_named(env.tools), env.tool_parser, env.tool_timeout_s, env.max_tool_result_bytes, env_allow,
            **env.kwargs,
        )  # fmt: skip

    def describe(self) -> dict:
        return {
            "name": self.name,
            "tools": {name: tool.function for name, tool in self.tools.items()},
            "parser": self.parser.name,
            "result_template": self.result_template,
            "error_template": self.error_template,
        }

    def start(self, prompt: Prompt, sample_index: int) -> EpisodeState:
        return _ToolEpisode(self)

    def run_tools(self, calls: list[ToolCall]) -> list[CallOutcome]:
        return self.runner.run(calls)

    def observation(self, call: ToolCall, outcome: CallOutcome) -> Observation:
        if outcome.ok:
            return Observation(self.result_template.format(result=outcome.value), call.name, outcome.latency_s)
        return Observation(
            self.error_template.format(kind=outcome.kind),
            call.name,
            outcome.latency_s,
            error=outcome.error,
            error_kind=outcome.kind,
        )


class _ToolEpisode(EpisodeState):
    def __init__(self, env: ToolUseEnvironment) -> None:
        self.env = env

    def step(self, model_text: str) -> Step:
        parsed = self.env.parser.parse(model_text, self.env.tools.keys())
        if parsed.call is not None:
            return ToolRequest(parsed.call)
        if parsed.malformed:
            return Observation(
                self.env.error_template.format(kind=MALFORMED), error=parsed.malformed, error_kind=MALFORMED
            )
        return End()

    def tool_result(self, call: ToolCall, outcome: CallOutcome) -> Observation | End:
        return self.env.observation(call, outcome)
