"""An accept loop for a `multiprocessing.connection` listener that peers who never authenticate cannot
exhaust (the engine service's: forge_core.rollout.service.server).

    listener = Listener(address, family, backlog=BACKLOG)    # no authkey: the key challenge runs here
    serve_connections(listener, authkey, serve)              # serve(conn) per authenticated peer;
                                                             # returns when the listener is closed

Each accepted connection gets multiprocessing's HMAC key challenge (both ways, as `Listener(authkey=...)`
does) on a thread of its own, the whole challenge bounded by `handshake_s` (then the socket is shut down,
which ends any read in progress); an authenticated connection is then served by `serve(conn)` on that thread,
unbounded. At most `max_pending` connections may be in their challenge at once: one more is closed at once. So
peers that connect and say nothing cost at most `max_pending` threads and descriptors, each for at most
`handshake_s`, and never stop the loop from accepting. Running out of descriptors (EMFILE, ENFILE) or buffers
at accept is logged and retried after a growing pause (at most MAX_BACKOFF_S): the loop accepts again once
descriptors are free. Any other accept error means the listener was closed, and ends the loop.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import (
    AuthenticationError,
    Connection,
    Listener,
    answer_challenge,
    deliver_challenge,
)

log = logging.getLogger(__name__)

BACKLOG = 64
HANDSHAKE_S = 10.0
MAX_PENDING = 32
FIRST_BACKOFF_S = 0.05
MAX_BACKOFF_S = 1.0
HANDSHAKE_THREAD = "forge-listener-handshake"
SERVING_THREAD = "forge-listener-conn"
_EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


def serve_connections(
    listener: Listener,
    authkey: bytes,
    serve: Callable[[Connection], None],
    *,
    handshake_s: float = HANDSHAKE_S,
    max_pending: int = MAX_PENDING,
) -> None:
    """Accept, authenticate and serve connections until the listener is closed (module docstring)."""
    pending = threading.BoundedSemaphore(max_pending)
    backoff = 0.0
    while True:
        try:
            conn = listener.accept()
        except OSError as exc:
            if exc.errno not in _EXHAUSTED:
                return  # the listener was closed: its owner is exiting
            backoff = min(MAX_BACKOFF_S, backoff * 2 or FIRST_BACKOFF_S)
            log.warning(
                "could not accept a connection (%s: %s); accepting again in %.2f s",
                errno.errorcode[exc.errno], exc.strerror, backoff,
            )  # fmt: skip
            time.sleep(backoff)
            continue
        backoff = 0.0
        if not pending.acquire(blocking=False):
            log.warning("refused a connection: %d others are still in their key challenge", max_pending)
            conn.close()
            continue
        try:
            threading.Thread(
                target=_authenticate_then_serve, args=(conn, authkey, serve, handshake_s, pending),
                name=HANDSHAKE_THREAD, daemon=True,
            ).start()  # fmt: skip
        except RuntimeError as exc:  # no thread to be had: like running out of descriptors
            pending.release()
            conn.close()
            log.warning("refused a connection: %s", exc)


def _authenticate_then_serve(
    conn: Connection,
    authkey: bytes,
    serve: Callable[[Connection], None],
    handshake_s: float,
    pending: threading.BoundedSemaphore,
) -> None:
    try:
        deadline = _Deadline(conn, handshake_s)
        try:
            deliver_challenge(conn, authkey)
            answer_challenge(conn, authkey)
        finally:
            in_time = deadline.disarm()
        if not in_time:
            raise TimeoutError(f"no key challenge completed within {handshake_s:g} s")
    except (AuthenticationError, EOFError, OSError) as exc:
        why = str(exc) or type(exc).__name__
        log.warning("refused a connection that did not pass the key challenge: %s", why)
        conn.close()
        return
    finally:
        pending.release()
    threading.current_thread().name = SERVING_THREAD
    serve(conn)


class _Deadline:
    """Shuts the connection down after `seconds` unless disarmed first (a shutdown ends a blocked read)."""

    def __init__(self, conn: Connection, seconds: float) -> None:
        self._conn = conn
        self._lock = threading.Lock()
        self._armed = True
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _expire(self) -> None:
        with self._lock:
            if self._armed:
                self._armed = False
                _shut_down(self._conn)

    def disarm(self) -> bool:
        """True when the deadline had not passed (the connection is intact)."""
        self._timer.cancel()
        with self._lock:
            in_time, self._armed = self._armed, False
        return in_time


def _shut_down(conn: Connection) -> None:
    with contextlib.suppress(OSError):
        sock = socket.socket(fileno=conn.fileno())  # borrows the descriptor: detached, not closed, below
        try:
            sock.shutdown(socket.SHUT_RDWR)
        finally:
            sock.detach()
