"""GPUs for a launch: which of the host's devices a launch gets, so concurrent launches on one host never share one.

    lease = DeviceLease.acquire(2, holder="launch 1a2b")   # waits, bounded, for 2 free devices
    env["CUDA_VISIBLE_DEVICES"] = lease.visible             # e.g. "2,3"
    ...
    lease.release()

`forge_core.launch.start` does this for every `LaunchSpec(gpus=N)` (the stage's `launch.<stage>.gpus_per_node`)
and records the devices in the manifests the launch writes (the placement record, `devices`). The pool's
capacity (a Prefect global concurrency limit: tasks/stages.py) admits a stage when enough of the pool's GPUs are
free but does not say which; without an assignment every 1-GPU stage used cuda:0.

Each device is a lock file in a folder of this user (`FORGE_DEVICE_DIR`, default
`<tmp>/forgeflow-devices-<uid>`), taken with `flock`: the kernel drops a lock when its last holder is gone, so a crashed launcher never leaves a
GPU marked busy, and the launched process inherits the locks, so its devices stay taken while it lives. The
devices are the ones this process may use: `CUDA_VISIBLE_DEVICES` (indexes or UUIDs, kept as given) when set,
else `0..torch.cuda.device_count()-1`.

The folder must belong to this user and give group and others no access (created 0700; one that does not is
refused), and a lock file is opened without following a symlink and must be a regular file of this user (0600):
another local user can neither plant a lock "file" that redirects our writes to a file of theirs choosing nor
hold our devices. Launches of different users therefore do not coordinate: give each its own GPUs.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from forge_core.launch.errors import RetryableStageError
from forge_core.launch.registry import check_private

DEVICE_DIR_ENV = "FORGE_DEVICE_DIR"
# The pool's concurrency limit admitted the stage, so its devices are normally free at once; a wait means a
# process outside the pool's accounting holds them (another pool over the same GPUs, a manual job).
DEFAULT_WAIT_S = 120.0
_POLL_S = 0.5


class DevicesBusy(RetryableStageError):
    """Fewer free devices than a launch needs for longer than the wait: a retry may find them free."""


def visible_devices() -> list[str]:
    """The devices this process may hand out, as CUDA_VISIBLE_DEVICES names them."""
    raw = os.environ.get("CUDA_VISIBLE_DEVICES")
    if raw is not None:
        return [d.strip() for d in raw.split(",") if d.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


def device_dir() -> Path:
    """The lock folder, created private when missing (module docstring).

    Raises:
        ValueError: the folder belongs to another user or gives group/others access.
    """
    configured = os.environ.get(DEVICE_DIR_ENV)
    default = Path(tempfile.gettempdir()) / f"forgeflow-devices-{os.getuid()}"
    folder = Path(configured) if configured else default
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    check_private(folder, DEVICE_DIR_ENV if configured else "the device lock folder")
    return folder


@dataclass
class DeviceLease:
    """Devices held by this process until `release()` (or its exit): see the module docstring."""

    devices: list[str]
    _files: list[int] = field(default_factory=list, repr=False)

    @property
    def visible(self) -> str:
        return ",".join(self.devices)

    @property
    def fds(self) -> tuple[int, ...]:
        """The lock files' descriptors: pass them to the launched process so its devices stay taken while it lives."""
        return tuple(self._files)

    @classmethod
    def acquire(cls, count: int, holder: str, wait_s: float = DEFAULT_WAIT_S) -> DeviceLease:
        """`count` devices no other lease on this host holds; DevicesBusy after `wait_s` without enough free."""
        assert count > 0, "acquire at least one device"
        devices = visible_devices()
        if count > len(devices):
            raise ValueError(
                f"launch asks for {count} GPU(s) (launch.<stage>.gpus_per_node) but this host shows "
                f"{len(devices)} (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')}); lower "
                "gpus_per_node to at most that, or widen CUDA_VISIBLE_DEVICES"
            )
        folder = device_dir()
        give_up = time.monotonic() + wait_s
        while True:
            lease = cls._try_take(devices, count, folder, holder)
            if lease is not None:
                return lease
            if time.monotonic() >= give_up:
                raise DevicesBusy(
                    f"{holder}: {count} of this host's GPUs {devices} stayed busy for {wait_s:g} s "
                    f"({_holders(devices, folder)}); they are held by processes outside this pool's "
                    "concurrency limit: stop them, or give this pool GPUs of its own (CUDA_VISIBLE_DEVICES)"
                )
            time.sleep(_POLL_S)

    @classmethod
    def _try_take(cls, devices: list[str], count: int, folder: Path, holder: str) -> DeviceLease | None:
        lease = cls(devices=[])
        for device in devices:
            fd = _open_lock(_lock_path(folder, device))
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{holder} (pid {os.getpid()})".encode(), 0)
            lease.devices.append(device)
            lease._files.append(fd)
            if len(lease.devices) == count:
                return lease
        lease.release()
        return None

    def hand_over(self) -> None:
        """Close this process's copies after a child inherited them (`fds`): the child holds the devices for
        as long as it lives."""
        for fd in self._files:
            os.close(fd)
        self._files.clear()

    def release(self) -> None:
        for fd in self._files:
            os.ftruncate(fd, 0)  # no holder named any more
            os.close(fd)  # closing the last descriptor of the open file drops its flock
        self._files.clear()


def _open_lock(path: Path) -> int:
    """The lock file's descriptor: a regular file of this user, never a symlink's target (module docstring).
    Truncating and writing it afterwards is safe: the descriptor is that very file."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise ValueError(
            f"device lock {path} is a symlink: remove it (only this user should write that folder)"
        ) from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
        os.close(fd)
        raise ValueError(
            f"device lock {path} is not a regular file of this user (mode {oct(info.st_mode)}, owner uid "
            f"{info.st_uid}): remove it"
        )
    return fd


def _lock_path(folder: Path, device: str) -> Path:
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in device)
    return folder / f"cuda-{safe}.lock"


def _holders(devices: list[str], folder: Path) -> str:
    names = []
    for device in devices:
        try:
            names.append(f"{device}: {_lock_path(folder, device).read_text() or 'free'}")
        except OSError:
            names.append(f"{device}: free")
    return "; ".join(names)
