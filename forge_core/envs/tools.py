"""Tools an environment lets the model call, run in isolated worker processes with a per-call timeout.

    runner = ToolRunner(tools_named(["calculator"]), timeout_s=5.0)
    outcomes = runner.run([ToolCall("calculator", ("12*34",))])     # one CallOutcome per call, in order
    outcomes[0].value                                              # "408"

A tool is a function named by import path, so a worker can import it: `calculator` is built in,
`package.module:function` names your own. Calls run in the reward worker pool (forge_core.rewards.isolation): a
tool that raises, hangs past `rollout.env.tool_timeout_s`, kills its worker or returns more than
`rollout.env.max_tool_result_bytes` gives an error outcome, never a failed stage.
"""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Sequence
from dataclasses import dataclass

from forge_core.envs.parsers import ToolCall
from forge_core.rewards.isolation import CALL_CRASHED, DEFAULT_MAX_RESULT_BYTES, CallOutcome, process_pool


@dataclass(frozen=True)
class Tool:
    name: str
    function: str  # "package.module:function", imported by the worker that runs it
    description: str = ""


BUILTIN_TOOLS = {
    "calculator": Tool(
        "calculator", "forge_core.envs.tools:calculator", "evaluates +, -, *, /, // and parentheses on integers"
    ),
}


def tools_named(names: Sequence[str]) -> dict[str, Tool]:
    """{name: Tool} for built-in names and `package.module:function` paths (named by the function)."""
    tools = {}
    for name in names:
        if name in BUILTIN_TOOLS:
            tool = BUILTIN_TOOLS[name]
        elif re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", name):
            tool = Tool(name.rsplit(":", 1)[1], name)
        else:
            raise ValueError(
                f"rollout.env.tools: {name!r} is unknown; use one of {sorted(BUILTIN_TOOLS)} or your own function "
                "as 'package.module:function'"
            )
        if tool.name in tools:
            raise ValueError(f"rollout.env.tools: two tools are named {tool.name!r}; each tool may appear once")
        tools[tool.name] = tool
    return tools


class ToolRunner:
    """Runs tool calls in the worker pool, `timeout_s` per call, one pool request per tool name; `env_allow`
    extends the workers' environment allow-list."""

    def __init__(
        self,
        tools: dict[str, Tool],
        timeout_s: float,
        max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES,
        env_allow: Sequence[str] = (),
    ) -> None:
        self.tools = tools
        self.timeout_s = timeout_s
        self.max_result_bytes = max_result_bytes
        self.env_allow = tuple(env_allow)

    def run(self, calls: Sequence[ToolCall]) -> list[CallOutcome]:
        outcomes: list[CallOutcome | None] = [None] * len(calls)
        for name in dict.fromkeys(call.name for call in calls):
            indices = [i for i, call in enumerate(calls) if call.name == name]
            tool = self.tools.get(name)
            if tool is None:
                for i in indices:
                    outcomes[i] = CallOutcome(error=f"unknown tool {name!r}", kind=CALL_CRASHED)
                continue
            arguments = [(tuple(calls[i].args), dict(calls[i].kwargs)) for i in indices]
            what = f"per {name} call (rollout.env.tool_timeout_s)"
            answers = process_pool().call_each(
                tool.function, arguments, self.timeout_s, what,
                max_result_bytes=self.max_result_bytes, env_allow=self.env_allow,
            )  # fmt: skip
            for i, outcome in zip(indices, answers, strict=True):
                outcomes[i] = outcome
        return outcomes  # type: ignore[return-value]


# ---- the built-in calculator ---------------------------------------------------------------------------------

_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_MAX_DIGITS = 60  # refuse results no model answer could hold (and pathological inputs)


def calculator(expression: str) -> str:
    """The value of an integer arithmetic expression (+ - * / // % and parentheses); exact when integral.
    Leading zeros are read as decimal (`07*45` is 315). ValueError for anything else."""
    text = re.sub(r"\b0+(\d)", r"\1", expression.strip())
    if not text or len(text) > 200:
        raise ValueError(f"expression {expression[:40]!r}: empty or longer than 200 characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"expression {expression[:40]!r} is not arithmetic") from exc
    value = _evaluate(tree.body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if len(str(value)) > _MAX_DIGITS:
        raise ValueError("result too large")
    return str(value)


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if max(len(str(abs(int(left)))), len(str(abs(int(right))))) > _MAX_DIGITS:
            raise ValueError("operand too large")
        return _OPERATORS[type(node.op)](left, right)
    raise ValueError(f"unsupported expression element {type(node).__name__}")
