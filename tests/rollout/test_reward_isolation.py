"""Rewards scored in worker processes (forge_core.rewards.isolation): real `python -m forge_core.rewards.worker`
processes, real hangs and crashes (the unruly rewards of rewards_for_tests.py). The rollout stage with such
rewards, on a real engine, is in test_rollout_stage.py."""

from __future__ import annotations

import math
import socket
from multiprocessing.connection import Connection

import pytest

from forge_core.config.schema import RewardComponentConfig
from forge_core.rewards import RewardFunctionError, RewardSet
from forge_core.rewards.isolation import (
    CRASHES,
    TIMEOUTS,
    ZEROED,
    RewardIsolation,
    SampleProgress,
    failure_limit,
)
from forge_core.rewards.worker import _score

USER = "tests.rollout.rewards_for_tests"
TEXTS = [f"<answer>{n:04d}</answer> {n}" for n in range(12)]
TRUTHS = [f"{n:04d}" if n % 3 else "0000" for n in range(12)]
REFS = [f"sample-{n}" for n in range(12)]


def rewards(*components: tuple, workers: int = 1, timeout_s: float = 30.0) -> RewardSet:
    configs = [RewardComponentConfig(name=name, weight=weight, kwargs=dict(kwargs)) for name, weight, kwargs in components]
    return RewardSet.from_config(configs, isolation=RewardIsolation(timeout_s=timeout_s, workers=workers))


def in_process(isolated: RewardSet) -> RewardSet:
    return RewardSet.from_config(isolated.configs)


def test_isolated_scores_equal_in_process_scores_whatever_the_worker_count():
    components = (("exact_answer", 1.0, {}), ("per_digit", 0.5, {}), (f"{USER}:contains_digit", 0.25, {}))
    expected = in_process(rewards(*components)).score(TEXTS, TRUTHS, REFS)
    assert 0 < sum(expected.total) < len(TEXTS) * 1.75  # the scores vary: the comparison means something
    for workers in (1, 3):
        scored = rewards(*components, workers=workers).score(TEXTS, TRUTHS, REFS)
        assert scored.columns == expected.columns and scored.total == expected.total  # bit for bit
        assert scored.failures == {TIMEOUTS: 0, CRASHES: 0, ZEROED: 0}


def test_a_reward_that_raises_still_fails_the_stage_with_its_message():
    bad = rewards(("numeric_answer", 1.0, {}))
    with pytest.raises(RewardFunctionError, match=r"reward 'numeric_answer' .* on sample sample-0"):
        bad.score(["#### 4"], ["n/a"], ["sample-0"])


def test_a_hang_and_a_crash_cost_their_sample_a_retry_then_a_zero():
    unruly = rewards(
        (f"{USER}:contains_digit", 1.0, {}),
        (f"{USER}:hangs_on", 1.0, {"truth": TRUTHS[1]}),
        (f"{USER}:segfaults_on", 1.0, {"truth": TRUTHS[2]}),
        workers=2,
        timeout_s=3.0,
    )
    scored = unruly.score(TEXTS, TRUTHS, REFS)
    assert scored.failures == {TIMEOUTS: 2, CRASHES: 2, ZEROED: 2}
    assert unruly.failures == scored.failures  # what the stage records in its metrics
    assert scored.total[1] == scored.total[2] == 0.0
    assert all(scored.columns[c][1] == scored.columns[c][2] == 0.0 for c in scored.columns)
    others = [n for n in range(len(TEXTS)) if n not in (1, 2)]
    assert [scored.total[n] for n in others] == [3.0] * len(others)  # contains_digit 1 + two well-behaved 1s


def test_a_reward_that_crashes_on_everything_fails_the_stage():
    assert failure_limit(len(TEXTS)) == 3
    with pytest.raises(
        RewardFunctionError, match=r"4 of 12 samples could not be scored .*rollout.reward_timeout_s"
    ):
        rewards((f"{USER}:exits_always", 1.0, {})).score(TEXTS, TRUTHS, REFS)


def test_each_sample_has_the_whole_timeout_however_long_the_request_runs():
    # 8 samples of 0.3 s under a 2 s bound: the request outlasts the bound, no sample does.
    slow = rewards((f"{USER}:sleeps", 1.0, {"seconds": 0.3}), timeout_s=2.0)
    scored = slow.score(TEXTS[:8], TRUTHS[:8], REFS[:8])
    assert scored.failures == {TIMEOUTS: 0, CRASHES: 0, ZEROED: 0}
    assert scored.total == [1.0] * 8


@pytest.mark.parametrize(("flush_s", "messages"), [(math.inf, 1), (0.0, len(TEXTS))])
def test_a_worker_sends_the_values_of_the_samples_it_finished_in_one_message_per_flush(flush_s, messages):
    components = (("exact_answer", 1.0, {}), (f"{USER}:contains_digit", 0.25, {}))
    reference = in_process(rewards(*components))
    ours, theirs = (Connection(end.detach()) for end in socket.socketpair())
    progress = SampleProgress.create()
    try:
        _score(theirs, reference, list(zip(TEXTS, TRUTHS, REFS, [None] * len(TEXTS))), progress, flush_s)
        answers = []
        while (answer := ours.recv())[0] != "done":
            answers.append(answer)
        assert progress.read()[0] == len(TEXTS) - 1  # the last sample started
    finally:
        for end in (ours, theirs, progress):
            end.close()
    assert [kind for kind, _, _ in answers] == ["values"] * messages
    assert [first for _, first, _ in answers] == [len(TEXTS) // messages * k for k in range(messages)]
    sent = [values for _, _, batch in answers for values in batch]
    assert sent == [reference.score_sample(*item) for item in zip(TEXTS, TRUTHS, REFS, [None] * len(TEXTS))]
