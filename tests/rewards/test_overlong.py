"""DAPO's overlong shaping as a reward component: the published formula (arXiv 2503.14476, eq. 13), the sample
facts it reads through the reward set, and its errors."""

from __future__ import annotations

import pytest

from forge_core.config.schema import RewardComponentConfig
from forge_core.rewards import RewardSet, resolve_reward, sample_context
from forge_core.rewards.scoring import RewardFunctionError
from forge_core.rollout.types import Sample


def dapo_length_penalty(length: int, l_max: int, l_cache: int) -> float:
    """R_length(y) as the DAPO paper writes it, with L_max the budget and L_cache the punishment window."""
    if length <= l_max - l_cache:
        return 0.0
    if length <= l_max:
        return ((l_max - l_cache) - length) / l_cache
    return -1.0


@pytest.mark.parametrize("length", range(22))
def test_overlong_is_the_dapo_length_penalty(length):
    fn = resolve_reward("overlong").fn
    value = fn("text", "truth", response_len=length, max_new_tokens=20, window=6)
    assert value == pytest.approx(dapo_length_penalty(length, 20, 6))
    assert fn("text", "truth", response_len=length, max_new_tokens=20, window=6, penalty=0.5) == pytest.approx(
        0.5 * dapo_length_penalty(length, 20, 6)
    )


def sample(length: int, reason: str) -> Sample:
    return Sample("p", 0, 0, (1, 2), tuple(range(3, 3 + length)), tuple([-0.1] * length), "<answer>7</answer>",
                  reason, "7")


def test_reward_set_feeds_the_sample_facts_and_records_the_component():
    rewards = RewardSet.from_config([
        RewardComponentConfig(name="exact_answer", weight=1.0),
        RewardComponentConfig(name="overlong", weight=1.0, kwargs={"window": 4}),
    ])
    samples = [sample(3, "stop"), sample(7, "stop"), sample(8, "length")]
    scored = rewards.score(
        [s.response_text for s in samples], [s.ground_truth for s in samples], [s.ref for s in samples],
        contexts=[sample_context(s, max_new_tokens=8) for s in samples],
    )
    assert scored.columns["reward_overlong"] == [0.0, -0.75, -1.0]
    assert scored.total == [1.0, 0.25, 0.0]
    assert rewards.versions()["overlong"] == "1"
    with pytest.raises(RewardFunctionError, match=r"needs \['response_len', 'max_new_tokens'\] of each sample"):
        rewards.score(["x"], ["7"], ["ref-0"])


def test_bad_overlong_kwargs_are_clear_errors():
    with pytest.raises(ValueError, match=r"rollout.rewards\[0\].kwargs=\{'windw': 4\}: do not fit"):
        RewardSet.from_config([RewardComponentConfig(name="overlong", weight=1.0, kwargs={"windw": 4})])
    fn = resolve_reward("overlong").fn
    with pytest.raises(ValueError, match="kwargs.window=30 must be in"):
        fn("x", "y", response_len=3, max_new_tokens=16, window=30)
    with pytest.raises(ValueError, match="kwargs.penalty=-1"):
        fn("x", "y", response_len=3, max_new_tokens=16, penalty=-1)
