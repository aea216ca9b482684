"""A real `prefect server start`, its work pools, deployments and a process worker, for deployment-path tests.

Everything runs as separate processes, as on a cluster: the server and the worker each in their own session
(process group), so that teardown can end each whole group. torchrun starts its ranks in sessions of their
own, which a process-group kill misses; `ProcessKeeper` therefore also records every descendant it sees while
the test runs, and reports (then kills) any that outlive the orderly stop.

    def test_x(local_prefect):               # server up, healthy, API URL in local_prefect.api_url
        local_prefect.cli("forgeflow", "pools", "create", "local-cpu")
        worker = local_prefect.start_worker("local-cpu")
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
SERVER_STARTUP_TIMEOUT_S = 180.0
GRACEFUL_STOP_S = 20.0
SAMPLE_EVERY_S = 0.5


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def tail(path: Path, lines: int = 60) -> str:
    if not path.exists():
        return f"({path} does not exist)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


@dataclass
class SeenProcess:
    pid: int
    create_time: float
    cmdline: str

    def still_running(self) -> bool:
        """Alive and the same process (not a reused pid); a zombie counts as gone."""
        try:
            proc = psutil.Process(self.pid)
            return proc.create_time() == self.create_time and proc.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False


@dataclass
class Started:
    name: str
    popen: subprocess.Popen
    log_path: Path


@dataclass
class ProcessKeeper:
    """Starts processes in their own sessions, watches all their descendants, stops them all."""

    log_dir: Path
    started: list[Started] = field(default_factory=list)
    seen: dict[tuple[int, float], SeenProcess] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop_watching: threading.Event = field(default_factory=threading.Event)
    _watcher: threading.Thread | None = None

    def start(self, name: str, argv: list[str], env: dict[str, str], cwd: Path) -> Started:
        log_path = self.log_dir / f"{name}.log"
        with log_path.open("wb") as log_file:
            popen = subprocess.Popen(
                argv,
                env=env,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        started = Started(name, popen, log_path)
        self.started.append(started)
        self._record_tree(popen.pid)
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch, name="process-keeper", daemon=True)
            self._watcher.start()
        return started

    def _record_tree(self, root_pid: int) -> None:
        try:
            root = psutil.Process(root_pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        for proc in procs:
            try:
                record = SeenProcess(proc.pid, proc.create_time(), " ".join(proc.cmdline()))
            except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
                continue
            with self._lock:
                # The latest command line: a process first seen between its fork and its exec (a launcher's
                # child) shows its parent's until the exec, however briefly.
                self.seen[(record.pid, record.create_time)] = record

    def _watch(self) -> None:
        while not self._stop_watching.wait(SAMPLE_EVERY_S):
            for started in list(self.started):
                if started.popen.poll() is None:
                    self._record_tree(started.popen.pid)

    def seen_matching(self, fragment: str) -> list[SeenProcess]:
        with self._lock:
            return [p for p in self.seen.values() if fragment in p.cmdline]

    def stop(self, started: Started) -> None:
        """SIGTERM the process group, wait, then SIGKILL it. Prefect's worker turns the first SIGTERM into a
        graceful SIGINT (finish running flow runs); a second signal would be a kill, hence the group kill."""
        self._record_tree(started.popen.pid)
        _signal_group(started.popen.pid, signal.SIGTERM)
        try:
            started.popen.wait(timeout=GRACEFUL_STOP_S)
        except subprocess.TimeoutExpired:
            pass
        _signal_group(started.popen.pid, signal.SIGKILL)
        started.popen.wait(timeout=30)

    def stop_all(self) -> None:
        """Stop in reverse start order (the worker before the server it talks to)."""
        for started in reversed(self.started):
            if started.popen.returncode is None:
                self.stop(started)
        self._stop_watching.set()

    def survivors(self) -> list[SeenProcess]:
        with self._lock:
            return [p for p in self.seen.values() if p.still_running()]

    def kill_survivors(self) -> None:
        for proc in self.survivors():
            try:
                psutil.Process(proc.pid).kill()
            except psutil.NoSuchProcess:
                continue


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        pass


def isolated_prefect_env(home: Path, port: int) -> dict[str, str]:
    """This environment without any PREFECT_*, FORGEFLOW_* or fault-injection setting, plus a private
    server's settings. FORGEFLOW_HOME is left to the worker (see start_worker)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "FORGEFLOW_", "FORGE_FAULT"))}
    api_url = f"http://127.0.0.1:{port}/api"
    env.update(
        PATH=f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}",
        PREFECT_HOME=str(home),
        PREFECT_API_URL=api_url,
        PREFECT_UI_API_URL=api_url,
        PREFECT_SERVER_API_HOST="127.0.0.1",
        PREFECT_SERVER_API_PORT=str(port),
        PREFECT_API_DATABASE_CONNECTION_URL=f"sqlite+aiosqlite:///{home}/prefect.db",
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_LOGGING_LEVEL="INFO",
        # The worker's default 10 s poll would add up to 10 s of idle time to the test.
        PREFECT_WORKER_QUERY_SECONDS="2",
    )
    return env


@dataclass
class LocalPrefect:
    """A running `prefect server start` and helpers to drive it like an operator would."""

    keeper: ProcessKeeper
    env: dict[str, str]
    api_url: str
    server: Started

    def cli(self, program: str, *args: str, timeout_s: float = 180.0) -> subprocess.CompletedProcess:
        """Run `.venv/bin/<program> args...` from the repo root; fail the test with its output if it fails."""
        executable = VENV_BIN / program
        if not executable.exists():
            pytest.fail(f"{executable} is missing: install the project into the venv (pip install -e .)")
        done = subprocess.run(
            [str(executable), *args],
            check=False,
            env=self.env,
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if done.returncode != 0:
            command = " ".join([program, *args])
            pytest.fail(f"`{command}` exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
        return done

    def start_worker(self, pool: str, cwd: Path) -> Started:
        """A process worker with FORGEFLOW_HOME set, as on a cluster node: deployments made without it
        take the checkout's path from the worker's environment at run time."""
        env = {**self.env, "FORGEFLOW_HOME": str(REPO_ROOT)}
        return self.keeper.start(
            f"worker-{pool}", [str(VENV_BIN / "prefect"), "worker", "start", "--pool", pool], env, cwd
        )

    def api(self, coroutine_fn):
        """Run `await coroutine_fn(client)` against this server with a fresh client."""
        from prefect.client.orchestration import PrefectClient

        async def call():
            async with PrefectClient(api=self.api_url) as client:
                return await coroutine_fn(client)

        return asyncio.run(call())


def wait_until_healthy(server: Started, api_url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.popen.poll() is not None:
            pytest.fail(f"prefect server exited {server.popen.returncode}:\n{tail(server.log_path)}")
        try:
            with urllib.request.urlopen(f"{api_url}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1.0)
    pytest.fail(f"prefect server not healthy after {timeout_s:.0f}s:\n{tail(server.log_path)}")


@pytest.fixture
def process_keeper(tmp_path):
    keeper = ProcessKeeper(log_dir=tmp_path)
    yield keeper
    # Whatever the test did or did not check, nothing it started may outlive it.
    keeper.stop_all()
    keeper.kill_survivors()


@pytest.fixture
def local_prefect(process_keeper, tmp_path) -> LocalPrefect:
    port = free_port()
    home = tmp_path / "prefect-home"
    home.mkdir()
    env = isolated_prefect_env(home, port)
    server = process_keeper.start(
        "server",
        [str(VENV_BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env,
        tmp_path,
    )
    api_url = env["PREFECT_API_URL"]
    wait_until_healthy(server, api_url, SERVER_STARTUP_TIMEOUT_S)
    return LocalPrefect(process_keeper, env, api_url, server)
