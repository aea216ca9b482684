"""The parts of stage placement that need no cluster: the node order, the rendezvous a node's torchrun gets,
results through the store, the runner choice, heartbeats judged on the watcher's clock, the config rules, and the
residents' channel (the run's secret, refusals, an order whose resident is gone)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from forge_core.config import load_config
from forge_core.launch import LaunchResult, Outcome, RankError
from forge_core.launch.spec import LaunchSpec, NodeRendezvous, build_command
from forge_core.run import placement, resident
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


# ---- flow lifetimes on pools: the runner choice, the secret, the resident's channel (forge_core.run.resident)

KEY = "k" * 64


def _flow_lifetimes_on_pools(tmp_path, run_id: str = "run-a"):
    overrides = [
        f"storage.root=file://{tmp_path}/store",
        "launch.placement=pool",
        "rollout.engine_lifetime=flow",
        "grpo.trainer_lifetime=flow",
        f"launch.run_id={run_id}",
    ]
    return load_config(TINY, overrides)


def test_flow_lifetimes_on_pools_are_orders_to_residents(tmp_path):
    cfg = _flow_lifetimes_on_pools(tmp_path)
    dispatcher = SimpleNamespace()
    for stage in ("rollout", "evaluate", "grpo"):
        runner = runner_for(cfg, stage, dispatcher)
        assert isinstance(runner, resident.ResidentRunner), (stage, runner)
        assert runner.where.endswith(f"on pool {cfg.launch.for_stage(stage).pool!r}"), runner.where
    assert isinstance(runner_for(cfg, "sft", dispatcher), PoolRunner)


def test_the_run_secret_needs_the_cluster_key_and_differs_per_run(tmp_path, monkeypatch):
    cfg_a, cfg_b = _flow_lifetimes_on_pools(tmp_path, "run-a"), _flow_lifetimes_on_pools(tmp_path, "run-b")
    monkeypatch.delenv(resident.CLUSTER_KEY_ENV, raising=False)
    with pytest.raises(ValueError, match=r"FORGE_CLUSTER_KEY, which is not set here; set the same random key"):
        resident.run_secret(cfg_a)
    monkeypatch.setenv(resident.CLUSTER_KEY_ENV, "short")
    assert "has 5 characters (at least 32 needed)" in resident.cluster_key_problems(cfg_a)[0]
    monkeypatch.setenv(resident.CLUSTER_KEY_ENV, KEY)
    assert resident.cluster_key_problems(cfg_a) == []
    assert resident.run_secret(cfg_a) != resident.run_secret(cfg_b)
    local = load_config(TINY, [f"storage.root=file://{tmp_path}/store", "rollout.engine_lifetime=flow"])
    monkeypatch.delenv(resident.CLUSTER_KEY_ENV)
    assert resident.cluster_key_problems(local) == []  # only pool placement reaches over the network


def test_a_resident_refuses_a_client_without_the_runs_secret(tmp_path, monkeypatch):
    """The resident's channel on loopback: a wrong key, another run's secret and a raw socket are refused
    before anything they sent is read; the run's secret gets an order through to a result."""
    import socket
    from multiprocessing.connection import AuthenticationError

    from forge_core.run.resources import FlowResources

    monkeypatch.setenv(resident.CLUSTER_KEY_ENV, KEY)
    cfg, other = _flow_lifetimes_on_pools(tmp_path, "run-a"), _flow_lifetimes_on_pools(tmp_path, "run-b")
    lines: list[str] = []
    server = resident.OrderServer(
        "127.0.0.1", resident.run_secret(cfg), cfg, FlowResources.of(cfg), "task_process", lines.append
    )
    address = ("127.0.0.1", server.port)
    try:
        for wrong in (b"x" * 32, resident.run_secret(other)):
            with pytest.raises(AuthenticationError):
                resident.connect(address, wrong)
        with socket.create_connection(address, timeout=30) as raw:
            raw.settimeout(30)
            assert b"#CHALLENGE#" in raw.recv(1024)
            raw.sendall(b"\x00\x00\x00\x05hello")  # a framed message that is not the challenge's answer
            reply = b""
            while chunk := raw.recv(1024):  # until the resident closes the connection
                reply += chunk
            assert b"#FAILURE#" in reply, reply
        refused = [line for line in lines if "without this run's secret" in line]
        assert len(refused) == 3, lines
        with resident.connect(address, resident.run_secret(cfg)) as conn:
            missing = f"file://{tmp_path}/store/no-such-spec.json"
            conn.send(("run", missing))
            assert conn.poll(60), "no answer to the order"
            kind, payload = conn.recv()
        result = LaunchResult.from_dict(payload)
        assert kind == "result" and not result.ok and "no-such-spec.json" in result.reason, payload
    finally:
        server.close()


class _ResidentStandIn:
    """What an order needs of its resident (forge_core.run.resident.Resident): an address, its end, `abandon`."""

    name = "engines on pool 'gpu-a'"

    def __init__(self, address):
        self._address = address
        self.abandoned: list[str] = []
        self.relay = SimpleNamespace(target=None)
        self.attempt = SimpleNamespace(launch_id="placed-standin")

    def address(self):
        return self._address

    def ended(self):
        return None

    def abandon(self, why: str) -> None:
        self.abandoned.append(why)


def _order(stand_in, lines):
    plan = SimpleNamespace(stage="evaluate", spec_uri="file:///nowhere/spec.json")
    return resident._RemoteOrder(stand_in, plan, lines.append, b"s" * 32, stop_bound_s=5.0)


def test_an_order_to_an_unreachable_resident_gives_it_up_retryably():
    """Nothing listens at the resident's address (its node died before its watcher noticed): the order raises
    ResidentGone (retryable) and the resident is given up, so the retry starts a new one."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        address = sock.getsockname()  # bound, never listening: connections are refused
        stand_in = _ResidentStandIn(address)
        with pytest.raises(resident.ResidentGone, match="could not be reached"):
            _order(stand_in, []).wait(1.0)
    assert stand_in.abandoned and "could not be reached" in stand_in.abandoned[0]
    assert issubclass(resident.ResidentGone, placement.RetryableStageError)


def test_an_order_whose_connection_breaks_is_retryable_and_gives_the_resident_up():
    """The resident takes the order, then its connection breaks (the resident killed): the attempt's result is
    RETRYABLE, names what happened, and the resident is given up."""
    import threading
    from multiprocessing.connection import Listener

    listener = Listener(("127.0.0.1", 0), family="AF_INET", authkey=b"s" * 32)
    received = []

    def take_the_order_then_die():
        with listener.accept() as conn:
            received.append(conn.recv())

    thread = threading.Thread(target=take_the_order_then_die, daemon=True)
    thread.start()
    stand_in, lines = _ResidentStandIn(listener.address), []
    order = _order(stand_in, lines)
    try:
        result = None
        for _ in range(600):  # until the broken connection is seen (each wait is at most 0.1 s)
            result = order.wait(0.1)
            if result is not None:
                break
    finally:
        listener.close()
    assert received == [("run", "file:///nowhere/spec.json")]
    assert result is not None and result.outcome is Outcome.RETRYABLE, result
    assert "went away during the order" in result.reason and result.launch_id == "placed-standin", result
    assert stand_in.abandoned, stand_in.abandoned
