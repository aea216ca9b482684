"""What other local users and user code can reach: the device lock folder (a symlink planted as a lock file, a
folder another user may write), the reward and tool workers' environment (secrets of the flow process) and the
size of a tool's result. Cheap: no flow, no Prefect."""

from __future__ import annotations

import os

import pytest

from forge_core.launch.devices import DeviceLease

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
