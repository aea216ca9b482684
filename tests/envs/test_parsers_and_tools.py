"""The named tool-call parsers and the built-in calculator."""

from __future__ import annotations

import pytest

from forge_core.config.schema import EnvironmentConfig
from forge_core.envs import ToolCall, environment_from_config, parser_named
from forge_core.envs.tools import calculator, tools_named

TOOLS = {"calculator", "search"}


def test_tag_parser():
    tag = parser_named("tag")
    assert tag.parse("<calculator>12*34</calculator>", TOOLS).call == ToolCall("calculator", ("12*34",))
    assert tag.parse("x <search>cats</search> y", TOOLS).call == ToolCall("search", ("cats",))
    answer = tag.parse("<answer>408</answer>", TOOLS)
    assert answer.call is None and not answer.wants_tool
    assert "never closed" in tag.parse("<calculator>12*34", TOOLS).malformed
    assert "more than one" in tag.parse("<search>a</search><calculator>1</calculator>", TOOLS).malformed


def test_hermes_parser():
    hermes = parser_named("hermes")
    text = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>'
    assert hermes.parse(text, TOOLS).call == ToolCall("calculator", kwargs={"expression": "2+2"})
    assert hermes.parse("no call here", TOOLS).call is None
    assert "not JSON" in hermes.parse("<tool_call>{oops}</tool_call>", TOOLS).malformed
    assert "never closed" in hermes.parse('<tool_call>{"name": "search"}', TOOLS).malformed
    assert "unknown tool" in hermes.parse('<tool_call>{"name": "rm", "arguments": {}}</tool_call>', TOOLS).malformed
    assert "more than one" in hermes.parse(text + text, TOOLS).malformed
    with pytest.raises(ValueError, match="tool_parser='xml'"):
        parser_named("xml")


def test_calculator():
    assert calculator("12*34") == "408"
    assert calculator("07*45") == "315"  # zero-padded operands, as the demo's prompts write them
    assert calculator("(1+2)*-3") == "-9" and calculator("7/2") == "3.5" and calculator("8/2") == "4"
    for bad in ("__import__('os')", "2**10", "", "x+1"):
        with pytest.raises(ValueError):
            calculator(bad)


def test_environment_config_errors_name_the_field():
    with pytest.raises(ValueError, match="rollout.env.tools: 'abacus' is unknown"):
        tools_named(["abacus"])
    with pytest.raises(ValueError, match="rollout.env.name='chess'"):
        environment_from_config(EnvironmentConfig(name="chess"))
    with pytest.raises(ValueError, match="skyrl-gym has no environment 'nope'"):
        environment_from_config(EnvironmentConfig(name="skyrl_gym:nope"))
    with pytest.raises(ValueError, match="rollout.env.kwargs.result_template"):
        environment_from_config(EnvironmentConfig(name="tool_use", kwargs={"result_template": "{value}"}))
    assert environment_from_config(EnvironmentConfig()) is None
