"""Unruly tools imported by path in the worker pool (`tests.envs.tools_for_tests:<name>`), like a team's own."""

from __future__ import annotations

import time


def raises(expression: str) -> str:
    raise RuntimeError(f"tool failed on {expression!r}")


def hangs(expression: str) -> str:
    if expression == "hang":
        time.sleep(3600)
    return f"ok {expression}"


def echo(expression: str) -> str:
    return expression
