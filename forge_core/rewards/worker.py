"""A reward worker process: scores samples for its parent's RewardPool (forge_core.rewards.isolation).

    python -m forge_core.rewards.worker --fd N --progress M --owner <pid>:<create time>

Started by the pool, never by hand. A score request on socket `--fd` is answered ("ready"), then ("values", i,
[[component values] of samples i, i+1, ...]) at least every REWARD_ANSWER_FLUSH_S while samples finish, and
("done", n); a reward error is ("error", i, message) and ends the request. Before each sample the worker writes
its position to the `--progress` record (forge_core.rewards.isolation.SampleProgress), by which the pool charges
a hang or a crash to its sample although answers travel in batches.
A call request (a function by import path, e.g. a tool) is answered call by call, where an exception
("raised") or an oversized result ("too_large", never sent) is an answer, not the end. The worker exits when
its parent closes the socket or is gone; a hang or crash in a function is the parent's to notice.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler

from forge_core.launch.owner import Owner, watch_owner
from forge_core.rewards.isolation import SampleProgress
from forge_core.rewards.registry import RewardFunctionError
from forge_core.rewards.scoring import RewardSet
from forge_core.timings import REWARD_ANSWER_FLUSH_S

_EXIT_OWNER_GONE = 3


def serve(conn: Connection, progress: SampleProgress) -> None:
    """Answer score and call requests until the parent closes the channel."""
    built: dict[str, RewardSet] = {}
    while True:
        try:
            op, request = conn.recv()
        except EOFError:
            return
        if op == "call":
            _call(conn, request)
            continue
        assert op == "score", op
        key = repr((request["configs"], request["section"]))
        if key not in built:
            try:
                built[key] = RewardSet.from_config(request["configs"], request["section"])
            except ValueError as exc:
                conn.send(("error", None, str(exc)))
                continue
        conn.send(("ready", None, None))
        _score(conn, built[key], request["items"], progress)


def _score(
    conn: Connection,
    rewards: RewardSet,
    items: list[tuple],
    progress: SampleProgress,
    flush_s: float = REWARD_ANSWER_FLUSH_S,
) -> None:
    """Score `items` in order, sending their values at least every `flush_s` while samples finish."""
    unsent: list[list[float]] = []
    sent_at = time.monotonic()
    for position, item in enumerate(items):
        progress.start(position)
        try:
            unsent.append(rewards.score_sample(*item))
        except RewardFunctionError as exc:
            _send_values(conn, position, unsent)
            conn.send(("error", position, str(exc)))
            return
        if time.monotonic() - sent_at >= flush_s:
            _send_values(conn, position + 1, unsent)
            unsent, sent_at = [], time.monotonic()
    _send_values(conn, len(items), unsent)
    conn.send(("done", len(items), None))


def _send_values(conn: Connection, end: int, values: list[list[float]]) -> None:
    """Send the values of the samples `end - len(values)` to `end` (exclusive), if any."""
    if values:
        conn.send(("values", end - len(values), values))


def _call(conn: Connection, request: dict) -> None:
    """Run a function (by import path) on each argument set: ("ready"), then per call ("value", i, (value,
    seconds)), ("raised", i, (message, seconds)) or ("too_large", i, (message, seconds)), then ("done");
    ("error", None, message) when the function cannot be imported."""
    limit = request["max_result_bytes"]
    try:
        fn = _import_function(request["fn"])
    except (ImportError, AttributeError, ValueError) as exc:
        conn.send(("error", None, f"cannot import {request['fn']!r}: {type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", None, None))
    for position, (args, kwargs) in enumerate(request["calls"]):
        started = time.perf_counter()
        try:
            value = fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - a tool's failure is the caller's observation, not ours
            conn.send(("raised", position, (f"{type(exc).__name__}: {exc}", time.perf_counter() - started)))
            continue
        seconds = time.perf_counter() - started
        answer = ForkingPickler.dumps(("value", position, (value, seconds)))  # what conn.send would send
        if len(answer) > limit:
            message = (
                f"the result is {len(answer)} bytes (pickled), more than rollout.env.max_tool_result_bytes="
                f"{limit}; return less, or raise that bound"
            )
            conn.send(("too_large", position, (message, seconds)))
            continue
        conn.send_bytes(answer)
    conn.send(("done", len(request["calls"]), None))


def _import_function(path: str):
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError("give the function as 'package.module:function'")
    fn = getattr(importlib.import_module(module_name), attr)
    if not callable(fn):
        raise ValueError(f"{attr!r} is a {type(fn).__name__}, not a function")  # noqa: TRY004 - a config error
    return fn


def main(argv: Sequence[str] | None = None) -> int:
    """Serve the parent until it closes the channel or dies (module docstring)."""
    parser = argparse.ArgumentParser(
        prog="python -m forge_core.rewards.worker", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--fd", type=int, required=True, help="our end of the parent's socketpair")
    parser.add_argument("--progress", type=int, required=True, help="the parent's SampleProgress record (an fd)")
    parser.add_argument("--owner", required=True, help="<pid>:<create time> of the parent (exit with it)")
    args = parser.parse_args(argv)
    owner = Owner.parse(args.owner, "--owner")
    watch_owner(owner, lambda: os._exit(_EXIT_OWNER_GONE), name="forge-reward-owner")
    conn = Connection(args.fd)
    progress = SampleProgress(args.progress)
    try:
        serve(conn, progress)
    finally:
        conn.close()
        progress.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
