"""The caller's side of one engine service's channel: the socket, the key challenge, request and reply, and the
policy version every generate request carries.

    client = healthy_client(ServicePaths(state_dir, name))      # None when nothing ready answers
    client.reload(policy_dir, policy_version)                   # the version it expects from now on
    samples = client.generate(prompts, sampling, seed=7)        # the generation protocol (rollout/protocol.py)
    client.close()                                              # disconnects; the service keeps running

Starting, restarting and stopping services is supervision.py's; the package docstring has the whole picture.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import AuthenticationError, Client, Connection
from pathlib import Path
from typing import Any, Self

import psutil

from forge_core.config.schema import SamplingConfig
from forge_core.launch.process_tree import is_alive
from forge_core.rollout.protocol import PolicyVersionMismatch
from forge_core.rollout.service.state import (
    PING_TIMEOUT_S,
    READY,
    EngineServiceError,
    ServicePaths,
    log_tail,
    read_record,
)
from forge_core.rollout.types import Prompt, Sample

log = logging.getLogger(__name__)
# How often a client waiting for a reply checks that the service process still lives.
REPLY_POLL_S = 0.5


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
    """A connection to one engine service: an EngineConnection (forge_core.rollout.protocol). Not thread-safe:
    one request at a time per client.

    `policy_version` is the version this client expects: what the service served when the client connected,
    then what its own `reload` loaded. Every generate request carries it and the service refuses it
    (PolicyVersionMismatch) when it serves other weights, e.g. after another client loaded another version.
    """

    def __init__(
        self, conn: Connection, paths: ServicePaths, pid: int, process: psutil.Process | None = None
    ):
        self._conn = conn
        self.paths = paths
        self.pid = pid
        self.info: dict = {}  # the service's last ping (or reload) answer
        self.policy_version = ""
        # The service process (from its record): a reply never comes from a dead one, even if the socket
        # stays open.
        self._process = process
        # Seconds this client spent starting the service (0.0 when it found one running) and loading weights.
        self.startup_s = 0.0
        self.reload_s = 0.0

    @property
    def name(self) -> str:
        return self.paths.name

    def _call(self, op: str, timeout_s: float | None = None, **kwargs) -> Any:
        try:
            self._conn.send((op, kwargs))
            self._await_reply(op, timeout_s)
            status, payload = self._conn.recv()
        except (EOFError, OSError) as exc:
            raise EngineServiceError(
                f"engine service pid {self.pid} ({self.paths.socket}) went away during {op!r} ({exc!r}); "
                f"its log {self.paths.log} ends with:\n{log_tail(self.paths)}"
            ) from exc
        if status != "ok":
            _raise_reply_error(payload, self.pid, self.paths)
        return payload

    def _await_reply(self, op: str, timeout_s: float | None) -> None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._conn.poll(REPLY_POLL_S):
            if self._process is not None and not is_alive(self._process) and not self._conn.poll(0):
                raise EngineServiceError(
                    f"engine service {self.name} pid {self.pid} died during {op!r}; its log {self.paths.log} "
                    f"ends with:\n{log_tail(self.paths)}"
                )
            if deadline is not None and time.monotonic() > deadline:
                raise EngineServiceError(
                    f"engine service pid {self.pid} ({self.paths.socket}) did not answer {op!r} within "
                    f"{timeout_s:g} s"
                )

    def ping(self, timeout_s: float = PING_TIMEOUT_S) -> dict:
        """{pid, policy_version, uptime_s, policy_dir, engine, layout, model_fingerprint, busy, ...}"""
        self.info = self._call("ping", timeout_s=timeout_s)
        return self.info

    def reload(self, policy_dir: str | os.PathLike, policy_version: str) -> float:
        """Serve `policy_version` from `policy_dir` (weights reloaded in place; nothing to do when the service
        serves it already) and expect it from now on; returns the reload seconds."""
        reply = self._call("load", policy_dir=str(Path(policy_dir).absolute()), policy_version=policy_version)
        self.info = reply["info"]
        self.policy_version = self.info["policy_version"]  # what the service says it loaded
        self.reload_s = float(reply["reload_s"])
        return self.reload_s

    def generate(self, prompts: Sequence[Prompt], sampling: SamplingConfig, seed: int) -> list[Sample]:
        """`Generator.generate` in the service; PolicyVersionMismatch unless it serves `self.policy_version`."""
        reply = self._call(
            "generate",
            prompts=list(prompts),
            seed=seed,
            sampling=sampling,
            expected_version=self.policy_version,
        )
        assert reply["policy_version"] == self.policy_version, "the service checks the version first"
        return reply["samples"]

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
    process = record.process() if record is not None and record.status == READY else None
    if process is None:
        return None
    conn = _connect(paths, timeout_s)
    if conn is None:
        return None
    client = EngineClient(conn, paths, record.pid, process)
    try:
        client.policy_version = client.ping(timeout_s)["policy_version"]
    except EngineServiceError as exc:
        log.warning("engine service pid %d does not answer: %s", record.pid, exc)
        client.close()
        return None
    return client
