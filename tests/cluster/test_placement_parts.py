"""The parts of stage placement that need no cluster: the node order, the rendezvous a node's torchrun gets,
results through the store, the runner choice, heartbeats judged on the watcher's clock, the config rules."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from forge_core.config import load_config
from forge_core.launch import LaunchResult, Outcome, RankError
from forge_core.launch.spec import LaunchSpec, NodeRendezvous, build_command
from forge_core.run import placement
from forge_core.run.placement import Board, Liveness, NodeOrder, PoolRunner
from forge_core.run.runners import runner_for
from tests.cluster.cluster import REPO_ROOT

TINY = str(REPO_ROOT / "configs" / "tiny_test.yaml")


def test_node_order_round_trips_as_plain_json_and_rejects_unknown_keys():
    order = NodeOrder("sft", "s3://b/spec.json", "att", "placed-1", 0, 1, ("gpu-a-0", "gpu-a-1"))
    params = order.to_params()
    assert params["workers"] == ["gpu-a-0", "gpu-a-1"]
    assert NodeOrder.from_params(params) == order and order.nnodes == 2
    with pytest.raises(ValueError, match=r"unknown keys \['secret'\]"):
        NodeOrder.from_params({**params, "secret": "x"})


def test_node_rendezvous_reaches_torchrun_with_the_host_stated():
    node = NodeRendezvous(nnodes=2, node_rank=1, endpoint="10.0.0.7:29400", run_id="placed-1", local_addr="10.0.0.8")
    spec = LaunchSpec(module="forge_core.run", nproc_per_node=1, **node.launch_fields())
    assert spec.check() == []
    command = build_command(spec, "/tmp/logs")
    for flag, value in (("--rdzv-endpoint", "10.0.0.7:29400"), ("--rdzv-id", "placed-1"),
                        ("--rdzv-conf", "is_host=0"), ("--local-addr", "10.0.0.8"), ("--node-rank", "1")):
        assert command[command.index(flag) + 1] == value, (flag, command)
    with pytest.raises(ValueError, match=r"local_addr='10.0.0.8': only for a c10d rendezvous"):
        LaunchSpec(module="forge_core.run", local_addr="10.0.0.8")


def test_launch_result_round_trips_through_json(file_store):
    result = LaunchResult(Outcome.RETRYABLE, -9, "rank 1 killed", tail=("a", "b"),
                          rank_errors={1: RankError(rank=1, category="signal", summary="SIGKILL", exitcode=-9)}, launch_id="x")
    board = Board(file_store, file_store.join(file_store.root, "out"), "att")
    board.write(board.node_result(0, 1), result.to_dict())
    assert LaunchResult.from_dict(board.read(board.node_result(0, 1))) == result
    assert board.read(board.node_result(0, 0)) is None


def test_a_heartbeat_is_lost_only_after_it_stopped_changing(file_store, monkeypatch):
    board = Board(file_store, file_store.join(file_store.root, "out"), "att")
    clock = [100.0]
    monkeypatch.setattr(placement, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    beat = Liveness(board, board.owner, timeout_s=30, appear_within_s=30)
    assert beat.poll() is None and beat.lost() is None
    clock[0] += 31
    assert "no heartbeat within" in beat.lost()
    board.write(board.owner, {"beat": 1})
    beat.poll()
    assert beat.lost() is None
    clock[0] += 29
    board.write(board.owner, {"beat": 2})
    beat.poll()
    clock[0] += 29
    assert beat.lost() is None  # it changed 29 s ago
    clock[0] += 2
    assert "launch.node_timeout_s=30" in beat.lost()


def test_runner_for_places_on_pools_only_with_placement_pool(tmp_path):
    local = load_config(TINY, [f"storage.root=file://{tmp_path}/store"])
    assert not isinstance(runner_for(local, "sft"), PoolRunner)
    placed = load_config(TINY, [f"storage.root=file://{tmp_path}/store", "launch.placement=pool"])
    with pytest.raises(ValueError, match="needs a node dispatcher"):
        runner_for(placed, "sft")


def test_config_rules_of_pool_placement(tmp_path):
    base = [f"storage.root=file://{tmp_path}/store"]
    with pytest.raises(ValueError, match=r"sft.nnodes=2: multi-node needs rdzv_endpoint.*launch.placement=pool"):
        load_config(TINY, [*base, "launch.sft.nnodes=2"])
    with pytest.raises(ValueError, match=r"rdzv_endpoint='h:1'.*remove it"):
        load_config(TINY, [*base, "launch.placement=pool", "launch.sft.rdzv_endpoint=h:1"])
    with pytest.raises(ValueError, match=r"node_timeout_s=0.*> 0 seconds"):
        load_config(TINY, [*base, "launch.placement=pool", "launch.node_timeout_s=0"])
    assert load_config(TINY, [*base, "launch.placement=pool", "launch.sft.nnodes=2"]).launch.sft.nnodes == 2
