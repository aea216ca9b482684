"""What other local users and user code can reach: the device lock folder (a symlink planted as a lock file, a
folder another user may write), the reward and tool workers' environment (secrets of the flow process) and the
size of a tool's result. Cheap: no flow, no Prefect."""

from __future__ import annotations

import os

import pytest

from forge_core.config.schema import RewardComponentConfig
from forge_core.envs.parsers import ToolCall
from forge_core.envs.tool_env import ToolUseEnvironment
from forge_core.envs.tools import tools_named
from forge_core.launch.devices import DeviceLease
from forge_core.rewards import RewardSet
from forge_core.rewards.isolation import CALL_TOO_LARGE, RewardIsolation, RewardPool

pytestmark = pytest.mark.integration


# ---- device lock files -------------------------------------------------------------------------------------------


@pytest.mark.fault(
    fault="a lock 'file' planted in the device folder as a symlink to a file the forgeflow user can write",
    where="forge_core.launch.devices (DeviceLease.acquire / release)",
    checked="acquiring is refused with the path named and the symlink's target is neither written nor emptied",
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
    "FORGE_CLUSTER_KEY": "cluster-key",
    "WANDB_API_KEY": "wandb-key",
    "HF_TOKEN": "hf-token",
}


@pytest.fixture
def pool():
    pool = RewardPool()
    yield pool
    pool.close()


@pytest.mark.fault(
    fault="a tool reads secrets of the flow process's environment (AWS_SECRET_ACCESS_KEY, FORGE_CLUSTER_KEY, "
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
    fault="a reward function reads FORGE_CLUSTER_KEY from its worker's environment",
    where="forge_core.rewards.isolation (isolated reward scoring)",
    checked="the reward sees no such variable unless rollout.worker_env_allow names it",
)
def test_a_reward_sees_no_cluster_key(monkeypatch):
    monkeypatch.setenv("FORGE_CLUSTER_KEY", "cluster-key")
    reads_key = [
        RewardComponentConfig("tests.rollout.rewards_for_tests:has_env", 1.0, {"name": "FORGE_CLUSTER_KEY"})
    ]

    def score(env_allow: tuple[str, ...]) -> float:
        isolation = RewardIsolation(timeout_s=60, workers=1, env_allow=env_allow)
        return RewardSet.from_config(reads_key, isolation=isolation).score(["a"], ["a"], ["s0"]).total[0]

    assert score(("FORGE_CLUSTER_KEY",)) == 1.0  # allowed: the variable does reach a worker
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
