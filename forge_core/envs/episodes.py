"""Multi-turn rollouts: the episodes of a batch advance turn by turn in batched calls to any generation engine
(forge_core.rollout.protocol).

    batch = run_episodes(engine, prompts, env, sampling, seed, encode, EpisodeLimits(max_turns=3, max_total_tokens=256))
    batch.episodes      # sampling.group_size Episodes per prompt, prompt order then sample index

Turn 0 is exactly the single-turn call `engine.generate(prompts, sampling, seed)`. Each later turn is one call
for every live episode, prompted with its whole context so far, one sample each, seeded by `(seed, group id,
"<prompt id>/<sample index>/<turn>")`: an episode depends only on its own history and the seed, not on which
episodes share the call or which engine serves it. Contexts only grow by appending, so prefix caching applies.

Tokens: the model's are what the engine sampled (mask 1, with logprobs); an observation's are its text encoded
on its own (mask 0, logprob 0.0), never merged with the model's, as forge_core.data.traces tokenizes SFT traces.

Limits: an episode ends when its environment says so (end_reason "env"), after `max_turns` model turns
("turn_limit"), or when context + next observation + `sampling.max_new_tokens` would exceed `max_total_tokens`
("token_limit"; the observation is not appended). A limit ending is a truncation (finish_reason "length"); an
environment's ending keeps the last turn's finish_reason. A prompt that cannot fit one turn is a ValueError.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from forge_core.config import replace
from forge_core.config.schema import SamplingConfig
from forge_core.envs.base import End, Environment, EpisodeState, Observation, ToolRequest
from forge_core.rewards.isolation import CALL_TIMEOUT
from forge_core.rollout.protocol import GenerationEngine
from forge_core.rollout.types import Episode, Prompt, Sample, TurnRecord

ENV_ENDED, TURN_LIMIT, TOKEN_LIMIT = "env", "turn_limit", "token_limit"
TRUNCATED = "length"


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int
    max_total_tokens: int


@dataclass
class EpisodeBatch:
    episodes: list[Episode]
    generate_calls: int = 0
    generation_s: float = 0.0  # seconds inside generate calls
    tool_s: float = 0.0  # seconds running tool calls

    @property
    def model_tokens(self) -> int:
        return sum(e.model_tokens for e in self.episodes)


@dataclass
class _Running:
    """One episode while it runs: its tokens so far and what happened."""

    prompt: Prompt
    sample_index: int
    state: EpisodeState
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: list[TurnRecord] = field(default_factory=list)
    model_texts: list[str] = field(default_factory=list)
    turn: int = 0
    last_finish: str = "stop"
    end_reason: str = ""
    env_reward: float | None = None
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0

    @property
    def context(self) -> tuple[int, ...]:
        return (*self.prompt.prompt_ids, *self.ids)

    def add_model_turn(self, sample: Sample) -> None:
        start = len(self.ids)
        self.ids += sample.response_ids
        self.mask += [1] * sample.response_len
        self.logprobs += sample.response_logprobs
        self.model_texts.append(sample.response_text)
        self.last_finish = sample.finish_reason
        self.turns.append(TurnRecord(self.turn, "model", sample.response_text, start, len(self.ids)))

    def add_observation(self, observation: Observation, ids: list[int]) -> None:
        start = len(self.ids)
        self.ids += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.turns.append(
            TurnRecord(
                self.turn, "env", observation.text, start, len(self.ids), observation.tool, observation.latency_s,
                observation.error,
            )
        )

    def count_tool_outcome(self, observation: Observation) -> None:
        if observation.error_kind:
            self.tool_errors += 1
        if observation.error_kind == CALL_TIMEOUT:
            self.tool_timeouts += 1

    def end(self, reason: str, reward: float | None = None, error: str = "") -> None:
        self.end_reason = reason
        self.env_reward = reward
        if error:  # the environment failed: say so on the last turn's record
            last = self.turns[-1]
            self.turns[-1] = dataclasses.replace(last, error=(last.error + "; " if last.error else "") + error)

    def episode(self) -> Episode:
        finish = self.last_finish if self.end_reason == ENV_ENDED else TRUNCATED
        return Episode(
            prompt_id=self.prompt.prompt_id,
            group_id=self.prompt.group_id,
            sample_index=self.sample_index,
            prompt_ids=tuple(self.prompt.prompt_ids),
            response_ids=tuple(self.ids),
            response_logprobs=tuple(self.logprobs),
            response_text="".join(self.model_texts),
            finish_reason=finish,
            ground_truth=self.prompt.ground_truth,
            response_mask=tuple(self.mask),
            turns=tuple(self.turns),
            end_reason=self.end_reason,
            env_reward=self.env_reward,
            tool_calls=self.tool_calls,
            tool_errors=self.tool_errors,
            tool_timeouts=self.tool_timeouts,
        )


def check_episode_prompts(prompts: Sequence[Prompt], sampling: SamplingConfig, limits: EpisodeLimits) -> None:
    for prompt in prompts:
        if len(prompt.prompt_ids) + sampling.max_new_tokens > limits.max_total_tokens:
            raise ValueError(
                f"prompt {prompt.prompt_id}: {len(prompt.prompt_ids)} tokens + max_new_tokens="
                f"{sampling.max_new_tokens} exceed rollout.env.max_total_tokens={limits.max_total_tokens}; raise "
                "it (up to model.max_seq_len) or lower rollout.sampling.max_new_tokens"
            )


def run_episodes(
    engine: GenerationEngine,
    prompts: Sequence[Prompt],
    env: Environment,
    sampling: SamplingConfig,
    seed: int,
    encode: Callable[[str], list[int]],
    limits: EpisodeLimits,
) -> EpisodeBatch:
    """`sampling.group_size` episodes per prompt, run to their ends (module docstring)."""
    check_episode_prompts(prompts, sampling, limits)
    running = [_Running(p, k, env.start(p, k)) for p in prompts for k in range(sampling.group_size)]
    batch = EpisodeBatch(episodes=[])
    try:
        samples = _generate(engine, list(prompts), sampling, seed, batch)
        _check_order(running, samples)
        live = running
        while live:
            for episode, sample in zip(live, samples):
                episode.add_model_turn(sample)
            _answer_turn(env, live, encode, limits, sampling.max_new_tokens, batch)
            for episode in live:
                episode.turn += 1
            live = [e for e in live if not e.end_reason]
            if live:
                requests = [_turn_prompt(e) for e in live]
                samples = _generate(engine, requests, replace(sampling, group_size=1), seed, batch)
    finally:
        for episode in running:
            episode.state.close()
    batch.episodes = [e.episode() for e in running]
    return batch


def _generate(engine, prompts: list[Prompt], sampling: SamplingConfig, seed: int, batch: EpisodeBatch):
    started = time.perf_counter()
    samples = engine.generate(prompts, sampling, seed)
    batch.generation_s += time.perf_counter() - started
    batch.generate_calls += 1
    return samples


def _check_order(running: list[_Running], samples: list[Sample]) -> None:
    assert [(e.prompt.prompt_id, e.sample_index) for e in running] == [
        (s.prompt_id, s.sample_index) for s in samples
    ], "the engine returned samples out of prompt/sample order"


def _turn_prompt(episode: _Running) -> Prompt:
    """The next turn's request: the episode's whole context, its own seed stream."""
    return Prompt(
        prompt_id=f"{episode.prompt.prompt_id}/{episode.sample_index}/{episode.turn}",
        prompt_ids=episode.context,
        ground_truth=episode.prompt.ground_truth,
        group_id=episode.prompt.group_id,
    )


def _answer_turn(env: Environment, live: list[_Running], encode, limits: EpisodeLimits, max_new_tokens: int,
                 batch: EpisodeBatch) -> None:
    """Every live episode's environment step after its model turn, tool calls run together."""
    answers: list = [episode.state.step(episode.model_texts[-1]) for episode in live]
    calls = [(i, answer.call) for i, answer in enumerate(answers) if isinstance(answer, ToolRequest)]
    if calls:
        started = time.perf_counter()
        outcomes = env.run_tools([call for _, call in calls])
        batch.tool_s += time.perf_counter() - started
        for (i, call), outcome in zip(calls, outcomes):
            live[i].tool_calls += 1
            answers[i] = live[i].state.tool_result(call, outcome)
    for episode, answer in zip(live, answers):
        if isinstance(answer, End):
            episode.end(ENV_ENDED, answer.reward, answer.error)
            continue
        assert isinstance(answer, Observation), f"an environment answered {answer!r}"
        episode.count_tool_outcome(answer)
        ids = encode(answer.text)
        if episode.turn + 1 >= limits.max_turns:
            episode.end(TURN_LIMIT)
        elif len(episode.context) + len(ids) + max_new_tokens > limits.max_total_tokens:
            episode.end(TOKEN_LIMIT)
        else:
            episode.add_observation(answer, ids)


def episode_metrics(batch: EpisodeBatch) -> dict[str, float]:
    """`env/*` manifest metrics: `tool_call_rate` is the share of episodes with a tool call, `tool_errors` counts
    failed and malformed calls, `end_<reason>` is the share of episodes ending each way."""
    episodes = batch.episodes
    n = max(len(episodes), 1)
    latencies = [t.latency_s for e in episodes for t in e.turns if t.role == "env" and t.tool]
    metrics = {
        "env/episodes": float(len(episodes)),
        "env/tool_call_rate": sum(1 for e in episodes if e.tool_calls) / n,
        "env/tool_calls": float(sum(e.tool_calls for e in episodes)),
        "env/tool_errors": float(sum(e.tool_errors for e in episodes)),
        "env/tool_timeouts": float(sum(e.tool_timeouts for e in episodes)),
        "env/tool_latency_mean_s": sum(latencies) / len(latencies) if latencies else 0.0,
        "env/turns_mean": sum(e.num_turns for e in episodes) / n,
        "env/model_tokens_mean": sum(e.model_tokens for e in episodes) / n,
        "env/episode_tokens_mean": sum(len(e.prompt_ids) + e.response_len for e in episodes) / n,
        "env/generate_calls": float(batch.generate_calls),
        "env/tool_s": batch.tool_s,
    }
    for reason in (ENV_ENDED, TURN_LIMIT, TOKEN_LIMIT):
        metrics[f"env/end_{reason}"] = sum(1 for e in episodes if e.end_reason == reason) / n
    return metrics
