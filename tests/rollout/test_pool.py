"""Data-parallel generation: two vLLM engines in their own processes give the same samples as one.

Slow (two more engine start-ups): runs with FORGE_SLOW=1.
"""

from __future__ import annotations

import os

import pytest

from forge_core.rollout import EngineOptions, GeneratorPool, prompts_from_table
from tests.rollout.conftest import GROUP_SIZE, SAMPLING

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(
        not os.environ.get("FORGE_SLOW"), reason="starts two more vLLM engines; set FORGE_SLOW=1"
    ),
    pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two CPU engines need two cores"),
]


def test_two_engines_give_the_same_samples_as_one(world, generator):
    table = world.store.reader(world.data_uri).read_table("rl_prompts.parquet")
    prompts = prompts_from_table(table.slice(0, 7))
    reference = generator.generate(prompts, seed=4)
    with GeneratorPool(world.policy_dir, SAMPLING, EngineOptions(kv_cache_gib=1, max_num_seqs=64), 2) as pool:
        assert pool.startup_s > 0
        samples = pool.generate(prompts, seed=4)
        assert [(s.prompt_id, s.sample_index, s.response_ids) for s in samples] == [
            (s.prompt_id, s.sample_index, s.response_ids) for s in reference
        ]
        assert len(samples) == 7 * GROUP_SIZE
        # A user error inside a replica comes back as the ValueError it is.
        too_long = prompts_from_table(table.slice(0, 1))[0]
        too_long = type(too_long)(too_long.prompt_id, tuple([5] * 200), too_long.ground_truth, 0)
        with pytest.raises(ValueError, match="exceeds the policy's context"):
            pool.generate([too_long], seed=0)
        assert pool.reload() >= 0
