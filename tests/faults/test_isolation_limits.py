"""What other local users and user code can reach: the device lock folder (a symlink planted as a lock file, a
folder another user may write), the reward and tool workers' environment (secrets of the flow process) and the
size of a tool's result. Cheap: no flow, no Prefect."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from multiprocessing.connection import AuthenticationError, Listener
from pathlib import Path

import pytest

from forge_core.config.schema import RewardComponentConfig
from forge_core.envs.parsers import ToolCall
from forge_core.envs.tool_env import ToolUseEnvironment
from forge_core.envs.tools import tools_named
from forge_core.launch.devices import DeviceLease
from forge_core.rewards import RewardSet
from forge_core.rewards.isolation import CALL_TOO_LARGE, RewardIsolation, RewardPool
from forge_core.rollout.service.listener import HANDSHAKE_THREAD, serve_connections
from tests.faults.listener_peers import echo, order_once, order_until_answered, silent_connection

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


# ---- device lock files ------------------------------------------------------------------------------------


@pytest.mark.fault(
    fault="a lock 'file' planted in the device folder as a symlink to a file the forgeflow user can write",
    where="forge_core.launch.devices (DeviceLease.acquire / release)",
    checked="acquiring is refused with the path named and the symlink's target is neither written nor "
    "emptied",
)
def test_a_symlinked_device_lock_never_touches_its_target(monkeypatch, tmp_path):
    folder = tmp_path / "devices"
    folder.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (folder / "cuda-0.lock").symlink_to(victim)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setenv("FORGE_DEVICE_DIR", str(folder))

    try:
        DeviceLease.acquire(1, holder="attacked launch", wait_s=0).release()
    except ValueError as exc:
        assert "cuda-0.lock" in str(exc)
    assert victim.read_text() == "precious"


@pytest.mark.fault(
    fault="the device folder belongs to another user, or group/others may write it",
    where="forge_core.launch.devices (DeviceLease.acquire)",
    checked="acquiring is refused with a ValueError naming the folder and the fix; no lock file is created",
)
@pytest.mark.parametrize("attack", ["world-writable", "other owner"])
def test_a_device_folder_others_control_is_refused(monkeypatch, tmp_path, attack):
    folder = tmp_path / "devices"
    folder.mkdir(mode=0o700)
    if attack == "world-writable":
        folder.chmod(0o777)
    else:
        if os.getuid() != 0:
            pytest.skip("giving a folder to another user needs root")
        os.chown(folder, 65534, 65534)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setenv("FORGE_DEVICE_DIR", str(folder))

    with pytest.raises(ValueError, match=str(folder)):
        DeviceLease.acquire(1, holder="launch", wait_s=0)
    assert list(folder.iterdir()) == []


def test_device_locks_by_default_live_in_a_private_folder_of_this_user(monkeypatch):
    monkeypatch.delenv("FORGE_DEVICE_DIR", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    lease = DeviceLease.acquire(1, holder="launch", wait_s=0)
    try:
        info = os.fstat(lease.fds[0])
        folder = os.stat(os.readlink(f"/proc/self/fd/{lease.fds[0]}").rsplit("/", 1)[0])
    finally:
        lease.release()
    assert (info.st_uid, info.st_mode & 0o777) == (os.getuid(), 0o600)
    assert (folder.st_uid, folder.st_mode & 0o077) == (os.getuid(), 0)


# ---- reward and tool workers ------------------------------------------------------------------------------

SECRETS = {
    "AWS_SECRET_ACCESS_KEY": "aws-secret",
    "RAY_AUTH_TOKEN": "ray-token",
    "WANDB_API_KEY": "wandb-key",
    "HF_TOKEN": "hf-token",
}


@pytest.fixture
def pool():
    pool = RewardPool()
    yield pool
    pool.close()


@pytest.mark.fault(
    fault="a tool reads secrets of the flow process's environment (AWS_SECRET_ACCESS_KEY, RAY_AUTH_TOKEN, "
    "...)",
    where="forge_core.rewards.isolation (the workers that run tools and rewards)",
    checked="the worker's environment is allow-listed: every secret reads as None, PATH still passes, and a "
    "name the user allows (rollout.worker_env_allow) passes",
)
def test_a_tool_sees_no_secret_of_the_flow_process(monkeypatch, pool):
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    calls = [((name,), {}) for name in [*SECRETS, "PATH"]]

    seen = [outcome.value for outcome in pool.call_each("os:getenv", calls, timeout_s=60)]
    assert seen == [None] * len(SECRETS) + [os.environ["PATH"]]

    allowed = pool.call_each("os:getenv", calls[:1], timeout_s=60, env_allow=("AWS_SECRET_ACCESS_KEY",))
    assert allowed[0].value == "aws-secret"


@pytest.mark.fault(
    fault="a reward function reads RAY_AUTH_TOKEN from its worker's environment",
    where="forge_core.rewards.isolation (isolated reward scoring)",
    checked="the reward sees no such variable unless rollout.worker_env_allow names it",
)
def test_a_reward_sees_no_cluster_key(monkeypatch):
    monkeypatch.setenv("RAY_AUTH_TOKEN", "ray-token")
    reads_key = [
        RewardComponentConfig("tests.rollout.rewards_for_tests:has_env", 1.0, {"name": "RAY_AUTH_TOKEN"})
    ]

    def score(env_allow: tuple[str, ...]) -> float:
        isolation = RewardIsolation(timeout_s=60, workers=1, env_allow=env_allow)
        return RewardSet.from_config(reads_key, isolation=isolation).score(["a"], ["a"], ["s0"]).total[0]

    assert score(("RAY_AUTH_TOKEN",)) == 1.0  # allowed: the variable does reach a worker
    assert score(()) == 0.0


@pytest.mark.fault(
    fault="a tool returns a result far larger than an observation (1 MB against a 1 KiB cap)",
    where="forge_core.rewards.isolation / worker (rollout.env.max_tool_result_bytes)",
    checked="the call becomes an error outcome naming the cap, which the tool_use environment turns into an "
    "error observation counted in env/tool_errors; a result under the cap passes",
)
def test_a_tool_result_over_the_cap_is_an_error_observation(pool):
    huge, small = ((("x", 1_000_000), {}), (("x", 10), {}))
    outcomes = pool.call_each("operator:mul", [huge, small], timeout_s=60, max_result_bytes=1024)
    assert outcomes[0].kind == CALL_TOO_LARGE and "max_tool_result_bytes=1024" in outcomes[0].error
    assert outcomes[1].ok and outcomes[1].value == "x" * 10

    env = ToolUseEnvironment(tools_named(["operator:mul"]), max_result_bytes=1024)
    call = ToolCall("mul", ("x", 1_000_000))
    observation = env.observation(call, env.run_tools([call])[0])
    assert observation.error_kind == CALL_TOO_LARGE  # what env/tool_errors counts
    assert observation.text == "<result>error: too_large</result>"


# ---- the engine service's listener -------------------------------------------------------------------------

LISTENER_SCRIPT = """
import logging, os, resource, sys
from multiprocessing.connection import Listener
from forge_core.rollout.service.listener import serve_connections
from tests.faults.listener_peers import echo

logging.basicConfig(level=logging.INFO, stream=sys.stderr)
listener = Listener(("127.0.0.1", 0), backlog=64)
spare = int(sys.argv[2])
open_now = len(os.listdir("/proc/self/fd"))
resource.setrlimit(resource.RLIMIT_NOFILE, (open_now + spare, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
print(listener.address[1], flush=True)
serve_connections(listener, bytes.fromhex(sys.argv[1]), echo, handshake_s=3600, max_pending=64)
print("the accept loop ended", flush=True)
"""


def handshake_threads() -> int:
    return sum(t.name == HANDSHAKE_THREAD for t in threading.enumerate())


@pytest.mark.fault(
    fault="50 connections to the engine service's listener that never answer the key challenge",
    where="forge_core.rollout.service.listener (the engine service's accept loop)",
    checked="at most max_pending (4) of them hold a handshake at once, each at most handshake_s; a client "
    "with the key still gets its request answered, one with a wrong key is refused",
)
def test_silent_connections_do_not_lock_out_a_client_with_the_key():
    key = os.urandom(32)
    listener = Listener(("127.0.0.1", 0), backlog=64)
    threading.Thread(
        target=serve_connections, args=(listener, key, echo), kwargs={"handshake_s": 0.5, "max_pending": 4},
        daemon=True,
    ).start()  # fmt: skip
    silent = [silent_connection(listener.address) for _ in range(50)]
    try:
        most = 0

        def sample() -> None:
            nonlocal most
            most = max(most, handshake_threads())

        answer = order_until_answered(listener.address, key, "ping", within_s=60, poll=sample)
        assert answer == ("done", "ping")
        assert most <= 4
        with pytest.raises((AuthenticationError, EOFError, OSError)):
            order_once(listener.address, b"wrong key", "ping", io_timeout_s=30)
    finally:
        for sock in silent:
            sock.close()
        listener.close()


@pytest.mark.fault(
    fault="connections that never answer the key challenge exhaust the listener's file descriptors (EMFILE)",
    where="forge_core.rollout.service.listener, in a process with RLIMIT_NOFILE lowered to 3 spare "
    "descriptors",
    checked="the accept loop logs EMFILE, backs off and keeps accepting: once the connections are closed a "
    "client with the key gets its request answered by the same process",
)
def test_the_listener_keeps_accepting_after_running_out_of_descriptors(tmp_path):
    key = os.urandom(32)
    proc = subprocess.Popen(
        [sys.executable, "-c", LISTENER_SCRIPT, key.hex(), "3"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
    )  # fmt: skip
    errors: list[str] = []
    threading.Thread(target=lambda: errors.extend(proc.stderr), daemon=True).start()
    try:
        address = ("127.0.0.1", int(proc.stdout.readline()))
        silent = [silent_connection(address) for _ in range(30)]
        deadline = time.monotonic() + 60
        while not any("EMFILE" in line for line in list(errors)) and time.monotonic() < deadline:
            time.sleep(0.05)
        for sock in silent:
            sock.close()
        assert order_until_answered(address, key, "after", within_s=60) == ("done", "after")
        assert proc.poll() is None
        assert any("EMFILE" in line for line in list(errors)), errors  # the fd limit was reached
    finally:
        proc.kill()
        proc.wait()
