"""Weighted reward sums, user functions by import path, and the errors a bad reward function produces."""

from __future__ import annotations

import textwrap

import pytest

from forge_core.config.schema import RewardComponentConfig
from forge_core.rewards import RewardFunctionError, RewardSet, resolve_reward

USER_MODULE = textwrap.dedent(
    """
    import math

    def brevity(completion, ground_truth, max_chars=10):
        return 1.0 if len(completion) <= max_chars else 0.0

    def versioned(completion, ground_truth):
        return 0.5
    versioned.version = "7"

    def explodes(completion, ground_truth):
        raise KeyError("lookup table has no entry")

    def says_yes(completion, ground_truth):
        return "yes"

    def nan_reward(completion, ground_truth):
        return math.nan

    def returns_bool(completion, ground_truth):
        return completion == ground_truth

    NOT_A_FUNCTION = 3
    """
)


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A real importable module of user reward functions, like a team's own package."""
    (tmp_path / "forge_user_rewards.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "forge_user_rewards"


def reward_set(*components: tuple[str, float] | tuple[str, float, dict]) -> RewardSet:
    configs = [
        RewardComponentConfig(name=c[0], weight=c[1], kwargs=c[2] if len(c) > 2 else {}) for c in components
    ]
    return RewardSet.from_config(configs)


def test_total_is_the_weighted_sum_of_component_columns():
    rewards = reward_set(("exact_answer", 0.5), ("per_digit", 0.5), ("answer_format", 0.1))
    completions = ["<answer>0168</answer>", "<answer>0178</answer>", "0168"]
    scored = rewards.score(completions, ["0168"] * 3, ["s0", "s1", "s2"])
    assert scored.columns == {
        "reward_exact_answer": [1.0, 0.0, 0.0],
        "reward_per_digit": [1.0, 0.75, 0.0],
        "reward_answer_format": [1.0, 1.0, 0.0],
    }
    assert scored.total == pytest.approx([1.1, 0.475, 0.0])
    assert rewards.columns == ["reward_exact_answer", "reward_per_digit", "reward_answer_format"]
    assert rewards.primary_column == "reward_exact_answer"
    assert rewards.versions() == {"exact_answer": "1", "per_digit": "1", "answer_format": "1"}


def test_user_function_by_import_path_with_kwargs(user_module):
    rewards = reward_set(("exact_answer", 1.0), (f"{user_module}:brevity", -0.2, {"max_chars": 4}))
    scored = rewards.score(["<answer>1</answer>", "abc"], ["1", "1"], ["a", "b"])
    assert scored.columns["reward_brevity"] == [0.0, 1.0]
    assert scored.total == pytest.approx([1.0, -0.2])


def test_user_function_versions(user_module, tmp_path):
    assert resolve_reward(f"{user_module}:versioned").version == "7"
    first = resolve_reward(f"{user_module}:brevity").version
    assert first.startswith("src:")
    # Changing a function's code changes its version (a new module name avoids the import cache).
    (tmp_path / "forge_user_rewards_v2.py").write_text(USER_MODULE.replace("<= max_chars", "< max_chars"))
    assert resolve_reward("forge_user_rewards_v2:brevity").version != first


def test_user_functions_returning_bools_count_as_numbers(user_module):
    scored = reward_set((f"{user_module}:returns_bool", 1.0)).score(["a", "b"], ["a", "a"], ["0", "1"])
    assert scored.total == [1.0, 0.0]


def test_a_raising_user_function_names_itself_and_the_sample(user_module):
    rewards = reward_set(("exact_answer", 1.0), (f"{user_module}:explodes", 1.0))
    with pytest.raises(RewardFunctionError) as info:
        rewards.score(["<answer>1</answer>"], ["1"], ["prompt_id=p7 sample_index=3"])
    message = str(info.value)
    assert f"{user_module}:explodes" in message
    assert "rollout.rewards[1]" in message
    assert "prompt_id=p7 sample_index=3" in message
    assert "KeyError" in message and "lookup table has no entry" in message
    assert isinstance(info.value.__cause__, KeyError)


@pytest.mark.parametrize(("fn", "shown"), [("says_yes", "'yes' (str)"), ("nan_reward", "nan (float)")])
def test_a_non_number_is_an_error_not_a_zero(user_module, fn, shown):
    rewards = reward_set((f"{user_module}:{fn}", 1.0))
    with pytest.raises(RewardFunctionError) as info:
        rewards.score(["x"], ["y"], ["s9"])
    assert f"{user_module}:{fn}" in str(info.value)
    assert f"returned {shown} on sample s9" in str(info.value)
    assert "must return a finite float" in str(info.value)


def test_a_failing_builtin_is_reported_the_same_way():
    rewards = reward_set(("numeric_answer", 1.0))
    with pytest.raises(
        RewardFunctionError, match=r"numeric_answer.*raised ValueError.*has no number.*sample q1"
    ):
        rewards.score(["#### 4"], ["n/a"], ["q1"])


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("no_such_reward", r"rollout.rewards\[0\].name: reward 'no_such_reward': unknown; use one of"),
        ("forge_no_such_module:fn", r"cannot import module 'forge_no_such_module'"),
        ("forge_user_rewards:missing", r"has no attribute 'missing'"),
        ("forge_user_rewards:NOT_A_FUNCTION", r"is a int, not a function"),
        ("bad path:fn", r"not an import path"),
    ],
)
def test_unresolvable_names_fail_at_construction(user_module, name, message):
    with pytest.raises(ValueError, match=message):
        reward_set((name, 1.0))


def test_kwargs_that_do_not_fit_fail_at_construction():
    with pytest.raises(
        ValueError,
        match=r"rollout.rewards\[0\].kwargs=\{'tolerance': 0.1\}: do not fit reward 'numeric_answer'",
    ):
        reward_set(("numeric_answer", 1.0, {"tolerance": 0.1}))


def test_the_same_function_twice_is_rejected():
    with pytest.raises(
        ValueError, match=r"rollout.rewards\[1\].name='exact_answer': its column 'reward_exact_answer'"
    ):
        reward_set(("exact_answer", 1.0), ("exact_answer", 0.5))


def test_no_components_is_rejected():
    with pytest.raises(ValueError, match="name at least one reward component"):
        RewardSet.from_config([])
