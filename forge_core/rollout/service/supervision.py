"""Supervising engine services: starting, waiting for ready, restarting, stopping them, and their state folder.

    client = EngineService.ensure(state_dir, cfg.rollout, policy_dir, policy_version)   # one EngineClient
    router = EngineService.ensure_engines(state_dir, cfg.rollout, policy_dir, version)  # num_engines, routed
    samples = router.generate(prompts, cfg.rollout.sampling, seed=7)
    router.close()                                   # disconnects; the services keep running
    stop_services(state_dir)                         # the flow, at its end and on failure/cancellation

The channel to one service is connection.py's; the package docstring has the whole picture.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import psutil

from forge_core.config.schema import RolloutConfig
from forge_core.launch import registry
from forge_core.launch.devices import DeviceLease
from forge_core.launch.owner import OWNER_ENV, Owner, owner_from_environment
from forge_core.launch.process_tree import end_processes, is_alive, processes_with_launch_id
from forge_core.launch.spec import ERROR_FILE_ENV, LAUNCH_ID_ENV, LOG_PREFIX_TEMPLATE_ENV
from forge_core.rollout.engine import EngineOptions, on_cpu
from forge_core.rollout.generator import model_fingerprint
from forge_core.rollout.pool import ReplicaLayout, replica_layouts
from forge_core.rollout.protocol import PolicyVersionMismatch
from forge_core.rollout.router import EngineRouter
from forge_core.rollout.service.connection import EngineClient, healthy_client
from forge_core.rollout.service.state import (
    DEFAULT_NAME,
    FAILED,
    MODULE,
    PING_TIMEOUT_S,
    READY,
    EngineServiceError,
    ServicePaths,
    engine_identity,
    log_tail,
    prepare_state_dir,
    read_record,
)

log = logging.getLogger(__name__)
# Between the SIGTERM and the SIGKILL of a service that did not stop when asked.
KILL_GRACE_S = 2.0

# Services this process started: kept so their exit status is collected (no zombies while we live).
_children: dict[int, subprocess.Popen] = {}


def layout_record(layout: ReplicaLayout | None) -> dict:
    """What a service is told (`--layout`) and reports (`info["layout"]`) about its share of the machine."""
    if layout is None:
        return {"env": {}, "cpus": None}
    return {"env": dict(layout.env), "cpus": None if layout.cpus is None else list(layout.cpus)}


def _incompatibility(info: dict, options: EngineOptions, layout: dict, fingerprint: str) -> str | None:
    """Why a running service cannot serve this request (restart needed), or None."""
    if info.get("engine") != engine_identity(options):
        return f"engine options {info.get('engine')} -> {engine_identity(options)}"
    if info.get("layout") != layout:
        return f"layout {info.get('layout')} -> {layout}"
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
        layout: ReplicaLayout | None = None,
    ) -> EngineClient:
        """A client of a ready service `name` (one engine) serving `policy_version`, starting (or restarting)
        it if needed. `layout` confines the engine to a share of the machine (one of several engines);
        `rollout.num_engines` is `ensure_engines`' business.

        A service that does not answer a ping (dead, hung, or left half-started by a killed caller) is ended
        and its files cleaned; one started with other engine options or for another architecture is
        stopped and replaced. Start-up fails with EngineServiceError (the log tail inside) when the service
        dies or is not ready within `startup_timeout_s`, or with ValueError for a user error it reported.
        """
        paths = prepare_state_dir(state_dir, name)
        policy_dir = Path(policy_dir).absolute()
        options = EngineOptions.from_config(rollout, seed=seed)
        fingerprint = model_fingerprint(policy_dir)
        share = layout_record(layout)
        with _exclusive(paths.lock):
            client = healthy_client(paths)
            if client is not None:
                reason = _incompatibility(client.info, options, share, fingerprint)
                if reason is not None:
                    log.warning("engine service pid %d is replaced: %s", client.pid, reason)
                    _stop_service(paths, client)
                    client = None
            if client is None:
                end_stale_service(paths)
                client = _start_service(
                    paths, options, rollout, share, policy_dir, policy_version, startup_timeout_s
                )
        client.reload(policy_dir, policy_version)
        return client

    @staticmethod
    def ensure_engines(
        state_dir: str | os.PathLike,
        rollout: RolloutConfig,
        policy_dir: str | os.PathLike,
        policy_version: str,
        *,
        seed: int = 0,
        startup_timeout_s: float = 900.0,
    ) -> EngineRouter:
        """`rollout.num_engines` ready services serving `policy_version`, behind one EngineRouter.

        One engine is service `rollout`; N > 1 are `engine-0` .. `engine-<N-1>`, each on its own cores (CPU)
        or GPUs (pool.replica_layouts, as the stage-lifetime pool splits them), started (or restarted: a dead
        one from an earlier stage) concurrently. Services of the folder with other names (another
        num_engines before) are stopped: their cores belong to these now.
        """
        names = engine_names(rollout.num_engines)
        layouts: list[ReplicaLayout | None] = [None] * len(names)
        if len(names) > 1 and on_cpu():  # on GPU each service takes its own devices as it starts
            layouts = replica_layouts(EngineOptions.from_config(rollout, seed=seed), len(names))
        _stop_services_except(Path(state_dir).expanduser().absolute(), set(names))

        def ensure_one(name: str, layout: ReplicaLayout | None) -> EngineClient:
            return EngineService.ensure(
                state_dir,
                rollout,
                policy_dir,
                policy_version,
                name=name,
                seed=seed,
                startup_timeout_s=startup_timeout_s,
                layout=layout,
            )

        with ThreadPoolExecutor(len(names), thread_name_prefix="forge-engine-ensure") as pool:
            futures = [pool.submit(ensure_one, name, layout) for name, layout in zip(names, layouts)]
            wait(futures)
        clients = [f.result() for f in futures if f.exception() is None]
        failure = next((f.exception() for f in futures if f.exception() is not None), None)
        if failure is not None:
            for client in clients:
                client.close()
            raise failure
        router = EngineRouter(clients)
        if router.policy_version != policy_version:  # every engine reports what it loaded
            router.close()
            raise PolicyVersionMismatch(
                f"engines {router.names} loaded {router.policy_version[:16]}, expected {policy_version[:16]}"
            )
        return router


def engine_names(num_engines: int) -> list[str]:
    """The service names of a flow's `num_engines` engines (EngineService.ensure_engines)."""
    if num_engines < 1:
        raise ValueError(f"rollout.num_engines={num_engines}: must be >= 1")
    return [DEFAULT_NAME] if num_engines == 1 else [f"engine-{i}" for i in range(num_engines)]


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """Serialise start-ups of one service across processes (released if the holder dies)."""
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _owner() -> Owner:
    """The process whose life bounds a service started now (package docstring: process ownership): the
    launcher of this worker (FORGE_LAUNCH_OWNER), else this process."""
    return owner_from_environment() or Owner.this_process()


def service_environment(launch_id: str, owner: Owner) -> dict[str, str]:
    """Our environment minus what ties a process to the caller's launch, plus the service's own launch id
    and owner."""
    env = {k: v for k, v in os.environ.items() if k not in (ERROR_FILE_ENV, LOG_PREFIX_TEMPLATE_ENV)}
    env[LAUNCH_ID_ENV] = launch_id
    env[OWNER_ENV] = str(owner)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _start_service(
    paths: ServicePaths,
    options: EngineOptions,
    rollout: RolloutConfig,
    layout: dict,
    policy_dir: Path,
    policy_version: str,
    startup_timeout_s: float,
) -> EngineClient:
    started = time.monotonic()
    launch_id = f"engine-{uuid.uuid4().hex[:16]}"
    owner = _owner()
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
        "--layout",
        json.dumps(layout),
        "--owner",
        str(owner),
    ]
    log_offset = paths.log.stat().st_size if paths.log.exists() else 0
    env = service_environment(launch_id, owner)
    # A long-lived engine must not share a GPU with the stages launched beside it (the trainer job takes its
    # devices the same way): the service holds its devices' locks for as long as it lives.
    devices = None
    if not on_cpu():
        devices = DeviceLease.acquire(options.tensor_parallel_size, holder=f"engine service {paths.name}")
        env["CUDA_VISIBLE_DEVICES"] = devices.visible
    log_fd = os.open(paths.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        with os.fdopen(log_fd, "ab") as log_file:
            proc = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=env,
                # Its own session: signals to the caller's process group (Ctrl-C, a stage's kill) skip it.
                start_new_session=True,
                pass_fds=devices.fds if devices is not None else (),
            )
    finally:
        if devices is not None:
            devices.hand_over()
    _children[proc.pid] = proc
    log.info("engine service starting: pid %d, launch %s, log %s", proc.pid, launch_id, paths.log)
    try:
        client = _wait_ready(paths, proc, log_offset, started + startup_timeout_s, startup_timeout_s)
    except BaseException:
        # Our child, unreaped while poll() is None: its pid is not reused. An exited one has only vLLM's
        # processes left (if any), found by launch id.
        _end_service_processes(psutil.Process(proc.pid) if proc.poll() is None else None, launch_id)
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
    """Ask the service to shut down and give it `grace_s` in all (the reply and its exit), then end what is
    left (SIGTERM, KILL_GRACE_S, SIGKILL): done within about grace_s + KILL_GRACE_S."""
    deadline = time.monotonic() + grace_s
    record = read_record(paths)
    asked = False
    if client is not None:
        with contextlib.suppress(EngineServiceError, OSError):
            client.shutdown(timeout_s=max(0.1, deadline - time.monotonic()))
            asked = True
    proc = record.process() if record is not None else None
    if proc is not None and asked:
        with contextlib.suppress(psutil.Error):
            _wait_exit(proc, deadline - time.monotonic())
    return sorted({*end_stale_service(paths, grace_s=KILL_GRACE_S), *([record.pid] if record else [])})


def _wait_exit(proc: psutil.Process, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while is_alive(proc) and time.monotonic() < deadline:
        _reap_if_ours(proc.pid)
        time.sleep(0.1)
    _reap_if_ours(proc.pid)


def stop_services(state_dir: str | os.PathLike, grace_s: float = 30.0) -> list[int]:
    """Stop every engine service recorded under `state_dir`; returns the pids that were stopped or ended.

    Each gets a `shutdown` request and `grace_s` in all to answer and exit, then SIGTERM and, KILL_GRACE_S
    later, SIGKILL (with its vLLM processes); all concurrently, so this ends within about grace_s +
    KILL_GRACE_S. Records, sockets and registry records are removed. A missing folder is fine.
    """
    return _stop_services_except(Path(state_dir).expanduser().absolute(), set(), grace_s)


def _stop_services_except(folder: Path, keep: set[str], grace_s: float = 30.0) -> list[int]:
    if not folder.is_dir():
        return []
    names = sorted(f.stem for f in folder.glob("*.json") if f.stem not in keep)
    if not names:
        return []

    def stop(name: str) -> list[int]:
        paths = ServicePaths(folder, name)
        started = time.monotonic()
        with _exclusive(paths.lock):
            client = healthy_client(paths, timeout_s=min(PING_TIMEOUT_S, grace_s))
            return _stop_service(paths, client, max(0.0, grace_s - (time.monotonic() - started)))

    # Concurrently: a flow with N engines (or a cancelled one) waits for the slowest, not for the sum.
    with ThreadPoolExecutor(len(names), thread_name_prefix="forge-engine-stop") as pool:
        stopped = [pid for pids in pool.map(stop, names) for pid in pids]
    return sorted(set(stopped))
