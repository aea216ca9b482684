"""Training on episodes: the GRPO loss, its gradient, the advantages and the mismatch metrics see the model's
tokens only; environment tokens are context. An episode of one turn trains exactly like today's single-turn
sample, token for token."""

from __future__ import annotations

import dataclasses

import torch

from forge_core.config.schema import AdvantageConfig, CorrectionConfig, LossConfig, SamplingConfig
from forge_core.envs import EpisodeLimits, run_episodes
from forge_core.losses.base import ModelOutputs
from forge_core.losses.correction import mismatch_summary
from forge_core.losses.grpo import build_policy_loss
from forge_core.rewards import ScoredRewards
from forge_core.rollout.table import RESPONSE_MASK_COLUMN, RolloutLineage, rollout_table
from forge_core.rollout.types import Sample
from forge_core.trainers.grpo import rollouts_to_rl_batch
from tests.envs.scripted import ScriptedEngine, encode, prompt
from tests.envs.test_episodes import calculator_script, tool_env

LINEAGE = RolloutLineage("mem://p/policy", "v", 0, 0, "{}", "{}")
ADVANTAGE = AdvantageConfig(drop_zero_variance_groups=False)


def _table(samples, rewards, environment: str | None):
    scored = ScoredRewards(columns={"reward_exact_answer": rewards}, total=rewards)
    return rollout_table(samples, scored, dataclasses.replace(LINEAGE, environment=environment))


def _episodes():
    prompts = [prompt(f"p{i}", f"Q: {21 + i}*3=? A: ", str((21 + i) * 3), group_id=i) for i in range(2)]
    batch = run_episodes(
        ScriptedEngine(calculator_script), prompts, tool_env(), SamplingConfig(group_size=2, max_new_tokens=40), 0,
        encode, EpisodeLimits(3, 200),
    )
    return batch.episodes


def test_the_loss_and_its_gradient_touch_model_tokens_only():
    episodes = _episodes()
    table = _table(episodes, [1.0, 0.0, 1.0, 0.0], environment='{"name": "tool_use"}')
    assert RESPONSE_MASK_COLUMN in table.column_names and "turns" in table.column_names
    batch = rollouts_to_rl_batch(table, ADVANTAGE).batch

    for row, episode in enumerate(episodes):
        start = len(episode.prompt_ids) - 1  # response token j is the target at start + j
        expected = torch.zeros(batch.seq_len, dtype=torch.bool)
        expected[start : start + episode.response_len] = torch.tensor(episode.response_mask, dtype=torch.bool)
        assert torch.equal(batch.response_mask_BL[row], expected)
        model = torch.tensor(episode.response_mask, dtype=torch.bool)
        stored = batch.generator_logprobs_BL[row, start : start + episode.response_len]
        assert torch.equal(stored[model], torch.tensor(episode.response_logprobs, dtype=torch.float32)[model])
    env_positions = ~batch.response_mask_BL & (torch.arange(batch.seq_len) < batch.lengths_B[:, None])
    assert env_positions.sum() > 0  # the tool-using episodes have observation tokens inside their rows

    loss_fn = build_policy_loss(LossConfig(), 40, CorrectionConfig(type="tis"))
    logprobs = (batch.generator_logprobs_BL + 0.05).requires_grad_(True)
    old = batch.generator_logprobs_BL - 0.02
    batch = dataclasses.replace(batch, old_logprobs_BL=old)
    out = loss_fn(ModelOutputs(logprobs, torch.ones_like(logprobs)), batch, loss_fn.normalizer(batch))
    out.loss.backward()
    assert logprobs.grad[env_positions].abs().sum() == 0  # environment tokens never carry loss
    assert logprobs.grad[batch.response_mask_BL].abs().sum() > 0
    assert float(out.metrics["tokens"]) == float(batch.response_mask_BL.sum())

    # Whatever the environment positions hold (trainer, sampler or old logprobs), nothing changes.
    noisy = lambda t: torch.where(env_positions, torch.randn_like(t) * 5, t)
    perturbed = dataclasses.replace(
        batch, generator_logprobs_BL=noisy(batch.generator_logprobs_BL), old_logprobs_BL=noisy(old)
    )
    again = loss_fn(ModelOutputs(noisy(logprobs.detach()), torch.ones_like(logprobs)), perturbed, loss_fn.normalizer(batch))
    assert torch.equal(again.loss, out.loss.detach())
    assert mismatch_summary(perturbed, loss_fn.correction) == mismatch_summary(batch, loss_fn.correction)


def test_a_one_turn_episode_trains_exactly_like_a_single_turn_sample():
    answer_only = ScriptedEngine(lambda context, turn, sample: f"<answer>{sample}</answer>")
    prompts = [prompt(f"p{i}", f"Q: {i}*1=? A: ", str(i), group_id=i) for i in range(2)]
    episodes = run_episodes(
        answer_only, prompts, tool_env(), SamplingConfig(group_size=2, max_new_tokens=40), 0, encode,
        EpisodeLimits(3, 200),
    ).episodes
    assert all(e.num_turns == 1 and e.end_reason == "env" for e in episodes)
    single = [Sample(**{f.name: getattr(e, f.name) for f in dataclasses.fields(Sample)}) for e in episodes]
    rewards = [1.0, 0.0, 0.0, 1.0]

    from_episodes = rollouts_to_rl_batch(_table(episodes, rewards, '{"name": "tool_use"}'), ADVANTAGE)
    from_samples = rollouts_to_rl_batch(_table(single, rewards, None), ADVANTAGE)

    for field in dataclasses.fields(from_samples.batch):
        a, b = getattr(from_episodes.batch, field.name), getattr(from_samples.batch, field.name)
        assert (a is None and b is None) or torch.equal(a, b), field.name
    assert from_episodes.stats == from_samples.stats
    loss_fn = build_policy_loss(LossConfig(), 40)
    logprobs = from_samples.batch.generator_logprobs_BL + 0.1
    outputs = ModelOutputs(logprobs, torch.ones_like(logprobs))
    norm = loss_fn.normalizer(from_samples.batch)
    assert torch.equal(loss_fn(outputs, from_episodes.batch, norm).loss, loss_fn(outputs, from_samples.batch, norm).loss)
