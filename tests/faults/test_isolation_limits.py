"""What user code can reach: the reward and tool workers' environment (secrets of the flow process) and the size
of a tool's result. Cheap: no flow, no Prefect."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from forge_core.config.schema import RewardComponentConfig
from forge_core.envs.parsers import ToolCall
from forge_core.envs.tool_env import ToolUseEnvironment
from forge_core.envs.tools import tools_named
from forge_core.rewards import RewardSet
from forge_core.rewards.isolation import CALL_TOO_LARGE, RewardIsolation, RewardPool

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


# ---- reward and tool workers ------------------------------------------------------------------------------

SECRETS = {
    "AWS_SECRET_ACCESS_KEY": "aws-secret",
    "RAY_AUTH_TOKEN": "ray-token",
    "WANDB_API_KEY": "wandb-key",
    "HF_TOKEN": "hf-token",
}


@pytest.fixture
def pool():
    pool = RewardPool()
    yield pool
    pool.close()


@pytest.mark.fault(
    fault="a tool reads secrets of the flow process's environment (AWS_SECRET_ACCESS_KEY, RAY_AUTH_TOKEN, "
    "...)",
    where="forge_core.rewards.isolation (the workers that run tools and rewards)",
    checked="the worker's environment is allow-listed: every secret reads as None, PATH still passes, and a "
    "name the user allows (rollout.worker_env_allow) passes",
)
def test_a_tool_sees_no_secret_of_the_flow_process(monkeypatch, pool):
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    calls = [((name,), {}) for name in [*SECRETS, "PATH"]]

    seen = [outcome.value for outcome in pool.call_each("os:getenv", calls, timeout_s=60)]
    assert seen == [None] * len(SECRETS) + [os.environ["PATH"]]

    allowed = pool.call_each("os:getenv", calls[:1], timeout_s=60, env_allow=("AWS_SECRET_ACCESS_KEY",))
    assert allowed[0].value == "aws-secret"


@pytest.mark.fault(
    fault="a reward function reads RAY_AUTH_TOKEN from its worker's environment",
    where="forge_core.rewards.isolation (isolated reward scoring)",
    checked="the reward sees no such variable unless rollout.worker_env_allow names it",
)
def test_a_reward_sees_no_cluster_key(monkeypatch):
    monkeypatch.setenv("RAY_AUTH_TOKEN", "ray-token")
    reads_key = [
        RewardComponentConfig(name="tests.rollout.rewards_for_tests:has_env", weight=1.0, kwargs={"name": "RAY_AUTH_TOKEN"})
    ]

    def score(env_allow: tuple[str, ...]) -> float:
        isolation = RewardIsolation(timeout_s=60, workers=1, env_allow=env_allow)
        return RewardSet.from_config(reads_key, isolation=isolation).score(["a"], ["a"], ["s0"]).total[0]

    assert score(("RAY_AUTH_TOKEN",)) == 1.0  # allowed: the variable does reach a worker
    assert score(()) == 0.0


@pytest.mark.fault(
    fault="a tool returns a result far larger than an observation (1 MB against a 1 KiB cap)",
    where="forge_core.rewards.isolation / worker (rollout.env.max_tool_result_bytes)",
    checked="the call becomes an error outcome naming the cap, which the tool_use environment turns into an "
    "error observation counted in env/tool_errors; a result under the cap passes",
)
def test_a_tool_result_over_the_cap_is_an_error_observation(pool):
    huge, small = ((("x", 1_000_000), {}), (("x", 10), {}))
    outcomes = pool.call_each("operator:mul", [huge, small], timeout_s=60, max_result_bytes=1024)
    assert outcomes[0].kind == CALL_TOO_LARGE and "max_tool_result_bytes=1024" in outcomes[0].error
    assert outcomes[1].ok and outcomes[1].value == "x" * 10

    env = ToolUseEnvironment(tools_named(["operator:mul"]), max_result_bytes=1024)
    call = ToolCall("mul", ("x", 1_000_000))
    observation = env.observation(call, env.run_tools([call])[0])
    assert observation.error_kind == CALL_TOO_LARGE  # what env/tool_errors counts
    assert observation.text == "<result>error: too_large</result>"
