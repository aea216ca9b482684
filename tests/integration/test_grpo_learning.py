"""GRPO learns: on the demo task, starting from an SFT policy, GRPO iterations raise the held-out reward.

The real stages' code runs in one process: prepare, the SFT stage, vLLM rollouts with one in-process engine
kept up and reloaded in place after every update, GRPOTrainer with one AdamW across iterations, and vLLM
greedy evaluation on 300 held-out prompts with the training rewards (0.5 exact answer + 0.5 per digit).

Marked `slow` (not in `make test`; run with `pytest -m slow tests/integration/test_grpo_learning.py`): from
the SFT policies that the current demo defaults produce (2-digit addition, 2000 examples, 200 steps: 7-9%
held-out accuracy) the gain per iteration is small, so a margin clear of the noise needs 100 iterations, and
the whole test takes longer than the 3-minute budget of the default suite on a shared 2-core machine.
MEASURED holds the numbers behind MIN_REWARD_GAIN (same config, per seed, see the module's report).
"""

from __future__ import annotations

import pytest
import torch
from grpo_learning_loop import grpo_from_sft, learning_config, prepare_and_sft

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SEED = 1
NUM_DIGITS, SFT_EXAMPLES, SFT_STEPS = 2, 2000, 200
ITERATIONS, LR = 100, 2e-4
# Held-out greedy (accuracy, mean reward) after SFT -> after 50 -> after 100 GRPO iterations, measured here
# (2 cores, one thread; the runs are deterministic: a rerun gave the same numbers).
MEASURED = {
    0: {"accuracy": (0.073, 0.067, 0.080), "reward": (0.342, 0.352, 0.363)},  # reward gain +0.021
    1: {"accuracy": (0.090, 0.113, 0.133), "reward": (0.339, 0.351, 0.374)},  # reward gain +0.035
}
# Half the smallest measured gain: exact-match accuracy alone moved too little on seed 0 to assert on.
MIN_REWARD_GAIN = 0.01


def test_grpo_raises_held_out_reward(tmp_path, monkeypatch):
    # One intra-op thread for trainer and in-process vLLM: on a shared 2-core box two spinning OpenMP
    # threads per process make these tiny steps several times slower.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = learning_config(
            tmp_path, seed=SEED, sft_steps=SFT_STEPS, lr=LR, num_sft=SFT_EXAMPLES, num_digits=NUM_DIGITS
        )
        store, data_uri, sft_uri = prepare_and_sft(cfg)
        result = grpo_from_sft(cfg, store, data_uri, sft_uri, tmp_path / "grpo", iterations=ITERATIONS)
    finally:
        torch.set_num_threads(saved_threads)
    before, after = result["sft"], result["grpo"]
    print(f"held-out {before} -> {after}; timings {result['timings']}")
    assert after["reward"] - before["reward"] >= MIN_REWARD_GAIN, result
