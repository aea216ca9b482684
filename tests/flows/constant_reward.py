"""Rewards for flow tests that need a known reward signal whatever the (random) policy writes."""

import zlib


def one(completion: str, ground_truth: str) -> float:
    """1.0 for every completion: rollouts without reward variance (tests of the no-signal warning)."""
    return 1.0


def coin(completion: str, ground_truth: str) -> float:
    """A fixed coin flip per completion text: distinct samples of a group almost surely differ, so GRPO has
    advantages to step on even where a random policy never solves a prompt."""
    return float(zlib.crc32(completion.encode("utf-8")) % 2)
