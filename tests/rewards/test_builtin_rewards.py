"""Each built-in reward function on hand-made cases, malformed answers included."""

from __future__ import annotations

import importlib.util
import random

import pytest

from forge_core.data import demo
from forge_core.rewards import builtin_reward_names, final_number, parse_number, resolve_reward, tagged_answer


def score(name: str, completion: str, truth: str, **kwargs) -> float:
    return resolve_reward(name).fn(completion, truth, **kwargs)


def test_registry_lists_every_builtin_with_a_version():
    names = builtin_reward_names()
    for name in ("exact_answer", "per_digit", "numeric_answer", "answer_format", "math_verify"):
        assert name in names
    for name in ("exact_answer", "per_digit", "numeric_answer", "answer_format"):
        assert resolve_reward(name).version


@pytest.mark.parametrize(
    ("completion", "truth", "expected"),
    [
        ("<answer>0168</answer>", "0168", 1.0),
        ("<answer> 0168 </answer>", "0168\n", 1.0),  # whitespace around the answer does not matter
        ("<answer>168</answer>", "0168", 0.0),  # zero padding does
        ("<answer>0169</answer>", "0168", 0.0),
        ("0168", "0168", 0.0),  # no tag: the format is part of the task
        ("<answer>0168", "0168", 0.0),  # unclosed
        ("", "0168", 0.0),
        ("<answer>0100</answer><answer>0168</answer>", "0168", 0.0),  # the first answer counts
    ],
)
def test_exact_answer(completion, truth, expected):
    assert score("exact_answer", completion, truth) == expected


def test_exact_answer_with_another_tag():
    assert score("exact_answer", "<final>Paris</final>", "Paris", tag="final") == 1.0
    assert score("exact_answer", "<answer>Paris</answer>", "Paris", tag="final") == 0.0
    with pytest.raises(ValueError, match="tag="):
        score("exact_answer", "x", "y", tag="<bad>")


def test_exact_answer_and_per_digit_agree_with_the_demo_task_checker():
    rng = random.Random(0)
    for _ in range(200):
        truth = f"{rng.randrange(2000):04d}"
        guess = f"{rng.randrange(2000):04d}" if rng.random() < 0.7 else truth
        wrapper = rng.choice(
            ["<answer>{}</answer>", "<answer>{}", "{}", "<answer>{}</answer>junk", "<answer>{}0</answer>"]
        )
        completion = wrapper.format(guess)
        assert score("exact_answer", completion, truth) == float(demo.check_answer(completion, truth))
        assert score("per_digit", completion, truth) == pytest.approx(demo.per_digit_score(completion, truth))


@pytest.mark.parametrize(
    ("completion", "truth", "expected"),
    [
        ("<answer>0168</answer>", "0168", 1.0),
        ("<answer>0178</answer>", "0168", 0.75),
        ("<answer>1111</answer>", "0168", 0.25),
        ("<answer>01680</answer>", "0168", 0.8),  # too long: divided by the longer length
        ("<answer>01</answer>", "0168", 0.5),
        ("<answer></answer>", "0168", 0.0),
        ("no tag 0168", "0168", 0.0),
    ],
)
def test_per_digit_partial_credit(completion, truth, expected):
    assert score("per_digit", completion, truth) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("completion", "truth", "expected"),
    [
        ("She has 3 + 4 = 7 apples. #### 7", "Natalia sold 48/2 = 24 clips.\n#### 72", 0.0),
        ("48 + 24 = 72 clips. #### 72", "Natalia sold 48/2 = 24 clips.\n#### 72", 1.0),
        ("The answer is 72.", "#### 72", 1.0),  # last number of the text
        ("<answer>$1,234.50</answer> (was 7)", "1234.5", 1.0),  # the tag wins over later numbers
        ("#### 0.3333333", "1/3", 1.0),  # off by 3e-8: within the default abs_tol=1e-6
        ("#### 0.33", "1/3", 0.0),
        ("#### -5", "-5", 1.0),
        ("no number at all", "5", 0.0),  # malformed completion: zero, not an error
        ("<answer>seven</answer> 7", "7", 0.0),  # the tag has no number: the tag still decides
    ],
)
def test_numeric_answer(completion, truth, expected):
    assert score("numeric_answer", completion, truth) == expected


def test_numeric_answer_tolerance_is_configurable():
    assert score("numeric_answer", "#### 0.33", "1/3", abs_tol=0.01) == 1.0
    assert score("numeric_answer", "#### 100.5", "100", rel_tol=0.01) == 1.0
    assert score("numeric_answer", "#### 102", "100", rel_tol=0.01) == 0.0


def test_numeric_answer_rejects_a_ground_truth_without_a_number():
    with pytest.raises(ValueError, match="ground truth .* has no number"):
        score("numeric_answer", "#### 3", "unknown")


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("<answer>0168</answer>", 1.0),
        ("thinking... <answer>x</answer>", 1.0),
        ("<answer></answer>", 0.0),  # empty
        ("<answer>  </answer>", 0.0),
        ("<answer>1</answer><answer>2</answer>", 0.0),  # two answers
        ("<answer>1", 0.0),
        ("1</answer>", 0.0),
        ("</answer>1<answer>", 0.0),  # closed before opened
        ("plain text", 0.0),
    ],
)
def test_answer_format(completion, expected):
    assert score("answer_format", completion, "ignored") == expected


def test_answer_helpers():
    assert tagged_answer("a <answer> b </answer> c") == "b"
    assert tagged_answer("a <answer> b") is None
    assert parse_number("1,234") == 1234.0
    assert parse_number("3/4") == 0.75
    assert parse_number("abc") is None
    assert parse_number("1/0") is None
    assert final_number("x 1 y 2.5 z") == 2.5
    assert final_number("nothing") is None


@pytest.mark.skipif(importlib.util.find_spec("math_verify") is None, reason="math-verify is not installed")
def test_math_verify_when_installed():
    spec = resolve_reward("math_verify")
    assert spec.version.startswith("math-verify==")
    assert spec.fn("The answer is $\\frac{1}{2}$", "$0.5$") == 1.0
    assert spec.fn("The answer is $3$", "$0.5$") == 0.0
    assert spec.fn("I do not know", "$0.5$") == 0.0


def test_an_optional_reward_without_its_package_names_the_package(monkeypatch):
    from forge_core.rewards import registry

    monkeypatch.setitem(
        registry._OPTIONAL,
        "needs_missing_pkg",
        registry.OptionalReward(
            module="forge_no_such_module", distribution="forge-no-such-pkg", factory=lambda: None
        ),
    )
    with pytest.raises(
        ValueError, match=r"needs the 'forge-no-such-pkg' package.*pip install forge-no-such-pkg"
    ):
        resolve_reward("needs_missing_pkg")
