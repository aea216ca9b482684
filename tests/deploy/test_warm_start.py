"""Warm starts (flows/warm_start.py) against a real Prefect server: a flow run's engine forked by the zygote runs
the flow exactly as `python -m prefect.engine` would (state, exit status, working folder, environment), signals
reach it, a vanished client takes it along, no zygote means a cold start, and the zygote ends with its parent."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from flows.warm_start import SOCKET_ENV
from tests.deploy.conftest import (
    REPO_ROOT,
    SERVER_STARTUP_TIMEOUT_S,
    LocalPrefect,
    ProcessKeeper,
    free_port,
    isolated_prefect_env,
    wait_until_healthy,
)

pytestmark = pytest.mark.timeout(900)
BOUND_S = 60.0  # generous: every wait below ends on an event, this only bounds a broken case


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    """One server, the probe's deployment and one zygote (a child of a stand-in worker process) for the module."""
    root = tmp_path_factory.mktemp("warm")
    keeper = ProcessKeeper(log_dir=root)
    port = free_port()
    home = root / "prefect-home"
    home.mkdir()
    env = {**isolated_prefect_env(home, port), "PYTHONPATH": str(REPO_ROOT)}
    server = keeper.start("server", [sys.executable, "-m", "prefect", "server", "start", "--port", str(port)], env, root)
    wait_until_healthy(server, env["PREFECT_API_URL"], SERVER_STARTUP_TIMEOUT_S)
    prefect = LocalPrefect(keeper, env, env["PREFECT_API_URL"], server)

    async def deploy(client):
        flow_id = await client.create_flow_from_name("warm-probe")
        return await client.create_deployment(flow_id=flow_id, name="probe", entrypoint="tests.deploy.warm_flows.probe")

    deployment_id = prefect.api(deploy)
    socket_path = str(root / "zy" / "zygote")
    os.makedirs(os.path.dirname(socket_path), mode=0o700)
    # The stand-in worker: the zygote's parent, which a test kills to see the zygote end with it.
    parent = keeper.start(
        "stand-in-worker",
        [sys.executable, "-c", "import subprocess,sys,time; subprocess.Popen(sys.argv[1:]); time.sleep(3600)",
         sys.executable, "-m", "flows.warm_start", "serve", socket_path],
        env,
        root,
    )
    wait_for(lambda: os.path.exists(socket_path), "the zygote serves", timeout_s=300)
    zygote = next(p for p in psutil.Process(parent.popen.pid).children() if "serve" in p.cmdline())
    yield {"prefect": prefect, "deployment_id": deployment_id, "socket": socket_path, "root": root,
           "zygote": zygote, "parent": parent}
    keeper.stop_all()
    keeper.kill_survivors()


def wait_for(check, what: str, timeout_s: float = BOUND_S):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    pytest.fail(f"timed out after {timeout_s:.0f} s waiting until {what}")


def new_flow_run(warm, name: str, mode: str) -> tuple[str, Path]:
    out = warm["root"] / f"{name}.json"

    async def create(client):
        return await client.create_flow_run_from_deployment(warm["deployment_id"], parameters={"out": str(out), "mode": mode})

    return str(warm["prefect"].api(create).id), out


def client(warm, run_id: str, name: str, socket_path: str | None = None) -> subprocess.Popen:
    """The process Prefect's runner would start for the run: `python -m flows.warm_start` in its own folder."""
    folder = warm["root"] / name
    folder.mkdir()
    env = {
        **warm["prefect"].env,
        "PREFECT__FLOW_RUN_ID": run_id,
        SOCKET_ENV: socket_path or warm["socket"],
        "WARM_PROBE_MARKER": name,
    }
    return subprocess.Popen([sys.executable, "-m", "flows.warm_start"], env=env, cwd=folder)


def state_of(warm, run_id: str) -> str:
    async def read(client):
        return await client.read_flow_run(run_id)

    return warm["prefect"].api(read).state.type.value


def test_a_warm_start_runs_the_flow_run_as_the_engine_would(warm):
    run_id, out = new_flow_run(warm, "ok", "ok")
    proc = client(warm, run_id, "ok")
    assert proc.wait(timeout=BOUND_S * 3) == 0
    facts = json.loads(out.read_text())
    assert facts["ppid"] == warm["zygote"].pid, "the flow ran in a child of the zygote: a warm start"
    assert facts["cwd"] == str(warm["root"] / "ok")
    assert facts["marker"] == "ok", "the run sees its own environment, not the zygote's"
    assert facts["started_warm"] == "1"
    assert state_of(warm, run_id) == "COMPLETED"


def test_a_failing_flow_fails_the_run_and_the_client_exits_1(warm):
    run_id, out = new_flow_run(warm, "fail", "fail")
    proc = client(warm, run_id, "fail")
    assert proc.wait(timeout=BOUND_S * 3) == 1
    assert json.loads(out.read_text())["ppid"] == warm["zygote"].pid
    assert state_of(warm, run_id) == "FAILED"


def test_without_a_zygote_the_client_starts_cold(warm):
    run_id, out = new_flow_run(warm, "cold", "ok")
    proc = client(warm, run_id, "cold", socket_path=str(warm["root"] / "no-such-socket"))
    assert proc.wait(timeout=BOUND_S * 3) == 0
    facts = json.loads(out.read_text())
    assert facts["pid"] == proc.pid, "the client became `python -m prefect.engine` itself"
    assert facts["started_warm"] is None
    assert state_of(warm, run_id) == "COMPLETED"


def test_sigterm_reaches_the_engine_and_the_client_ends_as_a_cold_engine_does(warm):
    codes = {}
    for start in ("warm", "cold"):
        run_id, out = new_flow_run(warm, f"term-{start}", "wait")
        socket_path = None if start == "warm" else str(warm["root"] / "no-such-socket")
        proc = client(warm, run_id, f"term-{start}", socket_path)
        facts = json.loads(wait_for(lambda out=out: out.exists() and out.read_text(), "the probe runs"))
        engine = psutil.Process(facts["pid"])
        assert (facts["ppid"] == warm["zygote"].pid) == (start == "warm")
        proc.send_signal(signal.SIGTERM)
        codes[start] = proc.wait(timeout=BOUND_S)
        wait_for(lambda engine=engine: not engine.is_running() or engine.status() == psutil.STATUS_ZOMBIE, "it ends")
    assert codes["warm"] == codes["cold"] != 0, codes


def test_a_sigkilled_client_takes_its_engine_along(warm):
    run_id, out = new_flow_run(warm, "kill", "wait")
    proc = client(warm, run_id, "kill")
    engine = psutil.Process(json.loads(wait_for(lambda: out.exists() and out.read_text(), "the probe runs"))["pid"])
    proc.kill()
    proc.wait(timeout=BOUND_S)
    assert wait_for(lambda: not engine.is_running() or engine.status() == psutil.STATUS_ZOMBIE, "the engine ends")


def test_the_zygote_ends_with_its_worker_and_removes_its_socket(warm):
    # Last in the module: it takes the zygote down.
    warm["parent"].popen.kill()
    warm["parent"].popen.wait(timeout=BOUND_S)
    wait_for(lambda: not warm["zygote"].is_running() or warm["zygote"].status() == psutil.STATUS_ZOMBIE, "the zygote ends")
    assert not os.path.exists(warm["socket"])


def test_a_node_worker_polls_every_second_unless_told_otherwise():
    from prefect.settings import PREFECT_WORKER_QUERY_SECONDS, temporary_settings

    from flows.node_worker import NODE_QUERY_S, query_seconds

    with temporary_settings(updates={PREFECT_WORKER_QUERY_SECONDS: 10}):  # Prefect's default: 5 s a stage
        assert query_seconds(None) == NODE_QUERY_S == 1.0
        assert query_seconds(2.5) == 2.5
    with temporary_settings(updates={PREFECT_WORKER_QUERY_SECONDS: 3}):  # set on purpose: kept
        assert query_seconds(None) == 3
    with pytest.raises(ValueError, match="--poll-s=0"):
        query_seconds(0)
