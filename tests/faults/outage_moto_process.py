"""moto's S3 server that goes down at a chosen request, in a child process:
`python outage_moto_process.py <port> <observer port>`.

Driven by `fault_kit.OutageMotoServer` over stdin/stdout, one line each:

    parent -> child                      child -> parent
    arm <json>                           armed
                                         down <pid> <METHOD> <path>
                                                                the trigger came in: its connection was dropped
                                                                without a reply and the listening socket closed
                                                                (new connections are refused, kept-alive ones
                                                                get dropped); <pid> is the client process that
                                                                sent it (0 when unknown)
                                         up <dropped>           serving again on the same port, outage_s after
                                                                the trigger; <dropped> requests were dropped
                                                                during the outage (the trigger included)
    start                                up <dropped>           end an outage now (or just `up 0` if serving)
    end of stdin                         (the process exits)

`arm`'s JSON: {"outage_s": s, "pattern": regex, "client_pid": pid or null, "after": regex or null}. The
trigger is the first request whose "<METHOD> <path>" matches `pattern`, sent by process `client_pid` (any
process when null; told by the client socket's owner), once a request matching `after` has come in (at once
when null).

The first line, once the server listens, is `up 0`. moto keeps its data in this process across outages, as a
real server keeps its disk across a restart. The observer port serves the same data and never goes down: the
test's own eyes (CommitWatch, checks between outages) use it, so they neither trigger an outage nor miss one.

Why a child process: moto's server is a Flask app, and importing Flask leaves werkzeug `LocalProxy` globals in
`sys.modules` of whoever imports it; vLLM's in-process engine scans module globals when it starts and trips over
them. The pytest process must never import moto's server (see tests/moto_server_process.py).
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import sys
import threading
from dataclasses import dataclass


@dataclass
class Trigger:
    pattern: re.Pattern
    outage_s: float
    client_pid: int | None = None
    after: re.Pattern | None = None  # None once a request matching it came in


class OutageServer:
    def __init__(self, port: int, protocol) -> None:
        from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app

        self.port = port
        self._protocol = protocol
        self._app = DomainDispatcherApplication(create_backend_app)
        self._lock = threading.Lock()
        self._server = None
        self._armed: Trigger | None = None
        self._down = threading.Event()
        self._dropped = 0
        self._outage_over = threading.Event()
        self._state_lock = threading.Lock()  # serialises going down and coming back

    def say(self, line: str) -> None:
        with self._lock:
            self._protocol.write(line + "\n")
            self._protocol.flush()

    # ---- serving ------------------------------------------------------------------------------------------

    def serve(self) -> None:
        self._server = _serve(self.port, self._outage_aware, "moto-outage")
        self._down.clear()

    def serve_observer(self, port: int) -> None:
        """The same data on `port`, never down (for the test's own checks)."""
        _serve(port, self._app, "moto-observer")

    def _stop_serving(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()  # without it new connections would queue instead of being refused

    def _outage_aware(self, environ, start_response):
        request = f"{environ.get('REQUEST_METHOD')} {environ.get('PATH_INFO')}"
        if self._down.is_set() or self._triggered_by(request, environ):
            with self._lock:
                self._dropped += 1
            return _drop_connection(environ, start_response)
        return self._app(environ, start_response)

    # ---- outages ------------------------------------------------------------------------------------------

    def arm(self, settings: dict) -> None:
        after = settings.get("after")
        trigger = Trigger(
            pattern=re.compile(settings["pattern"]),
            outage_s=float(settings["outage_s"]),
            client_pid=settings.get("client_pid"),
            after=re.compile(after) if after else None,
        )
        with self._lock:
            self._armed = trigger
        self.say("armed")

    def _triggered_by(self, request: str, environ) -> bool:
        with self._lock:
            armed = self._armed
            if armed is None:
                return False
            if armed.after is not None:
                if armed.after.search(request):
                    armed.after = None  # from the next request on, the pattern counts
                return False
            if not armed.pattern.search(request):
                return False
        client = _client_pid(environ, self.port) if armed.client_pid is not None else 0
        with self._lock:
            if self._armed is not armed or (armed.client_pid is not None and client != armed.client_pid):
                return False
            self._armed = None
            self._down.set()
            self._dropped = 0
            self._outage_over.clear()
        # The trigger's reply (a dropped connection) must not wait for the server to stop: another thread.
        trigger = f"{client or 0} {request}"
        threading.Thread(target=self._outage, args=(trigger, armed.outage_s), daemon=True).start()
        return True

    def _outage(self, trigger: str, outage_s: float) -> None:
        with self._state_lock:
            if self._outage_over.is_set():  # `start` came first: the outage is over before it began
                return
            self._stop_serving()
            self.say(f"down {trigger}")
        if not self._outage_over.wait(outage_s):  # set: `start` ended it early
            self.end_outage()

    def end_outage(self) -> None:
        with self._state_lock:
            if not self._down.is_set():
                self.say("up 0")
                return
            self._outage_over.set()
            self._stop_serving()  # a no-op unless `start` came before the outage thread stopped it
            with self._lock:
                dropped = self._dropped
            self.serve()
            self.say(f"up {dropped}")


def _serve(port: int, app, name: str):
    from moto.moto_server.werkzeug_app import MotoRequestHandler
    from werkzeug.serving import make_server

    server = make_server("127.0.0.1", port, app, threaded=True, request_handler=MotoRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True, name=name).start()
    return server


def _client_pid(environ, server_port: int) -> int:
    """The pid of the process whose socket sent this request (0 when not found): the owner of the TCP
    connection from the request's remote port to ours."""
    import psutil

    remote_port = int(environ.get("REMOTE_PORT") or 0)
    for conn in psutil.net_connections(kind="tcp"):
        if conn.laddr and conn.raddr and conn.laddr.port == remote_port and conn.raddr.port == server_port:
            return conn.pid or 0
    return 0


def _drop_connection(environ, start_response):
    """Close the client's connection without a reply, as a crashed server does."""
    sock = environ.get("werkzeug.socket")
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
    start_response("503 Service Unavailable", [("Content-Length", "0"), ("Connection", "close")])
    return [b""]


def main(port: int, observer_port: int) -> None:
    # The protocol gets its own copy of stdout; anything a library prints goes to stderr instead.
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    # One log line per request would drown the test's own logs.
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = OutageServer(port, protocol)
    server.serve_observer(observer_port)
    server.serve()
    server.say("up 0")
    for line in sys.stdin:
        command, _, rest = line.rstrip("\n").partition(" ")
        if command == "arm":
            server.arm(json.loads(rest))
        elif command == "start":
            server.end_outage()
        else:
            raise SystemExit(f"outage_moto_process: unknown command {line!r}")
    server._stop_serving()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
