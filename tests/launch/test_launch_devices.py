"""GPU assignment (forge_core.launch.devices): concurrent launches on one host get different devices, recorded in
their placement record; the devices of a dead holder are free again; asking for more than the host shows is a
clear error. GPUs are simulated by CUDA_VISIBLE_DEVICES: the assignment hands out the names it lists."""

import subprocess
import sys
import textwrap
import time

import pytest

from forge_core.launch import LaunchSpec, Outcome, start
from forge_core.launch.devices import DeviceLease, DevicesBusy

pytestmark = pytest.mark.integration


@pytest.fixture
def two_gpus(monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,7")
    monkeypatch.setenv("FORGE_DEVICE_DIR", str(tmp_path / "devices"))


def wait_for_line(lines: list[str], prefix: str, timeout_s: float = 180.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = [line for line in list(lines) if line.startswith(prefix)]
        if found:
            return found[0]
        time.sleep(0.05)
    raise AssertionError(f"no line starting {prefix!r} within {timeout_s} s: {lines}")


def test_concurrent_one_gpu_launches_get_different_devices_and_record_them(two_gpus, workers_env, tmp_path):
    go = tmp_path / "go"
    env = {**workers_env, "PLAIN_WORKER_GO_FILE": str(go)}
    logs: list[list[str]] = [[], []]
    handles = [
        start(LaunchSpec("plain_worker", ["devices"], torchrun=False, env=env, gpus=1), log=logs[i].append)
        for i in range(2)
    ]
    seen = [wait_for_line(lines, "devices ").split()[1] for lines in logs]
    assert sorted(seen) == ["4", "7"]
    for lines, device in zip(logs, seen, strict=True):
        assert wait_for_line(lines, "placement ") == f'placement {{"devices": ["{device}"]}}'

    with pytest.raises(DevicesBusy, match=r"stayed busy .*launch " + handles[0].launch_id):
        DeviceLease.acquire(1, holder="a third launch", wait_s=0)

    go.touch()
    assert [h.wait(180).outcome for h in handles] == [Outcome.SUCCESS, Outcome.SUCCESS]
    lease = DeviceLease.acquire(2, holder="after both ended", wait_s=0)  # both released at their end
    assert lease.devices == ["4", "7"]
    lease.release()


def test_devices_of_a_killed_holder_are_free_again(two_gpus):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent("""
            import time
            from forge_core.launch.devices import DeviceLease
            lease = DeviceLease.acquire(1, holder="doomed")
            print("holding", lease.visible, flush=True)
            time.sleep(600)
        """),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().split()[0] == "holding"
        with pytest.raises(DevicesBusy, match="doomed"):
            DeviceLease.acquire(2, holder="test", wait_s=0)
    finally:
        holder.kill()
        holder.wait()
    lease = DeviceLease.acquire(2, holder="test", wait_s=0)  # the kernel dropped the dead holder's lock
    assert lease.devices == ["4", "7"]
    lease.release()


def test_a_launch_asking_for_more_gpus_than_the_host_shows_is_a_clear_error(two_gpus, workers_env):
    with pytest.raises(ValueError, match=r"asks for 3 GPU\(s\).*shows 2 .*lower\s+gpus_per_node"):
        start(LaunchSpec("plain_worker", ["success", "1"], torchrun=False, env=workers_env, gpus=3))


def test_a_spec_that_sets_its_own_visible_devices_cannot_also_ask_for_an_assignment():
    with pytest.raises(ValueError, match="the launcher assigns the devices"):
        LaunchSpec("m", torchrun=False, gpus=1, env={"CUDA_VISIBLE_DEVICES": "0"})
