"""Line-by-line streaming of a launch's merged stdout/stderr into a log, with a tail and a rank-0 filter."""

from __future__ import annotations

import collections
import logging
import re
import threading
from collections.abc import Callable
from typing import IO

LogSink = Callable[[str], None] | logging.Logger

# torchrun (with the launcher's prefix template) starts every worker line with "[rank<global rank>]:".
RANK_PREFIX = re.compile(r"^\[rank(\d+)\]:")
# Lines of torchrun's failure summary that identify a failed rank; unprefixed (torchrun's own output).
SUMMARY_FIELD = re.compile(r"^\s*(rank|exitcode|error_file)\s*:")
# The last line of a Python traceback, e.g. "ValueError: bad lr" or "torch.OutOfMemoryError: ...".
EXCEPTION_LINE = re.compile(
    r"^(?P<type>[A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit))(?::\s?(?P<msg>.*))?$"
)
LAUNCHER_PREFIX = "[forge.launch] "
_MAX_SUMMARY_LINES = 2000

_logger = logging.getLogger(__name__)


def as_line_callable(log: LogSink) -> Callable[[str], None]:
    if isinstance(log, logging.Logger):
        return log.info
    return log


class OutputPump:
    """Reads a child's merged output on its own thread: every line goes to `tail` (bounded), and to `log`
    unless `rank0_only` filters it; unprefixed lines (torchrun's own, the launcher's) always reach the log,
    as they carry the failure summary. `plain_rank`: the rank of unprefixed worker lines (plain python: 0)."""

    def __init__(
        self, stream: IO[bytes], log: LogSink, *, rank0_only: bool, tail_lines: int, plain_rank: int | None
    ):
        self._stream = stream
        self._log = as_line_callable(log)
        self._rank0_only = rank0_only
        self._plain_rank = plain_rank
        self._lock = threading.Lock()
        self._sink_broken = False
        self.tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
        self.summary_lines: list[str] = []
        self.last_exception: dict[int, tuple[str, str]] = {}
        self._thread = threading.Thread(target=self._pump, name="forge-launch-output", daemon=True)

    def start(self) -> OutputPump:
        self._thread.start()
        return self

    def join(self, timeout: float) -> bool:
        """Wait for EOF; False if some leftover process still holds the pipe open."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def emit_own(self, message: str) -> None:
        self._deliver(LAUNCHER_PREFIX + message, forward=True)

    def _pump(self) -> None:
        for raw in iter(self._stream.readline, b""):
            self._handle_line(raw.decode("utf-8", errors="replace").rstrip("\r\n"))
        self._stream.close()

    def snapshot(self) -> tuple[tuple[str, ...], list[str], dict[int, tuple[str, str]]]:
        """(tail, failure-summary lines, last printed exception per rank), consistent even mid-stream."""
        with self._lock:
            return tuple(self.tail), list(self.summary_lines), dict(self.last_exception)

    def _handle_line(self, line: str) -> None:
        match = RANK_PREFIX.match(line)
        rank = int(match.group(1)) if match else self._plain_rank
        forward = not self._rank0_only or rank is None or rank == 0
        self._deliver(line, forward=forward, rank=rank, content=line[match.end() :] if match else line)

    def _remember_failure_hints(self, line: str, rank: int | None, content: str) -> None:
        if rank is None:
            if SUMMARY_FIELD.match(line) and len(self.summary_lines) < _MAX_SUMMARY_LINES:
                self.summary_lines.append(line)
        elif exception := EXCEPTION_LINE.match(content):
            self.last_exception[rank] = (exception.group("type"), exception.group("msg") or "")

    def _deliver(self, line: str, *, forward: bool, rank: int | None = None, content: str = "") -> None:
        with self._lock:
            self.tail.append(line)
            if content:
                self._remember_failure_hints(line, rank, content)
            if not forward or self._sink_broken:
                return
            try:
                self._log(line)
            except Exception:
                # A broken sink must not stop the pump (a full pipe would block the ranks); keep the tail.
                self._sink_broken = True
                _logger.exception("launch log sink raised; further lines are kept only in the result's tail")
