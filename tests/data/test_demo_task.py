"""The demo task: deterministic disjoint splits, answers that its own verifier accepts, a difficulty knob."""

from __future__ import annotations

import subprocess
import sys

import pytest

from forge_core.data import demo
from forge_core.data.answers import parse_gsm8k_answer


def test_every_generated_answer_passes_its_own_verifier_and_is_the_true_sum():
    splits = demo.generate_splits(num_digits=3, num_sft=200, num_rl=200, num_eval=100, seed=1)

    for example in (e for split in splits.values() for e in split):
        assert demo.check_answer(example.completion, example.ground_truth)
        assert demo.per_digit_score(example.completion, example.ground_truth) == 1.0
        operands = example.prompt.removeprefix("Q: ").removesuffix("=? A: ").split("+")
        assert [len(x) for x in operands] == [3, 3]
        assert int(example.ground_truth) == int(operands[0]) + int(operands[1])
        assert len(example.ground_truth) == 4


@pytest.mark.parametrize("num_digits", [1, 5, 12])
def test_num_digits_sets_operand_and_answer_width(num_digits):
    (example,) = demo.generate_splits(num_digits, num_sft=1, num_rl=0, num_eval=0, seed=0)["sft"]

    assert len(example.ground_truth) == num_digits + 1
    assert example.prompt.count("+") == 1 and len(example.prompt) == len("Q: +=? A: ") + 2 * num_digits


def test_splits_are_disjoint_deterministic_and_eval_ignores_other_sizes():
    a = demo.generate_splits(2, num_sft=300, num_rl=500, num_eval=200, seed=7)
    b = demo.generate_splits(2, num_sft=300, num_rl=500, num_eval=200, seed=7)
    c = demo.generate_splits(2, num_sft=50, num_rl=20, num_eval=200, seed=7)
    other_seed = demo.generate_splits(2, num_sft=300, num_rl=500, num_eval=200, seed=8)

    pairs = {name: {(e.a, e.b) for e in split} for name, split in a.items()}
    assert [len(p) for p in pairs.values()] == [200, 300, 500]
    assert not (pairs["eval"] & pairs["sft"]) and not (pairs["eval"] & pairs["rl"]) and not (pairs["sft"] & pairs["rl"])
    assert a == b
    assert c["eval"] == a["eval"]
    assert other_seed["eval"] != a["eval"]


def test_splits_are_identical_in_another_process():
    code = "from forge_core.data import demo; print([(e.a, e.b) for e in demo.generate_splits(3, 5, 5, 5, 3)['sft']])"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()

    assert other == str([(e.a, e.b) for e in demo.generate_splits(3, 5, 5, 5, 3)["sft"]])


def test_too_many_examples_for_the_difficulty_is_an_error():
    with pytest.raises(ValueError, match="exceeds the 100 distinct pairs.*num_digits"):
        demo.generate_splits(1, num_sft=60, num_rl=30, num_eval=11, seed=0)
    assert len(demo.generate_splits(1, num_sft=60, num_rl=30, num_eval=10, seed=0)["rl"]) == 30


@pytest.mark.parametrize(
    ("completion", "exact", "per_digit"),
    [
        ("<answer>0168</answer>", True, 1.0),
        ("  <answer> 0168 </answer> trailing", True, 1.0),
        ("<answer>168</answer>", False, 0.0),  # zero padding is part of the answer
        ("<answer>0178</answer>", False, 0.75),
        ("<answer>01680</answer>", False, 0.8),
        ("0168", False, 0.0),  # no tag: neither reward
        ("<answer>0168", False, 0.0),
        ("<answer>0167</answer><answer>0168</answer>", False, 0.75),  # the first tag counts
    ],
)
def test_verifier(completion, exact, per_digit):
    assert demo.check_answer(completion, "0168") is exact
    assert demo.per_digit_score(completion, "0168") == pytest.approx(per_digit)
    assert demo.has_answer_tag(completion) is ("</answer>" in completion)


@pytest.mark.parametrize(
    ("answer", "number"),
    [("so 3 + 4 = 7\n#### 7", "7"), ("#### 1,234", "1234"), ("a #### 1 b #### -2.5", "-2.5"), ("#### five", None),
     ("no marker 5", None)],
)
def test_gsm8k_final_answer(answer, number):
    assert parse_gsm8k_answer(answer) == number


def test_verifier_module_imports_only_the_standard_library():
    code = (
        "import sys; import forge_core.data.demo, forge_core.data.answers; "
        "print(sorted(m for m in ('pyarrow', 'tokenizers', 'numpy', 'fsspec') if m in sys.modules))"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "[]"
