"""The environment protocol driven by a scripted model (tests/envs/scripted.py): deterministic turns, batched
generate calls, exact token masks, tools that raise, hang or are called wrongly, and the turn and token limits.
Tools run in real worker processes (the reward pool), with real timeouts."""

from __future__ import annotations

import pytest

from forge_core.config.schema import EnvironmentConfig, SamplingConfig
from forge_core.envs import EpisodeLimits, environment_from_config, episode_metrics, run_episodes
from forge_core.envs.base import End, Environment, EpisodeState, Observation
from tests.envs.scripted import EOS, ScriptedEngine, encode, prompt

SAMPLING = SamplingConfig(group_size=2, temperature=1.0, max_new_tokens=40)
LIMITS = EpisodeLimits(max_turns=3, max_total_tokens=200)
RESULT = "<result>{}</result>"


def tool_env(tools=("calculator",), parser="tag", timeout_s=5.0):
    return environment_from_config(
        EnvironmentConfig(name="tool_use", tools=list(tools), tool_parser=parser, tool_timeout_s=timeout_s)
    )


def calculator_script(context: str, turn: int, sample: int) -> str:
    """Sample 0 calls the calculator, then copies its result; sample 1 answers directly (wrongly)."""
    question = context.split("Q: ")[1].split("=")[0]
    if sample == 1:
        return "<answer>1</answer>"
    if turn == 0:
        return f"<calculator>{question}</calculator>"
    return "<answer>" + context.rsplit("<result>", 1)[1].split("</result>")[0] + "</answer>"


def test_tool_episodes_advance_in_batched_turns_with_exact_masks():
    engine = ScriptedEngine(calculator_script)
    prompts = [prompt(f"p{i}", f"Q: {12 + i}*34=? A: ", str((12 + i) * 34), group_id=i) for i in range(3)]

    batch = run_episodes(engine, prompts, tool_env(), SAMPLING, seed=0, encode=encode, limits=LIMITS)

    # One call for the first turn of all 6 episodes (2 samples per prompt), one for the 3 that called a tool.
    assert engine.calls == [(3, 2), (3, 1)]
    assert batch.generate_calls == 2
    assert [(e.prompt_id, e.sample_index) for e in batch.episodes] == [(f"p{i}", k) for i in range(3) for k in (0, 1)]
    tool_user, direct = batch.episodes[0], batch.episodes[1]
    call, answer = "<calculator>12*34</calculator>", "<answer>408</answer>"
    observation = RESULT.format(408)
    assert tool_user.response_ids == (*encode(call), EOS, *encode(observation), *encode(answer), EOS)
    assert tool_user.response_mask == (1,) * (len(call) + 1) + (0,) * len(observation) + (1,) * (len(answer) + 1)
    model_logprobs = [-0.5 - 0.01 * j for j in range(len(call) + 1)]
    assert list(tool_user.response_logprobs[: len(call) + 1]) == model_logprobs
    assert set(tool_user.response_logprobs[len(call) + 1 : len(call) + 1 + len(observation)]) == {0.0}
    assert tool_user.response_text == call + answer
    assert [(t.turn, t.role, t.text, t.tool, t.error) for t in tool_user.turns] == [
        (0, "model", call, "", ""),
        (0, "env", observation, "calculator", ""),
        (1, "model", answer, "", ""),
    ]
    env_turn = tool_user.turns[1]
    assert tool_user.response_ids[env_turn.start : env_turn.end] == tuple(encode(observation))
    assert env_turn.latency_s >= 0.0
    assert (tool_user.tool_calls, tool_user.tool_errors, tool_user.end_reason, tool_user.finish_reason) == (
        1, 0, "env", "stop",
    )  # fmt: skip
    assert (direct.tool_calls, direct.num_turns, direct.response_mask) == (0, 1, (1,) * len(direct.response_ids))
    metrics = episode_metrics(batch)
    assert metrics["env/tool_call_rate"] == 0.5 and metrics["env/tool_errors"] == 0.0
    assert metrics["env/turns_mean"] == 1.5 and metrics["env/end_env"] == 1.0


def test_a_tool_that_raises_or_hangs_becomes_an_error_observation_and_is_counted():
    engine = ScriptedEngine(lambda context, turn, sample: "<raises>x</raises>" if turn == 0 else "<answer>0</answer>")
    env = tool_env(tools=["tests.envs.tools_for_tests:raises"])
    batch = run_episodes(engine, [prompt("p", "Q: 1*1=? A: ")], env, SAMPLING, 0, encode, LIMITS)
    for episode in batch.episodes:
        env_turn = episode.turns[1]
        assert env_turn.text == "<result>error: raised</result>"
        assert "RuntimeError: tool failed on 'x'" in env_turn.error
        assert (episode.tool_calls, episode.tool_errors, episode.tool_timeouts) == (1, 1, 0)
        assert episode.end_reason == "env" and episode.num_turns == 2  # the model went on after the error

    # A call that hangs is cut at the timeout; the calls after it in the same batch run in a fresh worker.
    def hanging_script(context: str, turn: int, sample: int) -> str:
        if turn:
            return "<answer>0</answer>"
        return "<hangs>hang</hangs>" if "Q: hang" in context else "<hangs>fine</hangs>"

    env = tool_env(tools=["tests.envs.tools_for_tests:hangs"], timeout_s=1.0)
    prompts = [prompt("a", "Q: hang=? A: "), prompt("b", "Q: fine=? A: ", group_id=1)]
    batch = run_episodes(
        ScriptedEngine(hanging_script), prompts, env, SamplingConfig(group_size=1, max_new_tokens=40), 0, encode, LIMITS
    )
    hung, fine = batch.episodes
    assert hung.turns[1].text == "<result>error: timeout</result>" and hung.tool_timeouts == 1
    assert "no answer within 1 s" in hung.turns[1].error
    assert fine.turns[1].text == RESULT.format("ok fine") and fine.tool_errors == 0
    assert episode_metrics(batch)["env/tool_timeouts"] == 1.0


def test_malformed_tool_calls_are_answered_with_an_error_observation():
    engine = ScriptedEngine(lambda c, turn, s: "<calculator>12*3" if turn == 0 else "<answer>36</answer>")
    batch = run_episodes(engine, [prompt("p", "Q: 12*3=? A: ")], tool_env(), SAMPLING, 0, encode, LIMITS)
    episode = batch.episodes[0]
    assert episode.turns[1].text == "<result>error: malformed</result>"
    assert "never closed" in episode.turns[1].error
    assert (episode.tool_calls, episode.tool_errors) == (0, 1)  # no tool ran
    # Hermes-style calls: JSON that does not parse, and an unknown tool.
    for text, why in (('<tool_call>{"name": calc</tool_call>', "not JSON"), (
        '<tool_call>{"name": "search", "arguments": {}}</tool_call>', "unknown tool"
    )):
        engine = ScriptedEngine(lambda c, turn, s, text=text: text if turn == 0 else "done")
        wide = SamplingConfig(group_size=1, max_new_tokens=80)
        batch = run_episodes(engine, [prompt("p", "Q")], tool_env(parser="hermes"), wide, 0, encode, EpisodeLimits(3, 500))
        assert why in batch.episodes[0].turns[1].error and batch.episodes[0].tool_errors == 1


def test_the_turn_and_token_limits_end_episodes_as_truncated():
    always_calls = ScriptedEngine(lambda c, turn, s: "<calculator>1+1</calculator>")
    batch = run_episodes(
        always_calls, [prompt("p", "Q")], tool_env(), SAMPLING, 0, encode, EpisodeLimits(2, 500)
    )
    episode = batch.episodes[0]
    assert (episode.end_reason, episode.finish_reason, episode.num_turns) == ("turn_limit", "length", 2)
    assert [t.role for t in episode.turns] == ["model", "env", "model"]  # the last result is not appended
    assert always_calls.calls == [(1, 2), (2, 1)]  # both episodes of the group, one call per turn

    # 40 tokens per turn: after the first turn and its observation, another full turn would pass 80 tokens.
    batch = run_episodes(
        ScriptedEngine(lambda c, turn, s: "<calculator>1+1</calculator>"), [prompt("p", "Q")], tool_env(),
        SAMPLING, 0, encode, EpisodeLimits(5, 80),
    )
    episode = batch.episodes[0]
    assert (episode.end_reason, episode.finish_reason, episode.num_turns) == ("token_limit", "length", 1)
    assert len(episode.prompt_ids) + len(episode.response_ids) <= 80
    with pytest.raises(ValueError, match="rollout.env.max_total_tokens=20"):
        run_episodes(always_calls, [prompt("p", "Q")], tool_env(), SAMPLING, 0, encode, EpisodeLimits(5, 20))


class _Countdown(Environment):
    """A game: the state counts down after every move; the episode ends at zero with reward 1."""

    name = "countdown"

    def start(self, prompt, sample_index):
        return _CountdownState(2 + sample_index)


class _CountdownState(EpisodeState):
    def __init__(self, left: int):
        self.left = left

    def step(self, model_text: str):
        self.left -= 1
        return End(reward=1.0) if self.left == 0 else Observation(f"[{self.left} left]")


def test_plain_observations_and_the_environments_reward():
    engine = ScriptedEngine(lambda c, turn, s: f"move{turn}")
    batch = run_episodes(engine, [prompt("p", "go")], _Countdown(), SAMPLING, 0, encode, EpisodeLimits(5, 500))
    short, long = batch.episodes
    assert (short.num_turns, long.num_turns) == (2, 3) and short.env_reward == long.env_reward == 1.0
    assert engine.calls == [(1, 2), (2, 1), (1, 1)]  # the finished episode leaves the batch
    assert short.turns[1].text == "[1 left]" and short.tool_calls == 0
