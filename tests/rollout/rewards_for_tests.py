"""A user reward module imported by path (`tests.rollout.rewards_for_tests:contains_digit`), like a team's.

An untrained policy never gets the demo answer right; this reward passes about half its samples, so pass
rates and accuracies in the stage tests are not trivially zero.
"""


def contains_digit(completion: str, ground_truth: str) -> float:
    return float(any(ch.isdigit() for ch in completion))
