"""A machine-local record of live launches, so that the next flow run can end what a dead launcher left.

A SIGKILLed launcher cannot end its process trees, and torchrun and its ranks, in their own sessions, keep
running. So every launch writes `<registry>/<launch_id>.json` (its launching process by pid and start time)
when it starts and removes it when it ends. `reap_orphaned_launches()`, called at the start of every flow
run, ends each process carrying the FORGE_LAUNCH_ID of a record whose launching process is gone (SIGTERM, a
grace period, SIGKILL) and removes the record. A record whose launcher is alive is never touched, so
concurrent flows on one machine are safe.

Registry folder: $FORGE_LAUNCH_REGISTRY, else `<tempdir>/forgeflow-launches-<uid>`. It is created mode 0700
and must belong to this user with no write access for anyone else (`check_private`, else ValueError naming the
fix): whoever can plant a record there chooses which of our processes the next flow ends.

    from forge_core.launch import reap_orphaned_launches
    ended_pids = reap_orphaned_launches()
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from pathlib import Path

from forge_core.launch.owner import Owner
from forge_core.launch.process_tree import end_processes, processes_with_launch_id

REGISTRY_ENV = "FORGE_LAUNCH_REGISTRY"

_logger = logging.getLogger(__name__)


def registry_dir() -> Path:
    configured = os.environ.get(REGISTRY_ENV)
    if configured:
        return Path(configured)
    return Path(tempfile.gettempdir()) / f"forgeflow-launches-{os.getuid()}"


def _record_path(directory: Path, launch_id: str) -> Path:
    return directory / f"{launch_id}.json"


def check_private(path: Path, what: str, writable_only: bool = False) -> None:
    """ValueError unless `path` belongs to this user and gives group/others no access (`writable_only`: no
    write access, for folders whose contents are harmless to read)."""
    info = path.stat()
    if info.st_uid != os.getuid():
        raise ValueError(
            f"{what}={path}: owned by uid {info.st_uid}, not by this user ({os.getuid()}); use a folder of your own"
        )
    forbidden, fix = (0o022, "go-w") if writable_only else (0o077, "go-rwx")
    if info.st_mode & forbidden:
        raise ValueError(
            f"{what}={path}: mode {oct(info.st_mode & 0o777)} lets other users reach what it holds; "
            f"run `chmod {fix} {path}` or choose another folder"
        )


def _private_registry(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    where = f"launch registry ({REGISTRY_ENV})" if os.environ.get(REGISTRY_ENV) else "launch registry"
    check_private(directory, where, writable_only=True)
    return directory


def record_launch(launch_id: str, root_pid: int, module: str, owner: tuple[int, float] | None = None) -> None:
    """Note a started launch, atomically. `owner` (pid, create time) is the process whose death makes the
    launch an orphan (default: this one); a service that outlives the worker that started it names the
    worker's own launcher (`launch_owner`)."""
    directory = _private_registry(registry_dir())
    if owner is None:
        this = Owner.this_process()
        owner = (this.pid, this.create_time)
    record = {
        "launch_id": launch_id,
        "owner_pid": owner[0],
        "owner_create_time": owner[1],
        "root_pid": root_pid,
        "module": module,
        "started_at": time.time(),
    }
    tmp = directory / f".{launch_id}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, _record_path(directory, launch_id))


def launch_owner(launch_id: str) -> tuple[int, float] | None:
    """(pid, create time) of the process that started launch `launch_id`, from its record; None if unknown."""
    try:
        record = json.loads(_record_path(registry_dir(), launch_id).read_text())
        return int(record["owner_pid"]), float(record["owner_create_time"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def forget_launch(launch_id: str) -> None:
    _record_path(registry_dir(), launch_id).unlink(missing_ok=True)


def _owner_alive(record: dict) -> bool:
    try:
        owner = Owner(int(record["owner_pid"]), float(record["owner_create_time"]))
    except (KeyError, TypeError, ValueError):
        return False
    return owner.alive()


def stale_launches(directory: Path | None = None) -> list[dict]:
    """Records of launches whose launching process is gone (unreadable records count as stale)."""
    directory = directory or registry_dir()
    if not directory.is_dir():
        return []
    _private_registry(directory)  # records planted by someone else must not choose what gets ended
    stale = []
    for path in sorted(directory.glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            record = {"launch_id": path.stem}
        if not _owner_alive(record):
            stale.append({**record, "launch_id": path.stem})
    return stale


def reap_orphaned_launches(directory: Path | None = None, grace_s: float = 5.0) -> list[int]:
    """End every process of every launch whose launcher died; returns the pids that were still running."""
    directory = directory or registry_dir()
    ended: list[int] = []
    for record in stale_launches(directory):
        launch_id = record["launch_id"]
        orphans = processes_with_launch_id(launch_id)
        if orphans:
            pids = sorted(p.pid for p in orphans)
            _logger.warning(
                "launch %s (%s) outlived its launcher (pid %s): ending its processes %s",
                launch_id,
                record.get("module", "?"),
                record.get("owner_pid", "?"),
                pids,
            )
            end_processes(orphans, grace_s)
            ended += pids
        _record_path(directory, launch_id).unlink(missing_ok=True)
    return ended
