"""The one generation protocol (forge_core.rollout.protocol), satisfied by every implementation: the in-process
Generator and two engine actors on the test run's Ray cluster behind the router (forge_core.rollout.actor_engines).

Real vLLM engines (in-process engine cores) on the tiny policy of conftest.py. The same calls go to each: the
same samples come back in the same order, the facts (version, start-up, reload) say the same things, a bad
prompt is the same ValueError, a reload to other weights and back changes the samples and restores them, and
(the router) a SIGKILLed engine's prompts go to the other one. Three engine start-ups.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal

import pytest

from forge_core.config import config_from_dict, replace
from forge_core.rollout import EngineOptions, Generator, Prompt, prompts_from_table
from forge_core.rollout.actor_engines import EngineActors
from forge_core.rollout.protocol import EngineConnection, GenerationEngine
from forge_core.rollout.router import EngineRouter
from tests.rollout.conftest import GROUP_SIZE, SAMPLING, run_config_dict

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two engines need a core each"),
]

ENGINE = EngineOptions(kv_cache_gib=1, max_num_seqs=64, in_process=True)
SEED = 4
GREEDY = replace(SAMPLING, group_size=1, temperature=0.0)
# The in-process Generator; EngineRouter over two engine actors.
KINDS = ("generator", "actors")


@pytest.fixture(scope="module")
def prompts(world) -> list[Prompt]:
    table = world.store.reader(world.data_uri).read_table("rl_prompts.parquet")
    return prompts_from_table(table.slice(0, 7))  # odd: two engines get 4 and 3


@pytest.fixture(scope="module")
def reference(policies, prompts):
    """The in-process Generator, up for the whole module, and what it samples from A and B."""
    policy_a, policy_b = policies
    with Generator(policy_a.local_dir, ENGINE, policy_version=policy_a.version) as generator:
        sampled_a = generator.generate(prompts, SAMPLING, SEED)
        generator.reload(policy_b.local_dir, policy_b.version)
        greedy_b = generator.generate(prompts, GREEDY, SEED)
        generator.reload(policy_a.local_dir, policy_a.version)
        yield generator, sampled_a, greedy_b


@pytest.fixture
def engine(request, reference, policies, world, ray_cluster):
    """Each implementation, serving A; the engine actors are ended after the test."""
    policy_a, _ = policies
    if request.param == KINDS[0]:
        yield reference[0]
        return
    cfg = config_from_dict(run_config_dict(world.store_root, num_engines=2))
    engines = EngineActors.start(ray_cluster.compute, cfg, SEED)
    try:
        yield engines.serve(policy_a)
    finally:
        engines.close()
    assert ray_cluster.live_actors() == [], "closing the engines ends their actors"


def comparable(samples) -> list[tuple]:
    return [(s.prompt_id, s.group_id, s.sample_index, s.response_ids, s.finish_reason) for s in samples]


@pytest.mark.parametrize("engine", KINDS, indirect=True)
def test_every_generator_keeps_the_protocol_and_samples_the_same(
    engine, reference, policies, prompts, caplog
):
    _, sampled_a, greedy_b = reference
    policy_a, policy_b = policies
    assert isinstance(engine, GenerationEngine)
    engine_names = engine.names if isinstance(engine, EngineRouter) else []
    if isinstance(engine, EngineRouter):
        assert len(engine.live) == 2 and all(isinstance(c, EngineConnection) for c in engine.live)
        assert len({c.pid for c in engine.live} | {os.getpid()}) == 3  # two processes of their own

    # The facts: the version it serves, a start-up it paid; reloading that version is free.
    assert engine.policy_version == policy_a.version and engine.startup_s > 0.0
    assert engine.reload(policy_a.local_dir, policy_a.version) == 0.0 and engine.reload_s == 0.0

    # The same call gives the same samples, in prompt order, whoever serves them: bit for bit, logprobs
    # included (measured here; each prompt carries its own seed and the engines run the same fp32 kernels).
    samples = engine.generate(prompts, SAMPLING, SEED)
    assert len(samples) == len(prompts) * GROUP_SIZE
    assert comparable(samples) == comparable(sampled_a)
    assert samples == sampled_a

    # A user error is the same ValueError (a bad prompt), and the engine goes on serving.
    too_long = dataclasses.replace(prompts[0], prompt_ids=tuple([5] * 200))
    with pytest.raises(ValueError, match="exceeds the policy's context"):
        engine.generate([too_long], SAMPLING, SEED)

    # Other weights change the samples; reloading A restores them.
    assert engine.reload(policy_b.local_dir, policy_b.version) > 0.0
    assert engine.policy_version == policy_b.version and engine.reload_s > 0.0
    assert comparable(engine.generate(prompts, GREEDY, SEED)) == comparable(greedy_b)
    engine.reload(policy_a.local_dir, policy_a.version)
    assert comparable(engine.generate(prompts, SAMPLING, SEED)) == comparable(sampled_a)

    if isinstance(engine, EngineRouter):
        # An engine SIGKILLed before a call is dropped, the other one serves every prompt, and the samples
        # stay the same.
        lost = engine.live[1]
        os.kill(lost.pid, signal.SIGKILL)
        with caplog.at_level(logging.WARNING, logger="forge_core.rollout.router"):
            assert engine.generate(prompts, SAMPLING, SEED) == sampled_a
        assert engine.dead == [lost.name] and engine.names == [engine_names[0]]
        assert any(f"engine {lost.name}" in r.message and "re-routing its 3 unfinished" in r.message
                   for r in caplog.records)  # fmt: skip
