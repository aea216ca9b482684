"""The built-in reward functions. Each takes `(completion, ground_truth, **kwargs)` and returns a float.

- `exact_answer(tag="answer")`: 1 if the tagged answer equals the ground truth exactly, else 0.
- `per_digit(tag="answer")`: share of ground-truth characters the tagged answer gets right, by position, in [0, 1].
- `numeric_answer(tag="answer", rel_tol=1e-6, abs_tol=1e-6)`: 1 if the final number equals the reference's
  final number (GSM8K: `... #### 42`) within tolerance, else 0.
- `answer_format(tag="answer")`: 1 if the completion holds exactly one non-empty, well-formed answer tag.
- `math_verify()`: 1 if HF math-verify finds the answer equivalent to the ground truth (needs `math-verify`).
- `reasoning_gym(tag="answer")`: the reasoning-gym task's scorer on the tagged answer; the ground truth is the
  task's entry as JSON (data.source=reasoning_gym:<task>; needs `reasoning-gym`).
- `environment(scale=1.0)`: the reward a multi-turn episode's environment gave (rollout.env).
- `overlong(window=4, penalty=1.0)`: DAPO's soft overlong penalty on the sample's `response_len`, not the text;
  add it next to the task reward.

A malformed completion (no tag, no number) scores 0: the model's mistake. A ground truth that cannot be scored
(no number for `numeric_answer`) raises ValueError: a data problem.
"""

from __future__ import annotations

import math

from forge_core.rewards.answers import DEFAULT_TAG, final_number, tag_counts, tagged_answer
from forge_core.rewards.registry import RewardFn, register_optional_reward, register_reward


@register_reward("exact_answer", version="1")
def exact_answer(completion: str, ground_truth: str, *, tag: str = DEFAULT_TAG) -> float:
    answer = tagged_answer(completion, tag)
    return float(answer is not None and answer == ground_truth.strip())


@register_reward("per_digit", version="1")
def per_digit(completion: str, ground_truth: str, *, tag: str = DEFAULT_TAG) -> float:
    """Partial credit divided by the longer length, so a too-long answer is penalised and only the exact
    answer scores 1."""
    answer = tagged_answer(completion, tag)
    truth = ground_truth.strip()
    if answer is None or not truth:
        return 0.0
    matches = sum(1 for got, want in zip(answer, truth) if got == want)
    return matches / max(len(answer), len(truth))


@register_reward("numeric_answer", version="1")
def numeric_answer(
    completion: str,
    ground_truth: str,
    *,
    tag: str = DEFAULT_TAG,
    rel_tol: float = 1e-6,
    abs_tol: float = 1e-6,
) -> float:
    truth = final_number(ground_truth, tag)
    if truth is None:
        raise ValueError(
            f"ground truth {ground_truth[-80:]!r} has no number; numeric_answer expects GSM8K-style answers "
            "('... #### 42' or '42')"
        )
    answer = final_number(completion, tag)
    return float(answer is not None and math.isclose(answer, truth, rel_tol=rel_tol, abs_tol=abs_tol))


@register_reward("answer_format", version="1")
def answer_format(completion: str, ground_truth: str, *, tag: str = DEFAULT_TAG) -> float:
    opens, closes = tag_counts(completion, tag)
    if opens != 1 or closes != 1:
        return 0.0
    answer = tagged_answer(completion, tag)
    return float(bool(answer))


@register_reward("overlong", version="1")
def overlong(
    completion: str,
    ground_truth: str,
    *,
    response_len: int,
    max_new_tokens: int,
    window: int = 4,
    penalty: float = 1.0,
) -> float:
    """0 up to `max_new_tokens - window` tokens, then linearly down to `-penalty` at `max_new_tokens`, and
    `-penalty` beyond (DAPO, arXiv 2503.14476, eq. 13). ValueError for a window outside [1, max_new_tokens]
    or a negative penalty."""
    if not 0 < window <= max_new_tokens:
        raise ValueError(
            f"overlong: kwargs.window={window} must be in [1, max_new_tokens={max_new_tokens}]; set "
            "rollout.rewards[i].kwargs.window to the number of tokens before max_new_tokens the penalty ramps over"
        )
    if penalty < 0:
        raise ValueError(f"overlong: kwargs.penalty={penalty} must be >= 0 (the penalty at max_new_tokens)")
    free = max_new_tokens - window
    if response_len <= free:
        return 0.0
    if response_len <= max_new_tokens:
        return (free - response_len) / window * penalty
    return -penalty


def _math_verify_reward() -> RewardFn:
    from math_verify import parse, verify

    def math_verify(completion: str, ground_truth: str) -> float:
        gold = parse(ground_truth)
        if not gold:
            raise ValueError(f"math-verify cannot parse the ground truth {ground_truth[-80:]!r}")
        return float(verify(gold, parse(completion)))

    return math_verify


register_optional_reward(
    "math_verify", module="math_verify", distribution="math-verify", factory=_math_verify_reward
)


@register_reward("environment", version="1")
def environment(completion: str, ground_truth: str, *, env_reward: float, scale: float = 1.0) -> float:
    """The episode environment's reward times `scale`; only multi-turn episodes (rollout.env) carry one."""
    return scale * float(env_reward)


def _reasoning_gym_reward() -> RewardFn:
    import json

    import reasoning_gym

    def reasoning_gym_score(completion: str, ground_truth: str, *, tag: str = DEFAULT_TAG) -> float:
        try:
            entry = json.loads(ground_truth)
            task = entry["metadata"]["source_dataset"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(
                f"ground truth {ground_truth[:80]!r} is not a reasoning-gym entry (JSON with metadata."
                "source_dataset); the reasoning_gym reward scores rows of a data.source=reasoning_gym:<task> source"
            ) from exc
        return float(reasoning_gym.get_score_answer_fn(task)(tagged_answer(completion, tag), entry))

    return reasoning_gym_score


register_optional_reward(
    "reasoning_gym", module="reasoning_gym", distribution="reasoning-gym", factory=_reasoning_gym_reward
)
