"""The rollout engines as Ray actors: two engines on two nodes of the pytest run's cluster
(tests/ray_cluster.py, raylets on 127.0.0.1), real vLLM, the policy fetched by each engine from the store.

Every wait waits for an event under a generous bound; none depends on how fast the machine is.
"""

from __future__ import annotations

import threading
import time

import pytest

from forge_core.artifacts.policy import fetch_policy
from forge_core.config import config_from_dict
from forge_core.faults import FAULT_ENV, FAULT_ONCE_ENV
from forge_core.rollout import prompts_from_table
from forge_core.rollout.actor_engines import EngineActors
from tests.ray_cluster import POOL
from tests.rollout.conftest import SAMPLING, run_config_dict

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]

BOUND_S = 600.0


def pool_config(world, tmp_path):
    raw = run_config_dict(world.store_root, num_engines=2)
    raw["logging"] = {"dir": str(tmp_path / "runs")}
    raw["launch"] = {"pool_wait_s": BOUND_S, "rollout": {"pool": POOL, "nnodes": 2}}
    return config_from_dict(raw)


def wait_for(what: str, condition):
    deadline = time.monotonic() + BOUND_S
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.2)
    raise AssertionError(f"never saw {what} within {BOUND_S:g} s")


def tokens(samples) -> list[tuple[int, ...]]:
    return [tuple(sample.response_ids) for sample in samples]


def test_an_engine_s_node_lost_mid_rollout_its_prompts_go_to_the_other_and_the_next_serve_heals(
    world, ray_cluster, tmp_path, monkeypatch
):
    """Engine 1 hangs in its first request (hang_engine:1); its Ray node is then removed outright. The router
    gives engine 1's prompts to engine 0 and the generation completes; at the next `serve` Ray has restarted
    engine 1 on a live node of the pool; the healed pair samples exactly what the survivor produced."""
    import ray

    marker = tmp_path / "fault-once"
    monkeypatch.setenv(FAULT_ENV, "hang_engine:1")
    monkeypatch.setenv(FAULT_ONCE_ENV, str(marker))
    cfg = pool_config(world, tmp_path)
    policy = fetch_policy(world.store, world.stage_uri, cache_root=tmp_path / "cache")
    prompts = prompts_from_table(world.store.reader(world.data_uri).read_table("rl_prompts.parquet"))[:6]
    pool_ids = {node.node_id for node in ray_cluster.compute.pool_nodes(POOL)}

    engines = EngineActors.start(ray_cluster.compute, cfg, seed=0)
    try:
        router = engines.serve(policy)
        placement = engines.placement()
        nodes = [node["node_id"] for node in placement["nodes"]]
        assert placement["pool"] == POOL and len(set(nodes)) == 2 and set(nodes) <= pool_ids, placement
        assert router.policy_version == policy.version

        removed: list[str] = []

        def remove_engine_1_node() -> None:
            wait_for("engine 1 taking its request", marker.exists)
            ray_cluster.raylets.remove_node(ray_cluster.node_with_id(nodes[1]), allow_graceful=False)
            removed.append(nodes[1])

        remover = threading.Thread(target=remove_engine_1_node, daemon=True)
        remover.start()
        survived = router.generate(prompts, SAMPLING, seed=5)
        remover.join(BOUND_S)
        ray_cluster.add_pool_node()  # the pool's size for the tests after this one
        assert removed == [nodes[1]], "engine 1's node was never removed"
        assert len(survived) == len(prompts) * SAMPLING.group_size
        assert [s.prompt_id for s in survived] == [p.prompt_id for p in prompts for _ in range(SAMPLING.group_size)]
        assert len(router.dead) == 1 and "engine 1" in router.dead[0], router.dead

        healed = engines.serve(policy)
        healed_nodes = [node["node_id"] for node in engines.placement()["nodes"]]
        assert len(healed.live) == 2 and removed[0] not in healed_nodes and len(set(healed_nodes)) == 2
        assert tokens(healed.generate(prompts, SAMPLING, seed=5)) == tokens(survived)
    finally:
        engines.close()
    wait_for("the engines' placement group removed", lambda: all(
        t["state"] == "REMOVED" for t in ray.util.placement_group_table().values()
    ))
    assert wait_for("no engine actor left", lambda: not ray_cluster.live_actors() or None) is True


def test_a_pool_config_that_cannot_spread_its_engines_evenly_is_refused(world, tmp_path):
    raw = run_config_dict(world.store_root, num_engines=3)
    raw["launch"] = {"rollout": {"pool": POOL, "nnodes": 2, "gpus_per_node": 3}}
    with pytest.raises(ValueError, match=r"launch.rollout.nnodes=2: .* must divide rollout.num_engines=3"):
        config_from_dict(raw)
    raw["rollout"]["num_engines"] = 2
    with pytest.raises(ValueError, match=r"launch.rollout.gpus_per_node=3: each node runs 1 engine\(s\)"):
        config_from_dict(raw)
