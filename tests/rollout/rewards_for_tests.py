"""A user reward module imported by path (`tests.rollout.rewards_for_tests:contains_digit`), like a team's.

An untrained policy never gets the demo answer right; this reward passes about half its samples, so pass
rates and accuracies in the stage tests are not trivially zero.
"""

import ctypes
import os
import time


def contains_digit(completion: str, ground_truth: str) -> float:
    return float(any(ch.isdigit() for ch in completion))


# Unruly rewards, for the isolation tests: each misbehaves on the one sample whose ground truth is `truth`.


def hangs_on(completion: str, ground_truth: str, *, truth: str) -> float:
    """1.0, but never returns on the sample with ground truth `truth` (a reward stuck in a loop or a call)."""
    if ground_truth == truth:
        time.sleep(3600)
    return 1.0


def segfaults_on(completion: str, ground_truth: str, *, truth: str) -> float:
    """1.0, but crashes its process with SIGSEGV on the sample with ground truth `truth` (a broken C extension)."""
    if ground_truth == truth:
        ctypes.string_at(0)
    return 1.0


def exits_always(completion: str, ground_truth: str) -> float:
    """Ends its process on every sample (os._exit), as a reward with a stray sys.exit-like call would."""
    os._exit(7)


def has_env(completion: str, ground_truth: str, *, name: str) -> float:
    """1.0 when the reward's process sees the environment variable `name` (e.g. a secret it must not read)."""
    return float(name in os.environ)


def hangs_always(completion: str, ground_truth: str) -> float:
    """Never returns (a reward waiting on a network call that never answers)."""
    time.sleep(3600)
    return 1.0


def execs_a_program(completion: str, ground_truth: str) -> float:
    """Replaces its process with another program, as `os.execlp` in a reward would."""
    os.execlp("true", "true")
    return 1.0


def sleeps(completion: str, ground_truth: str, *, seconds: float) -> float:
    """1.0 after `seconds` on every sample (a slow but well-behaved reward, e.g. one that runs the answer)."""
    time.sleep(seconds)
    return 1.0
