"""The long-lived rollout engine: one vLLM `Generator` in a service process that outlives the stages using it.

A stage-per-iteration loop pays a vLLM start-up (tens of seconds on CPU) in every rollout and evaluate stage;
this service pays it once per flow run and loads each new policy in place (`Generator.reload`, milliseconds
for small models). Stage code uses it through the Generator interface:

    client = EngineService.ensure(state_dir, cfg.rollout, policy.local_dir, policy.version)
    samples = client.serving(policy.version).generate(prompts, seed=7)   # or client.generate(..., expected_version)
    client.close()                               # disconnects; the service keeps running
    ...
    stop_services(state_dir)                     # the flow, at its end and on failure/cancellation

or by hand: `python -m forge_core.rollout.service --state-dir D --policy-dir P --policy-version V ...` (what
`ensure` runs; see `main`).

Requests: `ping` -> {pid, policy_version, uptime_s, ...}; `load(policy_dir, policy_version)` -> reloads the
weights in place and records the version (no-op when that version is already served); `generate(prompts,
seed, sampling, expected_version)` -> samples, refused with `PolicyVersionMismatch` when the engine serves
another version (never silently the wrong policy); `shutdown`.

Channel: `multiprocessing.connection` on a Unix socket in the state folder. No TCP port to pick, collide on
or expose; access is limited by file permissions (folder 0700, socket 0600) plus an HMAC challenge with a
32-byte key in `<state_dir>/authkey` (0600), so only this user's processes that can read the key get in;
token-id lists and `Sample`s travel as pickles (no HTTP/JSON encoding of every token, no tokenizer round
trip as with vLLM's OpenAI server). Pickle is safe here because every peer has passed the key challenge.

State folder `<state_dir>` (one flow run's engines; several services by `name`):
  `<name>.sock`  the socket, `<name>.json`  the service record (pid, start time, launch id, status
  starting/ready/failed, what it serves), `<name>.log`  its stdout/stderr, `<name>.lock`  serialises
  start-ups, `authkey`.

Process ownership: the service runs in its own session with its own FORGE_LAUNCH_ID and writes a launch
registry record (forge_core.launch.registry) whose owner is the process that bounds its life: the flow
process that launched the stage worker calling `ensure` (found through the worker's own FORGE_LAUNCH_ID),
else the caller. So `reap_orphaned_launches()` ends a service whose flow died, the stage's launcher leaves it
alone (process_tree skips descendants of another launch), and the service also exits by itself when its
owner is gone. vLLM's processes started by the service carry its launch id, so `stop_services` finds them.

Requests touching the engine run one at a time on the service's main thread (vLLM is not shared across
threads); `ping` is answered by the connection's thread, also while a generation runs. After an unexpected
engine error (e.g. vLLM's EngineDeadError) the service replies and exits: the next `ensure` (the stage's
retry) starts a new one.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import queue
import secrets
import signal
import subprocess
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import AuthenticationError, Client, Connection, Listener
from pathlib import Path
from typing import Any, Self

import psutil

from forge_core.config.schema import RolloutConfig, SamplingConfig
from forge_core.launch import registry
from forge_core.launch.errors import RetryableStageError
from forge_core.launch.process_tree import end_processes, is_alive, processes_with_launch_id
from forge_core.launch.spec import ERROR_FILE_ENV, LAUNCH_ID_ENV, LOG_PREFIX_TEMPLATE_ENV
from forge_core.rollout.engine import EngineOptions
from forge_core.rollout.generator import model_fingerprint
from forge_core.rollout.types import Prompt, Sample

log = logging.getLogger(__name__)

MODULE = "forge_core.rollout.service"
DEFAULT_NAME = "rollout"
AUTHKEY_FILE = "authkey"
UNIX_SOCKET_PATH_MAX = 107  # bytes; sun_path holds 108 with the terminating NUL
STARTING, READY, FAILED = "starting", "ready", "failed"
PING_TIMEOUT_S = 30.0
OWNER_POLL_S = 2.0
_CREATE_TIME_TOLERANCE_S = 0.01
# Services this process started: kept so their exit status is collected (no zombies while we live).
_children: dict[int, subprocess.Popen] = {}


class EngineServiceError(RetryableStageError):
    """The engine service failed, died or did not start; a retry (`ensure` again) starts a new one."""


class PolicyVersionMismatch(RetryableStageError):
    """A generate request expected another policy version than the one the engine serves."""


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


def check_private(path: Path, what: str) -> None:
    """ValueError unless `path` belongs to this user and gives group/others no access."""
    info = path.stat()
    if info.st_uid != os.getuid():
        raise ValueError(
            f"{what}={path}: owned by uid {info.st_uid}, not by this user ({os.getuid()}); use a folder of your own"
        )
    if info.st_mode & 0o077:
        raise ValueError(
            f"{what}={path}: mode {oct(info.st_mode & 0o777)} lets other users reach the engine service; "
            f"run `chmod go-rwx {path}` or choose another folder"
        )


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
        try:
            proc = psutil.Process(self.pid)
            same = abs(proc.create_time() - self.create_time) < _CREATE_TIME_TOLERANCE_S
        except psutil.Error:
            return None
        return proc if same and is_alive(proc) else None


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


# ---- client ---------------------------------------------------------------------------------------------


def _raise_reply_error(error: dict, pid: int, paths: ServicePaths) -> None:
    kind, message = error.get("kind"), error.get("message", "")
    if kind == "version":
        raise PolicyVersionMismatch(message)
    if kind == "user":
        raise ValueError(message)
    raise EngineServiceError(
        f"engine service pid {pid} ({paths.socket}) failed: {message}\n{error.get('traceback', '')}"
    )


class EngineClient:
    """A connection to one engine service. Not thread-safe: one request at a time per client."""

    def __init__(self, conn: Connection, paths: ServicePaths, info: dict, startup_s: float = 0.0):
        self._conn = conn
        self.paths = paths
        self.pid = int(info["pid"])
        self.info = info
        # Seconds this client spent starting the service (0.0 when it found one running) and loading weights.
        self.startup_s = startup_s
        self.reload_s = 0.0

    @property
    def policy_version(self) -> str:
        return self.info["policy_version"]

    def _call(self, op: str, timeout_s: float | None = None, **kwargs) -> Any:
        try:
            self._conn.send((op, kwargs))
            if timeout_s is not None and not self._conn.poll(timeout_s):
                raise EngineServiceError(
                    f"engine service pid {self.pid} ({self.paths.socket}) did not answer {op!r} within "
                    f"{timeout_s:g} s"
                )
            status, payload = self._conn.recv()
        except (EOFError, OSError) as exc:
            raise EngineServiceError(
                f"engine service pid {self.pid} ({self.paths.socket}) went away during {op!r} ({exc!r}); "
                f"its log {self.paths.log} ends with:\n{log_tail(self.paths)}"
            ) from exc
        if status != "ok":
            _raise_reply_error(payload, self.pid, self.paths)
        return payload

    def ping(self, timeout_s: float = PING_TIMEOUT_S) -> dict:
        """{pid, policy_version, uptime_s, policy_dir, engine, num_engines, model_fingerprint, ...}"""
        self.info = self._call("ping", timeout_s=timeout_s)
        return self.info

    def load(self, policy_dir: str | os.PathLike, policy_version: str) -> float:
        """Serve `policy_version` from `policy_dir` (weights reloaded in place); returns the reload seconds."""
        reply = self._call("load", policy_dir=str(Path(policy_dir).absolute()), policy_version=policy_version)
        self.info = reply["info"]
        self.reload_s = float(reply["reload_s"])
        return self.reload_s

    def generate(
        self, prompts: Sequence[Prompt], seed: int, sampling: SamplingConfig, expected_version: str
    ) -> list[Sample]:
        """`Generator.generate` in the service; PolicyVersionMismatch unless it serves `expected_version`."""
        reply = self._call(
            "generate", prompts=list(prompts), seed=seed, sampling=sampling, expected_version=expected_version
        )
        assert reply["policy_version"] == expected_version, "the service checks the version before generating"
        return reply["samples"]

    def serving(self, policy_version: str, sampling: SamplingConfig | None = None) -> ServedGenerator:
        """This service behind the Generator interface of stage code, pinned to `policy_version`."""
        return ServedGenerator(self, policy_version, sampling)

    def shutdown(self, timeout_s: float = PING_TIMEOUT_S) -> None:
        """Ask the service to stop its engine and exit (does not wait for the exit)."""
        self._call("shutdown", timeout_s=timeout_s)
        self.close()

    def close(self) -> None:
        """Disconnect; the service keeps running."""
        with contextlib.suppress(OSError):
            self._conn.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


@dataclass
class ServedGenerator:
    """What the rollout/evaluate stage code calls (`generate(prompts, seed, sampling)`), served by a service.

    Every call carries `policy_version`: samples never silently come from other weights.
    """

    client: EngineClient
    policy_version: str
    sampling: SamplingConfig | None = None

    @property
    def startup_s(self) -> float:
        return self.client.startup_s

    @property
    def reload_s(self) -> float:
        return self.client.reload_s

    def generate(
        self, prompts: Sequence[Prompt], seed: int, sampling: SamplingConfig | None = None
    ) -> list[Sample]:
        sampling = sampling or self.sampling
        if sampling is None:
            raise ValueError("ServedGenerator.generate: pass sampling= (this generator has no default)")
        return self.client.generate(prompts, seed, sampling, self.policy_version)


def _connect(paths: ServicePaths, timeout_s: float) -> Connection | None:
    """A connection to the service's socket, or None when nothing answers the key challenge in time.

    `Client` has no timeout and a stopped (not dead) service would hold its handshake forever, so the
    attempt runs on a daemon thread that is abandoned on timeout.
    """
    if not paths.socket.exists():
        return None
    try:
        key = paths.authkey.read_bytes()
    except OSError:
        return None
    outcome: dict[str, Any] = {}

    def attempt() -> None:
        try:
            outcome["conn"] = Client(str(paths.socket), family="AF_UNIX", authkey=key)
        except (OSError, EOFError, AuthenticationError) as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=attempt, name="forge-engine-connect", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if "error" in outcome:
        log.debug("engine service %s: %r", paths.socket, outcome["error"])
    return outcome.get("conn")


def healthy_client(paths: ServicePaths, timeout_s: float = PING_TIMEOUT_S) -> EngineClient | None:
    """A client of the service recorded in `paths` if it is ready and answers a ping, else None."""
    record = read_record(paths)
    if record is None or record.status != READY or record.process() is None:
        return None
    conn = _connect(paths, timeout_s)
    if conn is None:
        return None
    client = EngineClient(conn, paths, {"pid": record.pid, "policy_version": ""})
    try:
        client.ping(timeout_s)
    except EngineServiceError as exc:
        log.warning("engine service pid %d does not answer: %s", record.pid, exc)
        client.close()
        return None
    return client


def _engine_identity(options: EngineOptions) -> dict:
    # The engine's own seed does not change samples (every request carries its seed), so a rollout (seeded
    # with the rollout seed) and an evaluation (the run's seed) can share one engine.
    return {k: v for k, v in options.to_dict().items() if k != "seed"}


def _incompatibility(info: dict, options: EngineOptions, num_engines: int, fingerprint: str) -> str | None:
    """Why a running service cannot serve this request (restart needed), or None."""
    if info.get("engine") != _engine_identity(options):
        return f"engine options {info.get('engine')} -> {_engine_identity(options)}"
    if info.get("num_engines") != num_engines:
        return f"num_engines {info.get('num_engines')} -> {num_engines}"
    if info.get("model_fingerprint") != fingerprint:
        return "another model architecture or tokenizer (config.json/tokenizer.json differ)"
    return None


class EngineService:
    """Starting, finding and stopping engine services (the module docstring has the whole picture)."""

    @staticmethod
    def ensure(
        state_dir: str | os.PathLike,
        rollout: RolloutConfig,
        policy_dir: str | os.PathLike,
        policy_version: str,
        *,
        name: str = DEFAULT_NAME,
        seed: int = 0,
        startup_timeout_s: float = 900.0,
    ) -> EngineClient:
        """A client of a ready service serving `policy_version`, starting (or restarting) it if needed.

        A service that does not answer a ping (dead, hung, or left half-started by a killed caller) is ended
        and its files cleaned; one started with other engine options or for another architecture is
        stopped and replaced. Start-up fails with EngineServiceError (the log tail inside) when the service
        dies or is not ready within `startup_timeout_s`, or with ValueError for a user error it reported.
        """
        paths = prepare_state_dir(state_dir, name)
        policy_dir = Path(policy_dir).absolute()
        options = EngineOptions.from_config(rollout, seed=seed)
        fingerprint = model_fingerprint(policy_dir)
        with _exclusive(paths.lock):
            client = healthy_client(paths)
            if client is not None:
                reason = _incompatibility(client.info, options, rollout.num_engines, fingerprint)
                if reason is not None:
                    log.warning("engine service pid %d is replaced: %s", client.pid, reason)
                    _stop_service(paths, client)
                    client = None
            if client is None:
                end_stale_service(paths)
                client = _start_service(
                    paths, options, rollout, policy_dir, policy_version, startup_timeout_s
                )
        client.load(policy_dir, policy_version)
        return client


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """Serialise start-ups of one service across processes (released if the holder dies)."""
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _owner() -> tuple[int, float]:
    """The process whose life bounds a service started now (module docstring: process ownership)."""
    launch_id = os.environ.get(LAUNCH_ID_ENV)
    if launch_id:
        owner = registry.launch_owner(launch_id)
        if owner is not None:
            return owner
        log.warning(
            "%s=%s has no launch registry record; the engine service will end with this process",
            LAUNCH_ID_ENV,
            launch_id,
        )
    this = psutil.Process()
    return this.pid, this.create_time()


def service_environment(launch_id: str) -> dict[str, str]:
    """Our environment minus what ties a process to the caller's launch, plus the service's own launch id."""
    env = {k: v for k, v in os.environ.items() if k not in (ERROR_FILE_ENV, LOG_PREFIX_TEMPLATE_ENV)}
    env[LAUNCH_ID_ENV] = launch_id
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _start_service(
    paths: ServicePaths,
    options: EngineOptions,
    rollout: RolloutConfig,
    policy_dir: Path,
    policy_version: str,
    startup_timeout_s: float,
) -> EngineClient:
    started = time.monotonic()
    launch_id = f"engine-{uuid.uuid4().hex[:16]}"
    owner_pid, owner_create_time = _owner()
    command = [
        sys.executable,
        "-m",
        MODULE,
        "--state-dir",
        str(paths.state_dir),
        "--name",
        paths.name,
        "--policy-dir",
        str(policy_dir),
        "--policy-version",
        policy_version,
        "--engine",
        json.dumps(options.to_dict()),
        "--num-engines",
        str(rollout.num_engines),
        "--sampling",
        json.dumps(dataclasses.asdict(rollout.sampling)),
        "--owner",
        f"{owner_pid}:{owner_create_time!r}",
    ]
    log_offset = paths.log.stat().st_size if paths.log.exists() else 0
    log_fd = os.open(paths.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(log_fd, "ab") as log_file:
        proc = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=service_environment(launch_id),
            # Its own session: signals to the caller's process group (Ctrl-C, a stage's kill) skip it.
            start_new_session=True,
        )
    _children[proc.pid] = proc
    log.info("engine service starting: pid %d, launch %s, log %s", proc.pid, launch_id, paths.log)
    try:
        client = _wait_ready(paths, proc, log_offset, started + startup_timeout_s, startup_timeout_s)
    except BaseException:
        _end_service_processes(psutil.Process(proc.pid), launch_id)  # our unreaped child: pid not reused
        raise
    client.startup_s = time.monotonic() - started
    log.info("engine service pid %d ready in %.1f s", proc.pid, client.startup_s)
    return client


def _wait_ready(
    paths: ServicePaths, proc: subprocess.Popen, log_offset: int, deadline: float, timeout_s: float
) -> EngineClient:
    while True:
        exited = proc.poll() is not None  # before reading the record: an exited service's record is final
        record = read_record(paths)
        mine = record is not None and record.pid == proc.pid
        if mine and record.status == FAILED and record.info.get("kind") == "user":
            raise ValueError(record.info["message"])
        if exited:
            raise EngineServiceError(
                f"engine service pid {proc.pid} exited with code {proc.returncode} while starting; its log "
                f"{paths.log} ends with:\n{log_tail(paths, log_offset)}"
            )
        if mine and record.status == READY:
            client = healthy_client(paths)
            if client is not None:
                return client
        if time.monotonic() > deadline:
            raise EngineServiceError(
                f"engine service pid {proc.pid} was not ready within {timeout_s:g} s; its log {paths.log} "
                f"ends with:\n{log_tail(paths, log_offset)}"
            )
        time.sleep(0.2)


def _reap_if_ours(pid: int) -> None:
    child = _children.get(pid)
    if child is not None and child.poll() is not None:
        _children.pop(pid, None)


def _end_service_processes(root: psutil.Process | None, launch_id: str, grace_s: float = 10.0) -> list[int]:
    """SIGTERM then SIGKILL the service process `root` and every process carrying its launch id (its vLLM
    processes, which outlive a SIGKILLed service); returns the pids that were still running."""
    targets = processes_with_launch_id(launch_id)
    if root is not None and root.pid not in {p.pid for p in targets}:
        targets.append(root)
    live = [p for p in targets if is_alive(p)]
    if live:
        end_processes(live, grace_s)
    if root is not None:
        _reap_if_ours(root.pid)
    return sorted(p.pid for p in live)


def end_stale_service(paths: ServicePaths, grace_s: float = 10.0) -> list[int]:
    """End whatever the record names (it does not answer: dead, hung or half-started) and clean its files."""
    record = read_record(paths)
    ended: list[int] = []
    if record is not None:
        proc = record.process()
        if proc is not None:
            log.warning("engine service pid %d does not answer; ending it", record.pid)
        ended = _end_service_processes(proc, record.launch_id, grace_s)
        with contextlib.suppress(OSError):
            registry.forget_launch(record.launch_id)
    paths.record.unlink(missing_ok=True)
    paths.socket.unlink(missing_ok=True)
    return ended


def _stop_service(paths: ServicePaths, client: EngineClient | None, grace_s: float = 30.0) -> list[int]:
    """Ask the service to shut down, wait `grace_s` for it to exit, then end what is left."""
    record = read_record(paths)
    asked = False
    if client is not None:
        with contextlib.suppress(EngineServiceError, OSError):
            client.shutdown()
            asked = True
    proc = record.process() if record is not None else None
    if proc is not None and asked:
        with contextlib.suppress(psutil.Error):
            _wait_exit(proc, grace_s)
    return sorted({*end_stale_service(paths, grace_s=5.0), *([record.pid] if record else [])})


def _wait_exit(proc: psutil.Process, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while is_alive(proc) and time.monotonic() < deadline:
        _reap_if_ours(proc.pid)
        time.sleep(0.1)
    _reap_if_ours(proc.pid)


def stop_services(state_dir: str | os.PathLike, grace_s: float = 30.0) -> list[int]:
    """Stop every engine service recorded under `state_dir`; returns the pids that were stopped or ended.

    Each gets a `shutdown` request, `grace_s` to exit, then SIGTERM/SIGKILL (with its vLLM processes);
    records, sockets and registry records are removed. A missing folder is fine (nothing to stop).
    """
    folder = Path(state_dir).expanduser().absolute()
    if not folder.is_dir():
        return []
    stopped: list[int] = []
    for record_file in sorted(folder.glob("*.json")):
        paths = ServicePaths(folder, record_file.stem)
        with _exclusive(paths.lock):
            client = healthy_client(paths, timeout_s=5.0)
            stopped += _stop_service(paths, client, grace_s)
    return sorted(set(stopped))


# ---- the service process ------------------------------------------------------------------------------


class _EngineState:
    """The generator and what it serves; `load` and `generate` run on the main thread only."""

    def __init__(self, generator, policy_dir: Path, policy_version: str, options: EngineOptions, num_engines):
        self.generator = generator
        self.policy_dir = policy_dir
        self.policy_version = policy_version
        self.options = options
        self.num_engines = num_engines
        self.fingerprint = model_fingerprint(policy_dir)
        self.started = time.monotonic()
        self.engine_startup_s = float(generator.startup_s)
        self.requests = 0

    def info(self) -> dict:
        return {
            "pid": os.getpid(),
            "launch_id": os.environ.get(LAUNCH_ID_ENV, ""),
            "policy_version": self.policy_version,
            "policy_dir": str(self.policy_dir),
            "uptime_s": time.monotonic() - self.started,
            "engine_startup_s": self.engine_startup_s,
            "engine": _engine_identity(self.options),
            "num_engines": self.num_engines,
            "model_fingerprint": self.fingerprint,
            "requests": self.requests,
        }

    def load(self, policy_dir: str, policy_version: str) -> dict:
        new_dir = Path(policy_dir)
        if policy_version == self.policy_version:
            reload_s = 0.0  # the version is the weights' checksum: these weights are loaded already
        else:
            reload_s = self.generator.reload(new_dir)
            log.info("loaded policy version %s from %s in %.3f s", policy_version[:16], new_dir, reload_s)
        self.policy_dir, self.policy_version = new_dir, policy_version
        return {"reload_s": reload_s, "info": self.info()}

    def generate(self, prompts, seed: int, sampling: SamplingConfig, expected_version: str) -> dict:
        if expected_version != self.policy_version:
            raise PolicyVersionMismatch(
                f"engine service pid {os.getpid()} serves policy version {self.policy_version[:16]} (from "
                f"{self.policy_dir}), but the request expects {expected_version[:16]}: load that version "
                "first (EngineService.ensure or client.load). If a stage saw this, another client loaded "
                "other weights in between: two runs sharing one rollout.engine_state_dir?"
            )
        samples = self.generator.generate(prompts, seed=seed, sampling=sampling)
        return {"samples": samples, "policy_version": self.policy_version}


@dataclass
class _Job:
    op: str
    kwargs: dict
    conn: Connection
    send_lock: threading.Lock
    done: threading.Event = dataclasses.field(default_factory=threading.Event)

    def reply(self, message: tuple) -> None:
        try:
            with self.send_lock:
                self.conn.send(message)
        except OSError:
            pass  # the client went away; its stage will see that itself
        finally:
            self.done.set()


def _error_reply(kind: str, exc: BaseException) -> tuple:
    return ("error", {"kind": kind, "message": str(exc), "traceback": traceback.format_exc(limit=20)})


def _execute(state: _EngineState, job: _Job) -> bool:
    """Run one engine request and reply; returns False when the service must exit afterwards."""
    if job.op == "shutdown":
        job.reply(("ok", {"pid": os.getpid()}))
        return False
    try:
        result = getattr(state, job.op)(**job.kwargs)
    except PolicyVersionMismatch as exc:
        job.reply(_error_reply("version", exc))
        return True
    except ValueError as exc:  # a bad request (prompt too long, other architecture): the engine is fine
        job.reply(_error_reply("user", exc))
        return True
    except Exception as exc:  # the engine may be broken: reply, then make way for a new one
        log.exception("engine request %r failed; the service exits", job.op)
        job.reply(_error_reply("engine", exc))
        return False
    state.requests += 1
    job.reply(("ok", result))
    return True


def _serve_connection(conn: Connection, state: _EngineState, jobs: queue.Queue) -> None:
    send_lock = threading.Lock()
    try:
        while True:
            op, kwargs = conn.recv()
            if op == "ping":
                with send_lock:
                    conn.send(("ok", state.info()))
            elif op in ("load", "generate", "shutdown"):
                job = _Job(op, kwargs, conn, send_lock)
                jobs.put(job)
                job.done.wait()
            else:
                with send_lock:
                    conn.send(
                        ("error", {"kind": "user", "message": f"unknown engine service request {op!r}"})
                    )
    except (EOFError, OSError):
        return  # the client disconnected
    finally:
        conn.close()


def _accept_connections(listener: Listener, state: _EngineState, jobs: queue.Queue) -> None:
    while True:
        try:
            conn = listener.accept()
        except AuthenticationError as exc:
            log.warning("refused a connection that failed the key challenge: %s", exc)
            continue
        except OSError:
            return  # the listener was closed: the service is exiting
        threading.Thread(
            target=_serve_connection, args=(conn, state, jobs), name="forge-engine-conn", daemon=True
        ).start()


def _run_jobs(state: _EngineState, jobs: queue.Queue) -> None:
    while True:
        try:
            job = jobs.get(timeout=0.5)  # a timeout keeps SIGTERM's handler responsive
        except queue.Empty:
            continue
        if not _execute(state, job):
            return


def _watch_owner(owner_pid: int, owner_create_time: float) -> None:
    """End this service (SIGTERM to ourselves: the normal clean-up) once the owning process is gone."""
    while True:
        try:
            owner = psutil.Process(owner_pid)
            alive = abs(owner.create_time() - owner_create_time) < _CREATE_TIME_TOLERANCE_S and is_alive(
                owner
            )
        except psutil.Error:
            alive = False
        if not alive:
            print(f"[forge.engine] owner pid {owner_pid} is gone; stopping", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        time.sleep(OWNER_POLL_S)


def _exit_on_sigterm(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one clean-up; a later SIGKILL ends a stuck one
    raise SystemExit(128 + signum)


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n\n")[0])
    parser.add_argument("--state-dir", required=True, help="folder of the socket, key, record and log")
    parser.add_argument("--name", default=DEFAULT_NAME, help="service name within the folder")
    parser.add_argument("--policy-dir", required=True, help="local HF policy folder to serve first")
    parser.add_argument("--policy-version", required=True, help="its version (policy.weights_version)")
    parser.add_argument("--engine", default="{}", help="EngineOptions as JSON")
    parser.add_argument("--num-engines", type=int, default=1)
    parser.add_argument("--sampling", default="{}", help="default SamplingConfig as JSON")
    parser.add_argument("--owner", default=None, help="pid:create_time of the owning process (exit with it)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Serve one engine until `shutdown`, SIGTERM, an engine failure or the owner's death (module docstring).

    Run by `EngineService.ensure`; by hand: `python -m forge_core.rollout.service --state-dir /tmp/eng
    --policy-dir ./policy --policy-version <sha256>` (then talk to it with `healthy_client(ServicePaths(...))`).
    """
    args = _parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.umask(0o077)  # the socket file too: this user only
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    launch_id = os.environ.setdefault(LAUNCH_ID_ENV, f"engine-{uuid.uuid4().hex[:16]}")  # vLLM's children too
    paths = prepare_state_dir(args.state_dir, args.name)
    owner = _parse_owner(args.owner)
    this = psutil.Process()
    record = ServiceRecord(
        pid=this.pid,
        create_time=this.create_time(),
        launch_id=launch_id,
        status=STARTING,
        owner_pid=owner[0] if owner else None,
        started_at=time.time(),
    )
    write_record(paths, record)
    registry.record_launch(launch_id, this.pid, MODULE, owner)
    if owner is not None:
        threading.Thread(target=_watch_owner, args=owner, name="forge-engine-owner", daemon=True).start()
    listener = None
    state = None
    try:
        state = _start_engine(args, paths, record)
        listener = Listener(str(paths.socket), family="AF_UNIX", authkey=paths.authkey.read_bytes())
        write_record(paths, dataclasses.replace(record, status=READY, info=state.info()))
        log.info("engine service ready on %s (pid %d)", paths.socket, this.pid)
        jobs: queue.Queue = queue.Queue()
        threading.Thread(
            target=_accept_connections, args=(listener, state, jobs), name="forge-engine-accept", daemon=True
        ).start()
        _run_jobs(state, jobs)
        return 0
    finally:
        _clean_up(paths, record, listener, state)


def _parse_owner(value: str | None) -> tuple[int, float] | None:
    if not value:
        return None
    pid, create_time = value.split(":", 1)
    return int(pid), float(create_time)


def _start_engine(args: argparse.Namespace, paths: ServicePaths, record: ServiceRecord) -> _EngineState:
    from forge_core.rollout.pool import open_generator

    options = EngineOptions(**json.loads(args.engine))
    sampling = SamplingConfig(**json.loads(args.sampling))
    policy_dir = Path(args.policy_dir)
    try:
        generator = open_generator(policy_dir, sampling, options, args.num_engines)
    except ValueError as exc:  # a user error: the client re-raises it as one (no retry)
        write_record(
            paths, dataclasses.replace(record, status=FAILED, info={"kind": "user", "message": str(exc)})
        )
        raise
    return _EngineState(generator, policy_dir, args.policy_version, options, args.num_engines)


def _clean_up(paths: ServicePaths, record: ServiceRecord, listener, state: _EngineState | None) -> None:
    if listener is not None:
        with contextlib.suppress(OSError):
            listener.close()  # also removes the socket file
    if state is not None:
        state.generator.close()
    current = read_record(paths)
    if current is not None and current.pid == record.pid and current.status != FAILED:
        paths.record.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        registry.forget_launch(record.launch_id)
    log.info("engine service pid %d stopped", record.pid)


if __name__ == "__main__":
    sys.exit(main())
