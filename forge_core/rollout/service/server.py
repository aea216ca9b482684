"""The engine service process: one vLLM `Generator` behind a Unix socket, until shutdown or its owner's end.

    python -m forge_core.rollout.service --state-dir D --policy-dir P --policy-version V ...

(what `EngineService.ensure` runs; the package docstring has the whole picture.)

Stopping: a `shutdown` request, SIGTERM or its owner's death (forge_core.launch.owner, checked every
OWNER_POLL_S = 1 s, then a SIGTERM to itself) runs the clean-up (engine closed, socket, record and registry
record removed). A clean-up still running STOP_GRACE_S after a SIGTERM, or a second SIGTERM, ends in SIGKILL of
the service and every process carrying its launch id (its vLLM processes): a SIGTERMed service is gone
within STOP_GRACE_S.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import queue
import signal
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, Listener
from pathlib import Path

import psutil

from forge_core.artifacts.policy import PolicyLease
from forge_core.config.schema import SamplingConfig
from forge_core.launch import registry
from forge_core.launch.owner import Owner, watch_owner
from forge_core.launch.process_tree import processes_with_launch_id
from forge_core.launch.spec import LAUNCH_ID_ENV
from forge_core.rollout.engine import EngineOptions
from forge_core.rollout.generator import model_fingerprint
from forge_core.rollout.protocol import PolicyVersionMismatch
from forge_core.rollout.service.listener import BACKLOG, serve_connections
from forge_core.rollout.service.state import (
    DEFAULT_NAME,
    FAILED,
    MODULE,
    READY,
    STARTING,
    STOP_GRACE_S,
    ServicePaths,
    ServiceRecord,
    engine_identity,
    prepare_state_dir,
    read_record,
    write_record,
)

log = logging.getLogger(__name__)


class _EngineState:
    """The generator and what it serves; `load` and `generate` run on the main thread only."""

    def __init__(
        self, generator, policy_dir: Path, policy_version: str, options: EngineOptions, layout: dict
    ):
        self.generator = generator
        self.policy_dir = policy_dir
        self.lease = PolicyLease(policy_dir)  # the policy cache keeps what we serve (an engine restart reads it)
        self.policy_version = policy_version
        self.options = options
        self.layout = layout
        self.fingerprint = model_fingerprint(policy_dir)
        self.started = time.monotonic()
        self.engine_startup_s = float(generator.startup_s)
        self.requests = 0
        self.busy: str | None = None  # the engine request in progress (ping answers while one runs)

    def info(self) -> dict:
        return {
            "pid": os.getpid(),
            "launch_id": os.environ.get(LAUNCH_ID_ENV, ""),
            "policy_version": self.policy_version,
            "policy_dir": str(self.policy_dir),
            "uptime_s": time.monotonic() - self.started,
            "engine_startup_s": self.engine_startup_s,
            "engine": engine_identity(self.options),
            "layout": self.layout,
            "model_fingerprint": self.fingerprint,
            "requests": self.requests,
            "busy": self.busy,
        }

    def load(self, policy_dir: str, policy_version: str) -> dict:
        new_dir = Path(policy_dir)
        lease = PolicyLease(new_dir)
        reload_s = self.generator.reload(new_dir, policy_version)  # 0.0 for the version already served
        if policy_version != self.policy_version:
            log.info("loaded policy version %s from %s in %.3f s", policy_version[:16], new_dir, reload_s)
        self.lease.release()
        self.policy_dir, self.policy_version, self.lease = new_dir, policy_version, lease
        return {"reload_s": reload_s, "info": self.info()}

    def generate(self, prompts, seed: int, sampling: SamplingConfig, expected_version: str) -> dict:
        if expected_version != self.policy_version:
            raise PolicyVersionMismatch(
                f"engine service pid {os.getpid()} serves policy version {self.policy_version[:16]} (from "
                f"{self.policy_dir}), but the request expects {expected_version[:16]}: load that version "
                "first (EngineService.ensure or client.load). If a stage saw this, another client loaded "
                "other weights in between: two runs sharing one rollout.engine_state_dir?"
            )
        samples = self.generator.generate(prompts, sampling, seed)
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
    state.busy = job.op
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
    finally:
        state.busy = None
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


def _accept_connections(listener: Listener, authkey: bytes, state: _EngineState, jobs: queue.Queue) -> None:
    # Returns when the listener is closed: the service is exiting.
    serve_connections(listener, authkey, lambda conn: _serve_connection(conn, state, jobs))


def _run_jobs(state: _EngineState, jobs: queue.Queue) -> None:
    while True:
        try:
            job = jobs.get(timeout=0.5)  # a timeout keeps SIGTERM's handler responsive
        except queue.Empty:
            continue
        if not _execute(state, job):
            return


def _stop_when_owner_is_gone(owner: Owner) -> None:
    print(f"[forge.engine] owner pid {owner.pid} is gone; stopping", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)  # the normal clean-up, bounded like any SIGTERM


def _kill_own_tree(why: str) -> None:
    """SIGKILL every process of this service (its vLLM processes carry its FORGE_LAUNCH_ID), then itself."""
    others = processes_with_launch_id(os.environ.get(LAUNCH_ID_ENV, ""))
    print(
        f"[forge.engine] {why}: SIGKILL of pids {sorted(p.pid for p in others)} and {os.getpid()}",
        file=sys.stderr,
        flush=True,
    )
    for proc in others:
        with contextlib.suppress(psutil.Error):
            proc.send_signal(signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


class _SigtermPolicy:
    """SIGTERM handling (module docstring): the first SIGTERM raises SystemExit on the main thread (the
    clean-up) and starts a STOP_GRACE_S timer that ends in SIGKILL of the tree; a second SIGTERM kills the tree
    at once. Signals are counted on a thread of their own, woken through `signal.set_wakeup_fd`, so the bound
    holds even when the main thread is stuck in a C call (a wedged engine) and never runs a Python handler."""

    def __init__(self) -> None:
        self.received = 0
        self._exiting = False

    def install(self) -> None:
        """Main thread only (set_wakeup_fd)."""
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        signal.signal(signal.SIGTERM, self._exit_main_thread)
        signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        threading.Thread(target=self._count, args=(read_fd,), name="forge-engine-sigterm", daemon=True).start()

    def _exit_main_thread(self, signum, frame) -> None:
        if not self._exiting:  # one clean-up; the counting thread escalates
            self._exiting = True
            raise SystemExit(128 + signum)

    def _count(self, read_fd: int) -> None:
        while True:
            for signum in os.read(read_fd, 64):
                if signum == signal.SIGTERM:
                    self._on_sigterm()

    def _on_sigterm(self) -> None:
        self.received += 1
        if self.received > 1:
            _kill_own_tree("SIGTERM again during the clean-up")
        print(
            f"[forge.engine] SIGTERM: stopping (SIGKILL of the service's processes after {STOP_GRACE_S:g} s, "
            "or at a second SIGTERM)",
            file=sys.stderr,
            flush=True,
        )
        timer = threading.Timer(
            STOP_GRACE_S, _kill_own_tree, args=(f"still stopping {STOP_GRACE_S:g} s after SIGTERM",)
        )
        timer.daemon = True
        timer.start()


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n\n")[0])
    parser.add_argument("--state-dir", required=True, help="folder of the socket, key, record and log")
    parser.add_argument("--name", default=DEFAULT_NAME, help="service name within the folder")
    parser.add_argument("--policy-dir", required=True, help="local HF policy folder to serve first")
    parser.add_argument("--policy-version", required=True, help="its version (policy.weights_version)")
    parser.add_argument("--engine", default="{}", help="EngineOptions as JSON")
    parser.add_argument(
        "--layout",
        default='{"env": {}, "cpus": null}',
        help="this engine's share of the machine as JSON: extra environment and CPU list (pool.ReplicaLayout)",
    )
    parser.add_argument("--owner", default=None, help="pid:create_time of the owning process (exit with it)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Serve one engine until `shutdown`, SIGTERM, an engine failure or the owner's death (module docstring).

    Run by `EngineService.ensure`; by hand: `python -m forge_core.rollout.service --state-dir /tmp/eng
    --policy-dir ./policy --policy-version <sha256>` (then talk to it with `healthy_client(ServicePaths(...))`, service/connection.py).
    """
    args = _parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.umask(0o077)  # the socket file too: this user only
    _SigtermPolicy().install()
    launch_id = os.environ.setdefault(LAUNCH_ID_ENV, f"engine-{uuid.uuid4().hex[:16]}")  # vLLM's children too
    paths = prepare_state_dir(args.state_dir, args.name)
    owner = Owner.parse(args.owner, "--owner") if args.owner else None
    this = psutil.Process()
    record = ServiceRecord(
        pid=this.pid,
        create_time=this.create_time(),
        launch_id=launch_id,
        status=STARTING,
        owner_pid=owner.pid if owner else None,
        started_at=time.time(),
    )
    write_record(paths, record)
    registry.record_launch(launch_id, this.pid, MODULE, (owner.pid, owner.create_time) if owner else None)
    if owner is not None:
        watch_owner(owner, lambda: _stop_when_owner_is_gone(owner), name="forge-engine-owner")
    listener = None
    state = None
    try:
        state = _start_engine(args, paths, record)
        listener = Listener(str(paths.socket), family="AF_UNIX", backlog=BACKLOG)
        write_record(paths, dataclasses.replace(record, status=READY, info=state.info()))
        log.info("engine service ready on %s (pid %d)", paths.socket, this.pid)
        jobs: queue.Queue = queue.Queue()
        threading.Thread(
            target=_accept_connections,
            args=(listener, paths.authkey.read_bytes(), state, jobs),
            name="forge-engine-accept",
            daemon=True,
        ).start()
        _run_jobs(state, jobs)
        return 0
    finally:
        _clean_up(paths, record, listener, state)


def _start_engine(args: argparse.Namespace, paths: ServicePaths, record: ServiceRecord) -> _EngineState:
    from forge_core.rollout.generator import Generator
    from forge_core.rollout.pool import ReplicaLayout

    options = EngineOptions(**json.loads(args.engine))
    policy_dir = Path(args.policy_dir)
    layout = json.loads(args.layout)
    cpus = layout.get("cpus")
    # Before vLLM starts: an engine of several (flow lifetime, num_engines > 1) keeps to its own cores/GPUs.
    ReplicaLayout(options, layout.get("env") or {}, None if cpus is None else tuple(cpus)).apply()
    try:
        generator = Generator(policy_dir, options, policy_version=args.policy_version)
    except ValueError as exc:  # a user error: the client re-raises it as one (no retry)
        write_record(
            paths, dataclasses.replace(record, status=FAILED, info={"kind": "user", "message": str(exc)})
        )
        raise
    return _EngineState(generator, policy_dir, args.policy_version, options, layout)


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
