"""Stages on a pool of the Ray cluster (launch.<stage>.pool): the test run's cluster_utils cluster (tests/ray_cluster.py,
several raylets on 127.0.0.1, pool gpu-a), the flow in this process joined to it, real torchrun and vLLM.

Every wait waits for an event under a generous bound; none depends on how fast the machine is.
"""

from __future__ import annotations

import glob
import json
import os
import threading
import time
from pathlib import Path

import pytest
from prefect import flow

from flows.post_train import flow_resources, post_train, start_flow
from forge_core.config import load_config
from forge_core.faults import FAULT_ENV, FAULT_ONCE_ENV
from forge_core.launch import terminate_all_live
from forge_core.rollout.weight_buckets import bucket_folder
from forge_core.storage import ObjectStore
from tasks import run_as_task
from tests.ray_cluster import POOL

pytestmark = [pytest.mark.integration, pytest.mark.timeout(2400)]

CONFIG = "configs/tiny_test.yaml"
BOUND_S = 600.0  # an upper safety bound on any event of a pipeline run (a loaded 2-core machine is slow)
ON_POOL = [
    "launch.pool_wait_s=600",
    *(f"launch.{stage}.pool={POOL}" for stage in ("prepare", "sft", "rollout", "grpo", "evaluate")),
]
TWO_NODE_SFT = ["launch.sft.nnodes=2", "launch.sft.nproc_per_node=1"]
TWO_ENGINES_ON_TWO_NODES = ["rollout.num_engines=2", "launch.rollout.nnodes=2"]
TWO_NODE_TRAINER = ["launch.grpo.nnodes=2", "launch.grpo.nproc_per_node=1", "grpo.iterations=2"]
FLOW_LIFETIMES = ["rollout.engine_lifetime=flow", "grpo.trainer_lifetime=flow"]
# Partial credit, so rewards vary inside a group and GRPO really takes optimizer steps on the tiny SFT policy.
VARIED_REWARDS = 'rollout.rewards=[{"name": "per_digit", "weight": 1.0}, {"name": "answer_format", "weight": 0.5}]'


def store_of(overrides: list[str]) -> ObjectStore:
    return ObjectStore.from_config(load_config(CONFIG, overrides).storage)


def manifest_of(store: ObjectStore, uri: str):
    return store.read_manifest(uri)


@pytest.fixture(scope="module")
def pool_run(prefect_api, ray_cluster, tmp_path_factory) -> tuple[dict, list[str]]:
    root = tmp_path_factory.mktemp("ray-pool")
    overrides = [f"storage.root=file://{root}/store", f"logging.dir={root}/runs",
                 *ON_POOL, *TWO_NODE_SFT, *TWO_ENGINES_ON_TWO_NODES, *TWO_NODE_TRAINER, *FLOW_LIFETIMES, VARIED_REWARDS]
    return post_train(CONFIG, overrides), overrides


def test_the_pipeline_runs_on_the_pool_and_its_manifests_name_the_ray_nodes(pool_run, ray_cluster):
    summary, overrides = pool_run
    store = store_of(overrides)
    pool_ids = {node.node_id for node in ray_cluster.compute.pool_nodes(POOL)}
    by_kind = {}
    for row in summary["stages"]:
        by_kind.setdefault(store.read_manifest(row["artifact"]).kind, []).append(store.read_manifest(row["artifact"]))
    (sft,) = by_kind["sft"]
    placement = sft.placement
    assert placement["placement"] == "ray" and placement["pool"] == POOL, placement
    assert [n["node_rank"] for n in placement["nodes"]] == [0, 1], placement
    assert len({n["node_id"] for n in placement["nodes"]}) == 2, "both SFT nodes on one Ray node"
    assert {n["node_id"] for n in placement["nodes"]} <= pool_ids
    # torchrun's c10d rendezvous gives out global ranks in join order: rank 0, which commits, is on either node.
    assert placement["committed_by"] in placement["nodes"], placement
    (data,) = by_kind["data"]
    assert data.placement["pool"] == POOL and len(data.placement["nodes"]) == 1
    # GRPO: every iteration trained by the run's one trainer group, a rank actor on each of two nodes.
    trainer_nodes = set()
    for manifest in by_kind["grpo"]:
        placement = manifest.placement
        assert placement["served_by"] == "trainer" and placement["pool"] == POOL, placement
        assert placement["ranks"] == [{"rank": 0, "node_rank": 0}, {"rank": 1, "node_rank": 1}], placement
        assert manifest.metrics["world_size"] == 2 and manifest.metrics["train/steps"] > 0, manifest.metrics
        trainer_nodes.add(tuple(n["node_id"] for n in placement["nodes"]))
    (trainer,) = trainer_nodes
    assert len(by_kind["grpo"]) >= 2 and len(set(trainer)) == 2 and set(trainer) <= pool_ids, trainer
    # Rollouts and evals: sampled by the run's two engine actors, one on each of two nodes of the pool.
    engine_sets = set()
    for manifest in by_kind["rollouts"] + by_kind["eval"]:
        placement = manifest.placement
        assert placement["served_by"] == "engines" and placement["pool"] == POOL, placement
        engine_sets.add(tuple((n["node_rank"], n["node_id"]) for n in placement["nodes"]))
    (engines,) = engine_sets  # the flow's engines served every rollout and evaluation
    assert [rank for rank, _ in engines] == [0, 1] and len({node for _, node in engines}) == 2, engines
    assert {node for _, node in engines} <= pool_ids
    rows = summary["placement"]
    assert {row["pool"] for row in rows} == {POOL}
    assert sum("(trainer group)" in row["ray node"] for row in rows) == 2 * len(by_kind["grpo"])
    assert any("(engine 1)" in row["ray node"] for row in rows)


def test_after_the_flow_nothing_of_it_is_left_on_the_cluster(pool_run, ray_cluster):
    import ray

    assert all(t["state"] == "REMOVED" for t in ray.util.placement_group_table().values())
    assert ray_cluster.live_actors() == []
    deadline = time.monotonic() + BOUND_S
    while ray_cluster.stage_processes() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ray_cluster.stage_processes() == []


@flow(name="ray-prepare-and-sft")
def prepare_and_sft(config: str, overrides: list[str]) -> str:
    cfg = start_flow(config, overrides)
    with flow_resources(cfg):
        return run_as_task(cfg, "sft", {"data": run_as_task(cfg, "prepare", {})})


def sft_overrides(root: Path, *extra: str) -> list[str]:
    return [f"storage.root=file://{root}/store", f"logging.dir={root}/runs", *ON_POOL, *TWO_NODE_SFT, *extra]


def wait_for(what: str, condition, bound_s: float = BOUND_S):
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"never saw {what} within {bound_s:g} s")


def placed_nodes(group: str):
    """A callable: the Ray node of each bundle of placement group `forgeflow-<group>` while it is placed."""
    import ray

    def nodes() -> list[str] | None:
        for table in ray.util.placement_group_table().values():
            if table["name"] == f"forgeflow-{group}" and table["state"] == "CREATED":
                return [table["bundles_to_node_id"][k] for k in sorted(table["bundles_to_node_id"])]
        return None

    return nodes


def remove_node_1_once_hung(ray_cluster, marker: Path, group: str) -> tuple[threading.Thread, list[str]]:
    """A started thread that, once the hang fault has fired (its marker exists), removes the Ray node of bundle 1
    of the placement group `forgeflow-<group>` outright; the list gets the removed node's id."""
    removed: list[str] = []

    def remove() -> None:
        wait_for("the hang fault", marker.exists)
        node_1 = wait_for(f"the {group} placement group", placed_nodes(group))[1]
        ray_cluster.raylets.remove_node(ray_cluster.node_with_id(node_1), allow_graceful=False)
        removed.append(node_1)

    remover = threading.Thread(target=remove, daemon=True)
    remover.start()
    return remover, removed


def step_losses(run_dir: Path) -> dict[int, float]:
    """Each SFT step's training loss, from the run's metrics.jsonl (written by rank 0, wherever it ran)."""
    lines = (run_dir / "tiny-test-sft" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line]
    return {int(r["step"]): float(r["loss"]) for r in records if "loss" in r}


def test_two_nodes_of_one_rank_train_sft_like_one_node_of_two_ranks(pool_run, tmp_path):
    """The same SFT (world size 2) as 2 Ray nodes x 1 rank (the pool run) and as 1 node x 2 ranks (any node of
    the cluster): every step's loss within 1e-6."""
    _, pool_overrides = pool_run
    local = [f"storage.root=file://{tmp_path}/store", f"logging.dir={tmp_path}/runs", "launch.sft.nproc_per_node=2"]
    manifest = store_of(local).read_manifest(prepare_and_sft(CONFIG, local))
    assert manifest.placement["pool"] == "" and len(manifest.placement["nodes"]) == 1, manifest.placement
    pool_runs = Path(next(o for o in pool_overrides if o.startswith("logging.dir=")).split("=", 1)[1])
    on_pool, here = step_losses(pool_runs), step_losses(tmp_path / "runs")
    assert sorted(on_pool) == sorted(here) == list(range(1, manifest.metrics["steps"] + 1))
    assert all(abs(on_pool[step] - here[step]) <= 1e-6 for step in here), (on_pool, here)


def test_cancelling_the_flow_ends_every_rank_actor_and_group(ray_cluster, prefect_api, tmp_path, monkeypatch):
    """What the flow's cancel or crash hook and a SIGTERM do first (forge_core.launch.terminate_all_live) while
    SFT runs on two nodes: the gang is stopped, its ranks end, its actors and placement group are gone, and the
    stage fails as cancelled, without a retry."""
    import ray

    marker = tmp_path / "fault-once"
    monkeypatch.setenv(FAULT_ENV, "hang_rank:1:1@sft")
    monkeypatch.setenv(FAULT_ONCE_ENV, str(marker))
    overrides = sft_overrides(tmp_path, "launch.sft.retries=1", "name=aborted")

    def abort_when_hung() -> None:
        wait_for("the hang at SFT step 1", marker.exists)
        terminate_all_live(reason="cancelled by the test")

    aborter = threading.Thread(target=abort_when_hung, daemon=True)
    aborter.start()
    with pytest.raises(Exception, match="cancelled"):
        prepare_and_sft(CONFIG, overrides)
    aborter.join(BOUND_S)
    assert wait_for("no stage process left", lambda: not ray_cluster.stage_processes())
    assert all(t["state"] == "REMOVED" for t in ray.util.placement_group_table().values())
    assert ray_cluster.live_actors() == []



def test_a_trainer_rank_node_lost_mid_grpo_is_retried_by_a_new_group_that_resumes(
    ray_cluster, prefect_api, tmp_path, monkeypatch
):
    """Trainer rank 1 (node 1 of the run's trainer group) hangs after GRPO step 2; its Ray node is then removed
    outright. The order fails retryably, the whole group is ended, and the task's retry places a new group on
    the nodes that are left, which resumes from the step-1 checkpoint; the run completes and nothing of it is
    left on the cluster."""
    import ray

    marker = tmp_path / "fault-once"
    monkeypatch.setenv(FAULT_ENV, "hang_rank:1:2@grpo")
    monkeypatch.setenv(FAULT_ONCE_ENV, str(marker))
    remover, removed = remove_node_1_once_hung(ray_cluster, marker, "grpo-trainer")
    overrides = [f"storage.root=file://{tmp_path}/store", f"logging.dir={tmp_path}/runs", *ON_POOL,
                 *TWO_ENGINES_ON_TWO_NODES, *TWO_NODE_TRAINER, *FLOW_LIFETIMES, VARIED_REWARDS, "grpo.iterations=1",
                 "launch.grpo.retries=1", "name=trainer-node-lost"]
    try:
        summary = post_train(CONFIG, overrides)
    finally:
        remover.join(BOUND_S)
        ray_cluster.add_pool_node()  # the pool's size for the tests after this one
    assert removed, "the node was never removed"

    store = store_of(overrides)
    (grpo,) = [m for m in (store.read_manifest(r["artifact"]) for r in summary["stages"]) if m.kind == "grpo"]
    assert grpo.metrics["resumed_from_step"] == 1, grpo.metrics
    nodes = [n["node_id"] for n in grpo.placement["nodes"]]
    assert grpo.placement["served_by"] == "trainer" and len(set(nodes)) == 2 and removed[0] not in nodes, nodes
    assert all(t["state"] == "REMOVED" for t in ray.util.placement_group_table().values())
    assert ray_cluster.live_actors() == []
    assert wait_for("no stage process left", lambda: not ray_cluster.stage_processes())
    # A weight push the failure cut short (to an engine on the removed node) left no bucket files behind.
    assert not glob.glob(os.path.join(bucket_folder(), "forgeflow-weights-*"))
