"""Several flow engines (`engine_lifetime: flow`, `num_engines: 2`): EngineService.ensure_engines + EngineRouter
(forge_core.rollout.router) over the services' connections.

Real services (`python -m forge_core.rollout.service`, an in-process vLLM engine each, one core each) on the
tiny policy of conftest.py. The test walks one flow's life: a version mismatch on one engine, an engine
SIGKILLed during a generate call (its prompts re-routed, the samples unchanged), the next ensure restarting it,
the flow's stop leaving no engine process, and a router without engines failing retryably. Two engine
start-ups, then one restart.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import time

import psutil
import pytest

from forge_core.artifacts.policy import fetch_policy
from forge_core.config import config_from_dict
from forge_core.launch import registry
from forge_core.launch.errors import RetryableStageError
from forge_core.launch.process_tree import is_alive, processes_with_launch_id
from forge_core.rollout import prompts_from_table
from forge_core.rollout.lifetime import engine_state_dir, stage_generator, stop_flow_engines
from forge_core.rollout.protocol import EngineLost
from forge_core.rollout.service import (
    EngineService,
    PolicyVersionMismatch,
    ServicePaths,
    healthy_client,
    read_record,
)
from tests.rollout.conftest import SAMPLING, run_config_dict

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two engines need a core each")

# Long enough a call (20 prompts x 8 samples x 48 tokens per engine) that the kill lands inside it.
LONG_SAMPLING = dataclasses.replace(SAMPLING, group_size=8, max_new_tokens=48)
SEED = 5


@pytest.fixture(scope="module")
def flow_cfg(world, tmp_path_factory, registry_dir):
    state_dir = tmp_path_factory.mktemp("engines")
    cfg = config_from_dict(
        run_config_dict(
            world.store_root, engine_lifetime="flow", engine_state_dir=str(state_dir), num_engines=2
        )
    )
    yield cfg
    stop_flow_engines(cfg)


def alive_engine_processes(infos: list[dict]) -> list[int]:
    """Pids still running of these services (their own pid or their launch id)."""
    found = {p.pid for info in infos for p in processes_with_launch_id(info["launch_id"]) if is_alive(p)}
    for info in infos:
        with_pid = psutil.Process(info["pid"]) if psutil.pid_exists(info["pid"]) else None
        if with_pid is not None and is_alive(with_pid):
            found.add(info["pid"])
    return sorted(found)


def wait_until_busy(state_dir, name: str, timeout_s: float = 120.0) -> None:
    """Return once service `name` is running a generate request (its ping says so)."""
    watcher = healthy_client(ServicePaths(state_dir, name))
    assert watcher is not None
    deadline = time.monotonic() + timeout_s
    try:
        while watcher.ping()["busy"] != "generate":
            assert time.monotonic() < deadline, f"{name} never started generating"
            time.sleep(0.01)
    finally:
        watcher.close()


def comparable(samples) -> list[tuple]:
    return [(s.prompt_id, s.sample_index, s.response_ids, s.finish_reason) for s in samples]


@pytest.mark.integration
def test_two_flow_engines_reroute_a_killed_engines_prompts_and_stop_with_the_flow(
    world, flow_cfg, tmp_path, caplog
):
    rollout = flow_cfg.rollout
    state_dir = engine_state_dir(flow_cfg)  # this run's folder inside rollout.engine_state_dir
    policy = fetch_policy(world.store, world.stage_uri, cache_root=tmp_path / "cache")
    prompts = prompts_from_table(world.store.reader(world.data_uri).read_table("rl_prompts.parquet"))
    assert len(prompts) == 40

    router = EngineService.ensure_engines(state_dir, rollout, policy.local_dir, policy.version)
    assert router.names == ["engine-0", "engine-1"] and router.policy_version == policy.version
    infos = [client.ping() for client in router.live]
    pids = [info["pid"] for info in infos]
    # Each engine on its own core, as pool.replica_layouts splits them.
    shares = [info["layout"]["cpus"] for info in infos]
    assert len(shares[0]) >= 1 and not set(shares[0]) & set(shares[1])
    assert [sorted(psutil.Process(pid).cpu_affinity()) for pid in pids] == shares

    # Every engine checks the version: engine-1 serving another one fails the whole call.
    other = healthy_client(ServicePaths(state_dir, "engine-1"))
    other.reload(policy.local_dir, "another-version")
    other.close()
    with pytest.raises(PolicyVersionMismatch, match=r"serves policy version another-versio"):
        router.generate(prompts[:4], LONG_SAMPLING, SEED)
    router.close()

    router = EngineService.ensure_engines(state_dir, rollout, policy.local_dir, policy.version)
    assert [c.pid for c in router.live] == pids and router.startup_s == 0.0  # reloaded, not restarted
    uninterrupted = router.generate(prompts, LONG_SAMPLING, SEED)
    assert len(uninterrupted) == len(prompts) * LONG_SAMPLING.group_size

    # SIGKILL engine-1 while it generates its half: engine-0 takes over its prompts, the samples stay.
    outcome: dict = {}

    def generate() -> None:
        try:
            outcome["samples"] = router.generate(prompts, LONG_SAMPLING, SEED)
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            outcome["error"] = exc

    with caplog.at_level(logging.WARNING, logger="forge_core.rollout.router"):
        caller = threading.Thread(target=generate)
        caller.start()
        wait_until_busy(state_dir, "engine-1")
        os.kill(pids[1], signal.SIGKILL)
        caller.join(timeout=600)
    assert "error" not in outcome, outcome.get("error")
    assert router.dead == ["engine-1"] and router.names == ["engine-0"]
    assert any("engine engine-1" in r.message and "re-routing" in r.message for r in caplog.records)
    assert comparable(outcome["samples"]) == comparable(uninterrupted)
    for rerouted, original in zip(outcome["samples"], uninterrupted):
        assert rerouted.response_logprobs == pytest.approx(original.response_logprobs, abs=1e-4)
    router.close()

    # The next stage's ensure restarts the dead engine only; the stage code path samples the same.
    router = EngineService.ensure_engines(state_dir, rollout, policy.local_dir, policy.version)
    restarted = [c.pid for c in router.live]
    assert restarted[0] == pids[0] and restarted[1] != pids[1] and router.startup_s > 0.0
    with stage_generator(flow_cfg, policy, seed=0) as generator:
        again = generator.generate(prompts[:6], LONG_SAMPLING, seed=SEED)
    assert comparable(again) == comparable(uninterrupted[: 6 * LONG_SAMPLING.group_size])

    # The flow's stop ends both engines: no pid survives, no record or registry entry is left.
    infos = [client.ping() for client in router.live]
    assert sorted(stop_flow_engines(flow_cfg)) == sorted(restarted)
    assert alive_engine_processes(infos) == []
    assert all(read_record(ServicePaths(state_dir, name)) is None for name in ("engine-0", "engine-1"))
    assert all(registry.launch_owner(info["launch_id"]) is None for info in infos)

    # With no engine left a call fails retryably (the stage's retry restarts them).
    with pytest.raises(EngineLost, match="no engine is left") as failure:
        router.generate(prompts[:4], LONG_SAMPLING, SEED)
    assert isinstance(failure.value, RetryableStageError)
    assert router.dead == ["engine-0", "engine-1"]
    assert "lost: engine-0: " in str(failure.value) and "; engine-1: " in str(failure.value)  # each one's cause
