"""Warm starts for node runs: a flow run process forked from an interpreter that already imported Prefect, the
stage-node flow and torch, instead of a new `python -m prefect.engine` that imports them again (seconds per
placed stage; docs/architecture.md, "Placement on pools").

    python -m flows.warm_start serve SOCKET      # the node's zygote (flows.node_worker starts one per worker)
    python -m flows.warm_start                   # a flow run's command: the engine, forked by the zygote

Two processes with one job each:
- The zygote, a child of the worker: imports PRELOAD once, then, single-threaded, forks one child per request.
  The child takes the client's stdin/stdout/stderr (passed over the socket), its working folder and its whole
  environment, and runs `prefect.engine` as `__main__`, exactly what `python -m prefect.engine` runs. The zygote
  reports the child's exit status; a client that disappears (SIGKILLed) takes its child with it. It exits when
  its worker does.
- The client, the process Prefect's runner starts, watches and signals (its command is the job's `command`):
  it imports nothing but the standard library, hands itself to the zygote, forwards SIGTERM and SIGINT to the
  child, and exits with the child's status (a signal as the same signal). With no zygote (not started yet, or
  gone) it becomes `python -m prefect.engine` itself: a warm start is an optimisation, never a dependency.

The socket sits in a private (0700) folder and the zygote serves only its own user (SO_PEERCRED): a request
runs code as the worker's user.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import socket
import struct
import sys

SOCKET_ENV = "FORGE_WARM_START_SOCKET"  # the worker sets it for its runs; unset or absent: a cold start
ENGINE_ARGV = ("-m", "prefect.engine")
# Imported once by the zygote: what every node run needs before its first line of forgeflow code.
# (Not prefect.engine itself: the child runs it as __main__, and runpy warns about a module already imported.)
PRELOAD = ("prefect.flow_engine", "flows.stage_deployment", "torch")
_POLL_S = 0.05  # the zygote's tick: reaping children, noticing its worker's exit
_HEADER = struct.Struct("!I")
_STDIO = (0, 1, 2)


# ---- the client ---------------------------------------------------------------------------------------------


def _cold_start() -> None:
    os.execv(sys.executable, [sys.executable, *ENGINE_ARGV])


def _send_request(conn: socket.socket) -> None:
    body = json.dumps({"cwd": os.getcwd(), "env": dict(os.environ)}).encode()
    socket.send_fds(conn, [_HEADER.pack(len(body))], list(_STDIO))
    conn.sendall(body)


def _read_line(conn: socket.socket) -> str | None:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(64)
        if not chunk:
            return None
        data += chunk
    return data.decode().strip()


def _exit_like(status: int) -> None:
    """Exit with the child's status as Prefect's runner would have seen it from the engine process."""
    if status < 0:
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    os._exit(status if status >= 0 else 128 - status)


def client_main() -> None:
    path = os.environ.get(SOCKET_ENV, "")
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
        _send_request(conn)
        started = _read_line(conn)
    except OSError:
        started = None
    if not started or not started.startswith("pid "):
        conn.close()
        _cold_start()
    child = int(started.split()[1])

    def forward(signum, _frame):
        try:
            os.kill(child, signum)
        except ProcessLookupError:
            pass

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, forward)
    ended = _read_line(conn)
    # The zygote is gone (its worker died): the child was its, so report a crash, as a vanished engine would.
    _exit_like(int(ended.split()[1]) if ended and ended.startswith("exit ") else 1)


# ---- the zygote ---------------------------------------------------------------------------------------------


def _recv_request(conn: socket.socket) -> tuple[dict, list[int]]:
    header, fds, _flags, _addr = socket.recv_fds(conn, _HEADER.size, len(_STDIO))
    if len(header) != _HEADER.size or len(fds) != len(_STDIO):
        for fd in fds:
            os.close(fd)
        raise ConnectionError("a malformed warm-start request")
    (size,) = _HEADER.unpack(header)
    body = b""
    while len(body) < size:
        chunk = conn.recv(min(size - len(body), 1 << 16))
        if not chunk:
            raise ConnectionError("the client left mid-request")
        body += chunk
    return json.loads(body), fds


def _same_user(conn: socket.socket) -> bool:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid == os.getuid()


def _run_engine() -> int:
    """In the forked child: `python -m prefect.engine`, with settings read from this run's environment."""
    import runpy

    from prefect.context import SettingsContext, get_settings_context
    from prefect.settings import Settings

    sys.argv = ["prefect.engine"]  # the engine reads a flow run id from argv[1]; it is in the environment
    sys.modules.pop("prefect.engine", None)  # imported by Prefect itself: runpy would warn it runs a loaded module
    try:
        with SettingsContext(profile=get_settings_context().profile, settings=Settings()):
            runpy.run_module("prefect.engine", run_name="__main__", alter_sys=True)
    except SystemExit as exit_:
        code = exit_.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return 0


def _become_engine(request: dict, fds: list[int], closing: list[socket.socket]) -> None:
    """The forked child: never returns into the zygote's loop."""
    code = 1
    try:
        for sock in closing:
            sock.close()
        for target, fd in zip(_STDIO, fds, strict=True):
            os.dup2(fd, target)
            os.close(fd)
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD):
            signal.signal(signum, signal.SIG_DFL)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        from forge_core.run.placement import STARTED_WARM_ENV  # preloaded: free here, not in the client

        os.environ[STARTED_WARM_ENV] = "1"
        code = _run_engine()
    except BaseException:  # noqa: BLE001 - the child must end here whatever happened
        import traceback

        traceback.print_exc()
    finally:
        import atexit

        atexit._run_exitfuncs()  # what interpreter exit runs: Prefect drains its log and event queues here
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # a closed pipe: nothing left to tell anyone
                stream.flush()
        os._exit(code)


class _Zygote:
    def __init__(self, path: str) -> None:
        self.parent = os.getppid()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path + ".tmp")
        os.rename(path + ".tmp", path)  # a client sees the socket only once it is served
        self.listener.listen(16)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ)
        self.children: dict[int, socket.socket] = {}  # child pid -> its client's connection

    def serve(self) -> None:
        while os.getppid() == self.parent:
            for key, _events in self.selector.select(_POLL_S):
                if key.fileobj is self.listener:
                    self._accept()
                else:
                    self._client_spoke(key.fileobj)
            self._reap()

    def _accept(self) -> None:
        conn, _ = self.listener.accept()
        try:
            if not _same_user(conn):
                raise ConnectionError("another user")
            request, fds = _recv_request(conn)
        except (OSError, ValueError):
            conn.close()
            return
        try:
            pid = os.fork()
        except OSError:  # no process to spare: this client starts cold, the zygote keeps serving
            for fd in fds:
                os.close(fd)
            conn.close()
            return
        if pid == 0:
            _become_engine(request, fds, [self.listener, conn, *self.children.values()])
        for fd in fds:
            os.close(fd)
        self.children[pid] = conn
        self.selector.register(conn, selectors.EVENT_READ, pid)
        with contextlib.suppress(OSError):  # a client already gone: its EOF, read next tick, ends the child
            conn.sendall(f"pid {pid}\n".encode())

    def _client_spoke(self, conn: socket.socket) -> None:
        pid = self.selector.get_key(conn).data
        try:
            if conn.recv(64):
                return
        except OSError:
            pass
        # The client is gone (SIGKILLed after its grace, or with its node): its engine goes too.
        self.selector.unregister(conn)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            if conn is None:
                continue
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            try:
                conn.sendall(f"exit {code}\n".encode())
            except OSError:
                pass
            with contextlib.suppress(KeyError):  # not registered any more when its client left first
                self.selector.unregister(conn)
            conn.close()


def serve(path: str) -> int:
    """Preload, then serve warm starts on `path` until the parent (the worker) exits."""
    import importlib
    import threading

    for module in PRELOAD:
        importlib.import_module(module)
    if threading.active_count() != 1:
        # Forking a threaded process can copy a held lock into the child: no warm starts, clients start cold.
        print(f"warm start: {threading.active_count()} threads after preloading; not serving", file=sys.stderr)
        return 1
    try:
        _Zygote(path).serve()
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        sys.exit(serve(sys.argv[2]))
    client_main()
