"""The skyrl-gym adapter on a real skyrl-gym environment (gsm8k_multi_turn: the model answers, the environment
asks again until the answer is right or its turns run out), through the environment protocol and the
`environment` reward."""

from __future__ import annotations

import pytest

from forge_core.config.schema import EnvironmentConfig, RewardComponentConfig, SamplingConfig
from forge_core.envs import EpisodeLimits, environment_from_config, run_episodes
from forge_core.rewards import RewardFunctionError, RewardSet, sample_context
from tests.envs.scripted import ScriptedEngine, encode, prompt

pytest.importorskip("skyrl_gym")


def test_a_skyrl_gym_environment_runs_multi_turn_episodes_with_its_reward():
    env = environment_from_config(
        EnvironmentConfig(name="skyrl_gym:gsm8k_multi_turn", max_turns=3, kwargs={"observation_template": "|{content}|"})
    )
    assert env.describe()["package"].startswith("skyrl-gym==")
    # Sample 0 is wrong first and right on its second turn; sample 1 is right at once.
    engine = ScriptedEngine(lambda context, turn, sample: "#### 41" if (sample, turn) == (0, 0) else "#### 42")
    batch = run_episodes(
        engine, [prompt("q", "Q: 6*7?", ground_truth="42")], env, SamplingConfig(group_size=2, max_new_tokens=200),
        0, encode, EpisodeLimits(3, 1000),
    )
    slow, fast = batch.episodes
    assert (slow.num_turns, fast.num_turns) == (2, 1)
    assert slow.turns[1].role == "env" and "Please provide your step-by-step reasoning" in slow.turns[1].text
    assert slow.turns[1].text.startswith("|") and slow.end_reason == fast.end_reason == "env"
    # gsm8k_multi_turn: per turn 1.0 when right, 0.2 / max_turns for a well-formed wrong answer; summed.
    assert slow.env_reward == pytest.approx(1.0 + 0.2 / 3) and fast.env_reward == 1.0
    rewards = RewardSet.from_config([RewardComponentConfig(name="environment")])
    scored = rewards.score(
        [e.response_text for e in batch.episodes], [e.ground_truth for e in batch.episodes], ["a", "b"],
        contexts=[sample_context(e, 200) for e in batch.episodes],
    )
    assert scored.columns["reward_environment"] == [slow.env_reward, 1.0]
    # A single-turn sample has no environment reward: the component says so instead of scoring 0.
    single = [{"response_len": 1, "finish_reason": "stop", "max_new_tokens": 1}]
    with pytest.raises(RewardFunctionError, match="env_reward"):
        rewards.score(["x"], ["42"], ["c"], contexts=single)
