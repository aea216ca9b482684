"""Tool calls read from a model turn's text, by named parsers (`rollout.env.tool_parser`).

    parser = parser_named("tag")
    parser.parse("<calculator>12*34</calculator>", tool_names={"calculator"})
    # ParsedTurn(call=ToolCall(name="calculator", args=("12*34",), kwargs={}), malformed="")

- `tag`: `<NAME>ARGUMENT</NAME>`; the text between the tags is the tool's one positional argument.
- `hermes`: `<tool_call>{"name": NAME, "arguments": {...}}</tool_call>` (Hermes and Qwen chat templates); the
  arguments become keyword arguments.

A turn holds one call, no call, or a malformed call (`malformed` says why: an unclosed tag, bad JSON, an unknown
tool, more than one call; a second call is malformed rather than silently dropped).
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ToolCall:
    name: str
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ParsedTurn:
    """A model turn as a parser read it: `call` (or None) and, for a malformed call, `malformed` (why)."""

    call: ToolCall | None = None
    malformed: str = ""

    @property
    def wants_tool(self) -> bool:
        return self.call is not None or bool(self.malformed)


class TagParser:
    """`<NAME>ARGUMENT</NAME>` (module docstring)."""

    name = "tag"

    def parse(self, text: str, tool_names: Collection[str]) -> ParsedTurn:
        opened = [(text.find(f"<{name}>"), name) for name in tool_names if f"<{name}>" in text]
        if not opened:
            return ParsedTurn()
        start, name = min(opened)
        body_start = start + len(name) + 2
        close = text.find(f"</{name}>", body_start)
        if close < 0:
            return ParsedTurn(malformed=f"<{name}> is never closed by </{name}>")
        rest = text[close + len(name) + 3 :]
        if any(f"<{other}>" in rest for other in tool_names):
            return ParsedTurn(malformed="more than one tool call in one turn")
        return ParsedTurn(call=ToolCall(name=name, args=(text[body_start:close],)))


class HermesParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (module docstring)."""

    name = "hermes"
    _CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)

    def parse(self, text: str, tool_names: Collection[str]) -> ParsedTurn:
        matches = list(self._CALL.finditer(text))
        if not matches:
            return ParsedTurn()
        if len(matches) > 1:
            return ParsedTurn(malformed="more than one tool call in one turn")
        body, closing = matches[0].group(1), matches[0].group(2)
        if not closing:
            return ParsedTurn(malformed="<tool_call> is never closed by </tool_call>")
        try:
            request = json.loads(body)
        except ValueError as exc:
            return ParsedTurn(malformed=f"the tool call is not JSON ({exc})")
        if not isinstance(request, dict) or not isinstance(request.get("name"), str):
            return ParsedTurn(malformed='the tool call needs {"name": ..., "arguments": {...}}')
        arguments = request.get("arguments", {})
        if not isinstance(arguments, dict):
            return ParsedTurn(malformed="the tool call's arguments must be a JSON object")
        if request["name"] not in tool_names:
            return ParsedTurn(malformed=f"unknown tool {request['name']!r}; the tools are {sorted(tool_names)}")
        return ParsedTurn(call=ToolCall(name=request["name"], kwargs=arguments))


PARSERS = {parser.name: parser for parser in (TagParser(), HermesParser())}


def parser_named(name: str) -> TagParser | HermesParser:
    if name not in PARSERS:
        raise ValueError(f"rollout.env.tool_parser={name!r}: unknown; choose one of {sorted(PARSERS)}")
    return PARSERS[name]
