"""The seeds that make rollouts reproducible, and the evaluation's sampling (SamplingConfig.build(seed) makes
vLLM's SamplingParams).

Every prompt gets its own seed (`request_seed`), so its samples do not depend on which other prompts share
the batch, how the scheduler orders them, or which engine serves it.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from forge_core.config import replace
from forge_core.config.schema import EvalConfig, SamplingConfig

_SEED_BITS = 63


def request_seed(seed: int, group_id: int, prompt_id: str) -> int:
    """A 63-bit seed for one prompt's group of samples, stable across processes and versions."""
    digest = hashlib.blake2b(f"{seed}\x00{group_id}\x00{prompt_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") & ((1 << _SEED_BITS) - 1)


def rollout_seed(cfg_seed: int, sampling: SamplingConfig) -> int:
    """The seed rollouts are drawn with: `rollout.sampling.seed` when set, else the run's seed."""
    return sampling.seed if sampling.seed is not None else cfg_seed


def evaluation_sampling(eval_cfg: EvalConfig, rollout_sampling: SamplingConfig) -> SamplingConfig:
    """Greedy single samples for `pass_k == 1`, else `pass_k` samples at the rollout temperature, top-p and
    top-k; stop strings always come from the rollout sampling, so answers end as in training."""
    if eval_cfg.pass_k == 1:
        return replace(
            rollout_sampling,
            group_size=1,
            temperature=0.0,
            top_p=1.0,
            top_k=-1,
            max_new_tokens=eval_cfg.max_new_tokens,
        )
    return replace(
        rollout_sampling, group_size=eval_cfg.pass_k, max_new_tokens=eval_cfg.max_new_tokens
    )


def sampling_record(sampling: SamplingConfig, seed: int) -> dict[str, Any]:
    """What a rollout row stores about how it was sampled (as JSON text in the `sampling_params` column)."""
    return {**sampling.model_dump(), "seed": seed, "logprobs_mode": "raw_logprobs"}


def sampling_json(sampling: SamplingConfig, seed: int) -> str:
    return json.dumps(sampling_record(sampling, seed), sort_keys=True)
