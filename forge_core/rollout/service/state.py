"""The engine services' state folder: paths, the service record, the key, shared constants and errors.

Used by both sides of the channel (`connection.py` and `supervision.py`, `server.py`); see the package docstring for the picture.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import secrets
import uuid
from dataclasses import dataclass
from pathlib import Path

import psutil

from forge_core.launch.owner import Owner
from forge_core.launch.registry import check_private
from forge_core.rollout.engine import EngineOptions
from forge_core.rollout.protocol import EngineLost

log = logging.getLogger(__name__)

MODULE = "forge_core.rollout.service"
DEFAULT_NAME = "rollout"
AUTHKEY_FILE = "authkey"
UNIX_SOCKET_PATH_MAX = 107  # bytes; sun_path holds 108 with the terminating NUL
STARTING, READY, FAILED = "starting", "ready", "failed"
PING_TIMEOUT_S = 30.0
# After a SIGTERM, how long the service's clean-up may take before it SIGKILLs its own processes (server.py):
# a healthy engine closes in well under a second; shorter than vLLM's own 5 s wait for an engine core process
# that ignores SIGTERM, so a wedged core never holds the service.
STOP_GRACE_S = 3.0


class EngineServiceError(EngineLost):
    """The engine service failed, died or did not start; a retry (`ensure` again) starts a new one."""


# ---- the state folder ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServicePaths:
    """The files of service `name` in `state_dir` (see the module docstring)."""

    state_dir: Path
    name: str = DEFAULT_NAME

    @property
    def socket(self) -> Path:
        return self.state_dir / f"{self.name}.sock"

    @property
    def record(self) -> Path:
        return self.state_dir / f"{self.name}.json"

    @property
    def log(self) -> Path:
        return self.state_dir / f"{self.name}.log"

    @property
    def lock(self) -> Path:
        return self.state_dir / f"{self.name}.lock"

    @property
    def authkey(self) -> Path:
        return self.state_dir / AUTHKEY_FILE


def prepare_state_dir(state_dir: str | os.PathLike, name: str = DEFAULT_NAME) -> ServicePaths:
    """Create the state folder (mode 0700) or check an existing one is private; its key file exists after.

    ValueError naming rollout.engine_state_dir when the folder is another user's, readable by others, or
    too long a path for a Unix socket.
    """
    if not name or not name.replace("-", "").replace("_", "").isalnum():
        raise ValueError(f"engine service name={name!r}: use letters, digits, '-' and '_' only")
    folder = Path(state_dir).expanduser().absolute()
    paths = ServicePaths(folder, name)
    socket_bytes = len(os.fsencode(str(paths.socket)))
    if socket_bytes > UNIX_SOCKET_PATH_MAX:
        raise ValueError(
            f"rollout.engine_state_dir={folder}: the engine socket {paths.socket} is {socket_bytes} bytes, "
            f"more than a Unix socket allows ({UNIX_SOCKET_PATH_MAX}); choose a shorter folder"
        )
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    check_private(folder, "rollout.engine_state_dir")
    _create_authkey(paths.authkey)
    check_private(paths.authkey, f"rollout.engine_state_dir={folder}: its {AUTHKEY_FILE}")
    return paths


def _create_authkey(path: Path) -> None:
    if path.exists():
        return
    staging = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
    fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(secrets.token_bytes(32))
        with contextlib.suppress(FileExistsError):  # another process made it first: keep theirs
            os.link(staging, path)  # appears complete or not at all
    finally:
        staging.unlink(missing_ok=True)


@dataclass(frozen=True)
class ServiceRecord:
    """`<name>.json`: which process is (or was) the service, and what it serves once ready."""

    pid: int
    create_time: float
    launch_id: str
    status: str
    owner_pid: int | None = None
    started_at: float = 0.0  # time.time() of the service's start
    info: dict = dataclasses.field(default_factory=dict)  # the ping payload when ready; the error when failed

    def process(self) -> psutil.Process | None:
        """The service process if it still runs (same pid AND start time: pids are reused)."""
        if not Owner(self.pid, self.create_time).alive():
            return None
        try:
            return psutil.Process(self.pid)
        except psutil.Error:
            return None


def read_record(paths: ServicePaths) -> ServiceRecord | None:
    try:
        raw = json.loads(paths.record.read_text())
        return ServiceRecord(**raw)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as exc:
        log.warning("engine service record %s is unreadable (%s); treating it as stale", paths.record, exc)
        return None


def write_record(paths: ServicePaths, record: ServiceRecord) -> None:
    staging = paths.record.with_name(f".{paths.record.name}.{os.getpid()}.tmp")
    staging.write_text(json.dumps(dataclasses.asdict(record), sort_keys=True))
    os.replace(staging, paths.record)


def log_tail(paths: ServicePaths, offset: int = 0, lines: int = 40) -> str:
    """The last `lines` lines the service wrote to its log after byte `offset`."""
    try:
        with paths.log.open("rb") as f:
            f.seek(offset)
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:]) or "(empty log)"


def engine_identity(options: EngineOptions) -> dict:
    # The engine's own seed does not change samples (every request carries its seed), so a rollout (seeded
    # with the rollout seed) and an evaluation (the run's seed) can share one engine.
    return {k: v for k, v in options.to_dict().items() if k != "seed"}
