"""Peers of a listener under attack: silent connections, a client with the key (every step bounded in time)
and the echo service the listener serves."""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Callable
from multiprocessing.connection import AuthenticationError, Connection, answer_challenge, deliver_challenge


def echo(conn: Connection) -> None:
    """Answer every request with ("done", request) until the client leaves."""
    try:
        while True:
            conn.send(("done", conn.recv()))
    except (EOFError, OSError):
        conn.close()


def silent_connection(address: tuple[str, int]) -> socket.socket:
    """A connection that says nothing (connecting without waiting: a full backlog must not stall the test)."""
    sock = socket.socket()
    sock.setblocking(False)
    sock.connect_ex(address)
    return sock


def order_once(address: tuple[str, int], key: bytes, order: object, io_timeout_s: float) -> object:
    """One request as the engine service's client makes it, each read and write bounded by `io_timeout_s`."""
    sock = socket.create_connection(address, timeout=io_timeout_s)
    sock.settimeout(None)  # Connection needs a blocking descriptor: the kernel bounds each read and write
    seconds = struct.pack("ll", int(io_timeout_s), int(io_timeout_s % 1 * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, seconds)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, seconds)
    conn = Connection(sock.detach())
    try:
        answer_challenge(conn, key)
        deliver_challenge(conn, key)
        conn.send(order)
        return conn.recv()
    finally:
        conn.close()


def order_until_answered(
    address: tuple[str, int],
    key: bytes,
    order: object,
    within_s: float,
    poll: Callable[[], None] = lambda: None,
) -> object:
    """The answer to `order`, retried (a refused or timed-out attempt) until one succeeds; AssertionError when
    none did within `within_s`."""
    deadline = time.monotonic() + within_s
    last: BaseException | None = None
    while time.monotonic() < deadline:
        poll()
        try:
            return order_once(address, key, order, io_timeout_s=5)
        except (OSError, EOFError, AuthenticationError) as exc:
            last = exc
            time.sleep(0.1)
    raise AssertionError(f"no answer within {within_s} s; the last attempt: {last!r}")
