"""Machinery shared by the fault suite (tests/faults) and the security tests (tests/security).

- `PREFECT_API`: one Prefect test API for the whole session, shared by both folders (reference counted).
- Prefect readers: task runs, flow runs, logs and artifacts, straight from the API.
- `ProcessWatch`: remembers every worker process launched while it runs, to prove none is left afterwards.
- `CommitWatch`: re-reads every artifact the moment it looks committed and verifies all its files, to prove
  that no partial artifact is ever visible as committed.
- `OutageMotoServer`: a real moto S3 server (child process) that dies at a chosen request and comes back.
- Small readers of what stages leave behind: per-step metrics, exported weights, rollout tables.
"""

from __future__ import annotations

import glob
import json
import os
import queue
import re
import socket
import subprocess
import sys
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import psutil
from prefect_readers import run_async, task_runs  # noqa: F401 - task_runs: the fault suite reads it from here

TINY_CONFIG = "configs/tiny_test.yaml"
# What every fault scenario adds to the tiny config: a checkpoint after every step (so resume and the
# corrupt-checkpoint fallback have something to fall back to), all of them kept (the scenarios check that
# nothing committed before a fault is lost afterwards; retention is tested in tests/flows), a held-out split
# the tiny data can afford, no wandb process (the S3 scenario turns it on), and stage deadlines that only a
# hang reaches even on a loaded 2-core box (the hang scenario sets its own SFT deadline).
COMMON_OVERRIDES = (
    "sft.checkpoint_every=1",
    "storage.keep_checkpoints=1000",
    "sft.eval_rows=8",
    "logging.wandb_mode=disabled",
    *(f"launch.{stage}.deadline_s=1800" for stage in ("prepare", "sft", "rollout", "grpo", "evaluate")),
)
WORKER_MARKERS = ("forge_core.run", "torch.distributed.run", "VLLM::")


# ---- one Prefect API for the session ---------------------------------------------------------------------


class _SharedPrefectApi:
    """prefect_test_harness, entered by the first user and left by the last (session fixtures of two
    folders share it: a second harness would cost another server start)."""

    def __init__(self) -> None:
        self._stack: ExitStack | None = None
        self._users = 0
        self.api_url: str | None = None

    def acquire(self) -> str:
        if self._users == 0:
            from prefect.settings import PREFECT_API_URL
            from prefect.testing.utilities import prefect_test_harness

            self._stack = ExitStack()
            self._stack.enter_context(prefect_test_harness(server_startup_timeout=600))
            self.api_url = PREFECT_API_URL.value()
        self._users += 1
        return self.api_url

    def release(self) -> None:
        self._users -= 1
        if self._users == 0 and self._stack is not None:
            self._stack.close()
            self._stack = None


PREFECT_API = _SharedPrefectApi()


def prefect_environment(home: Path) -> None:
    """Before Prefect reads its settings: a private home and time for a cold SQLite database to start."""
    os.environ.setdefault("PREFECT_HOME", str(home))
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "INFO")


# ---- Prefect readers -------------------------------------------------------------------------------------


def flow_run(flow_run_id):
    return run_async(lambda c: c.read_flow_run(flow_run_id))


def flush_prefect_logs() -> None:
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=30)


def all_logs(flow_run_id=None) -> list[str]:
    """Every log message stored by the API (of one flow run, or of all of them), oldest first."""
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort

    flush_prefect_logs()
    log_filter = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])) if flow_run_id else None
    messages: list[str] = []
    while True:
        offset = len(messages)
        page = run_async(
            lambda c, offset=offset: c.read_logs(
                log_filter=log_filter, limit=200, offset=offset, sort=LogSort.TIMESTAMP_ASC
            )
        )
        messages += [log.message for log in page]
        if len(page) < 200:
            return messages


def all_artifacts_text() -> str:
    """Every Prefect artifact of the session (markdown, tables, links, progress) as one JSON text."""
    pages: list[dict] = []
    while True:
        offset = len(pages)
        page = run_async(lambda c, offset=offset: c.read_artifacts(limit=200, offset=offset))
        pages += [a.model_dump(mode="json") for a in page]
        if len(page) < 200:
            return json.dumps(pages)


def attempts(logs: list[str], stage: str) -> list[str]:
    """The launch attempts of `stage` in a flow run's logs, e.g. ["RETRYABLE in 88 s", "SUCCESS in 37 s"]."""
    found = [re.search(rf"^{stage}: ([A-Z]+) in ([0-9.]+)s$", line.strip()) for line in logs]
    return [f"{m.group(1)} in {float(m.group(2)):.0f} s" for m in found if m]


# ---- processes -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SeenProcess:
    pid: int
    create_time: float
    cmdline: str
    launch_id: str | None

    def alive(self) -> bool:
        try:
            proc = psutil.Process(self.pid)
            return proc.create_time() == self.create_time and proc.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False


def worker_processes_under(pid: int, registry: str | None = None, marker: str | None = None) -> list[SeenProcess]:
    """Launched worker processes (torchrun, ranks, stage workers, vLLM) below `pid`; with `registry`, only
    those started with that FORGE_LAUNCH_REGISTRY (one scenario's flow process, when several run side by side);
    with `marker`, only those whose command line holds it (a scenario's store root, in the spec URI of the
    workers it launched on the test run's Ray cluster, whose environment is the cluster's)."""
    seen = []
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []
    for proc in children:
        try:
            cmdline = " ".join(proc.cmdline())
            if not any(worker in cmdline for worker in WORKER_MARKERS) or (marker and marker not in cmdline):
                continue
            environ = proc.environ()
            if registry is not None and environ.get("FORGE_LAUNCH_REGISTRY") != registry:
                continue
            seen.append(SeenProcess(proc.pid, proc.create_time(), cmdline, environ.get("FORGE_LAUNCH_ID")))
        except psutil.Error:
            continue
    return seen


class ProcessWatch:
    """Samples the worker processes below `root_pid` (of one launch `registry`, or with `marker` in their
    command line, if given: `worker_processes_under`) every `every_s` while running (use as a context)."""

    def __init__(
        self,
        root_pid: int | None = None,
        every_s: float = 0.5,
        registry: str | None = None,
        marker: str | None = None,
    ) -> None:
        self.root_pid = root_pid or os.getpid()
        self.registry = registry
        self.marker = marker
        self.every_s = every_s
        self.seen: dict[tuple[int, float], SeenProcess] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="fault-process-watch")

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def listings_within(self, start: float, end: float) -> list[bool]:
        """Whether each poll that began and ended between `start` and `end` (monotonic s) could list the store."""
        return [listed for began, ended, listed in self.listings if start <= began and ended <= end]

    def _run(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(self.every_s):
                return

    def sample(self) -> None:
        for proc in worker_processes_under(self.root_pid, self.registry, self.marker):
            self.seen.setdefault((proc.pid, proc.create_time), proc)

    def launch_ids(self) -> list[str]:
        """Launch ids in order of first sight."""
        ordered = sorted(self.seen.values(), key=lambda p: p.create_time)
        return list(dict.fromkeys(p.launch_id for p in ordered if p.launch_id))

    def alive(self) -> list[SeenProcess]:
        return [p for p in self.seen.values() if p.alive()]


def host_segments() -> set[str]:
    """The shared-memory segments of the kind vLLM's queues use that exist on this host now."""
    from forge_core.rollout.engine_watch import SHARED_MEMORY_PREFIX

    return set(glob.glob(f"{SHARED_MEMORY_PREFIX}*"))


def mapped_segments() -> set[str]:
    """The segments of that kind some live process maps."""
    from forge_core.rollout.engine_watch import shared_memory_of

    return shared_memory_of(list(psutil.process_iter()))


def wait_until_gone(processes: list[SeenProcess], timeout_s: float) -> list[SeenProcess]:
    """The processes still alive after up to `timeout_s` (ending is asynchronous: give it a moment)."""
    deadline = time.monotonic() + timeout_s
    alive = [p for p in processes if p.alive()]
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [p for p in alive if p.alive()]
    return alive


# ---- committed artifacts ---------------------------------------------------------------------------------


class CommitWatch:
    """Polls a store for `_MANIFEST.json` objects; each newly committed artifact is verified at once (every
    file read back against its size and sha256). `violations` lists what ever looked committed but was not
    complete; `committed` maps artifact URI -> manifest sha256 as first seen; `listings` records every poll's
    listing as (started, ended, listed): `time.monotonic()` seconds, and False when the store refused it (down)."""

    def __init__(self, store, every_s: float = 0.2) -> None:
        self.store = store
        self.every_s = every_s
        self.committed: dict[str, str] = {}
        self.violations: list[str] = []
        self.polls = 0
        self.listings: list[tuple[float, float, bool]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="fault-commit-watch")

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.poll()

    def listings_within(self, start: float, end: float) -> list[bool]:
        """Whether each poll that began and ended between `start` and `end` (monotonic s) could list the store."""
        return [listed for began, ended, listed in self.listings if start <= began and ended <= end]

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.poll()

    def poll(self) -> None:
        from forge_core.storage import ArtifactCorrupted, ArtifactNotCommitted

        started = time.monotonic()
        try:
            paths = self.store.fs.find(self.store.path_of(self.store.root))
        except Exception:  # noqa: BLE001 - the store may be down (that is the point of some scenarios)
            self.listings.append((started, time.monotonic(), False))
            return
        self.listings.append((started, time.monotonic(), True))
        self.polls += 1
        for path in paths:
            if not path.endswith("/_MANIFEST.json"):
                continue
            uri = self.store.uri_of(path.rsplit("/", 1)[0])
            if uri in self.committed:
                continue
            try:
                reader = self.store.reader(uri)
                for rel in reader.files():
                    reader.read_bytes(rel)
                self.committed[uri] = self.store.manifest_sha256(uri)
            except (ArtifactCorrupted, ArtifactNotCommitted) as exc:
                self.violations.append(f"{uri}: {type(exc).__name__}: {exc}")
            except Exception:  # noqa: BLE001, S112 - a store outage mid-read: try again at the next poll
                continue


# ---- an S3 server that dies on cue -----------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class OutageEvent:
    trigger: str  # "<METHOD> <path>" of the request that brought the server down
    started: float
    client_pid: int = 0  # the process that sent the trigger (0: not known)
    restarted: float | None = None
    refused_requests: int = 0
    notes: dict = field(default_factory=dict)


class OutageMotoServer:
    """moto's S3 server on 127.0.0.1:<port>, in a child process (outage_moto_process.py), that goes down
    when a request matches.

    `arm(pattern, outage_s, on_down, on_up, client_pid, after)`: the first request whose "<METHOD> <path>"
    matches `pattern` (a regex), sent by process `client_pid` (any when None) after a request matching
    `after` came in (at once when None), gets its connection dropped without a reply; the listening socket
    closes (new connections are refused), requests still arriving on kept-alive connections are dropped too;
    `on_down(event)` runs while the server is down; `outage_s` after the trigger the server listens again on
    the same port and `on_up(event)` runs (both on a reader thread of this process, in that order; they must
    not call `arm`/`end_outage`). `end_outage()` brings it back at once. moto keeps its data in the child
    across outages, as a real server keeps its disk across a restart. `observer_url` serves the same data and
    never goes down, for the test's own checks. moto (Flask) is never imported here: see
    outage_moto_process.py for why.
    """

    def __init__(self, port: int | None = None, env: dict[str, str] | None = None) -> None:
        self.port = port or free_port()
        self.env = env  # extra environment of the server (moto's settings)
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        self.observer_port = free_port()
        self.observer_url = f"http://127.0.0.1:{self.observer_port}"
        self.events: list[OutageEvent] = []
        self._process: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None
        self._callbacks: tuple[object, object] = (None, None)
        self._replies: queue.Queue[str] = queue.Queue()  # "armed" and "up" lines, for who waits on them

    def start(self) -> OutageMotoServer:
        script = Path(__file__).with_name("outage_moto_process.py")
        self._process = subprocess.Popen(
            [sys.executable, str(script), str(self.port), str(self.observer_port)],
            env={**os.environ, **(self.env or {})},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._reader = threading.Thread(target=self._read_events, daemon=True, name="moto-outage-events")
        self._reader.start()
        self._expect("up", timeout_s=300)
        return self

    def close(self) -> None:
        """Stop for good: an outage in progress does not come back; moto's data is gone."""
        if self._process is None:
            return
        self._process.stdin.close()
        try:
            self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._reader.join(timeout=30)
        self._process = None

    def arm(
        self,
        pattern: str,
        outage_s: float,
        on_down=None,
        on_up=None,
        client_pid: int | None = None,
        after: str | None = None,
    ) -> None:
        self._callbacks = (on_down, on_up)
        settings = {"outage_s": outage_s, "pattern": pattern, "client_pid": client_pid, "after": after}
        self._send("arm " + json.dumps(settings))
        self._expect("armed", timeout_s=60)

    def end_outage(self) -> None:
        """Serve again now (the data is still there); returns once the server listens."""
        self._send("start")
        self._expect("up", timeout_s=60)

    def _send(self, line: str) -> None:
        self._process.stdin.write(line + "\n")
        self._process.stdin.flush()

    def _expect(self, reply: str, timeout_s: float) -> None:
        try:
            line = self._replies.get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError(
                f"moto outage server (pid {self._process.pid}) sent no {reply!r} in {timeout_s:g} s "
                f"(exit code {self._process.poll()})"
            ) from None
        assert line == reply, f"moto outage server answered {line!r}, expected {reply!r}"

    def _read_events(self) -> None:
        for line in self._process.stdout:
            kind, _, rest = line.rstrip("\n").partition(" ")
            if kind == "down":
                self._went_down(rest)
            elif kind == "up":
                self._came_back(int(rest))
            else:
                self._replies.put(kind)

    def _went_down(self, trigger: str) -> None:
        pid, _, request = trigger.partition(" ")
        event = OutageEvent(trigger=request, started=time.monotonic(), client_pid=int(pid))
        self.events.append(event)
        _run_callback("on_down", self._callbacks[0], event)

    def _came_back(self, dropped: int) -> None:
        event = self.events[-1] if self.events and self.events[-1].restarted is None else None
        if event is not None:
            event.refused_requests = dropped
            event.restarted = time.monotonic()
            _run_callback("on_up", self._callbacks[1], event)
        self._replies.put("up")


def _run_callback(name: str, callback, event: OutageEvent) -> None:
    if callback is None:
        return
    try:
        callback(event)
    except Exception as exc:  # noqa: BLE001 - recorded for the test to report
        event.notes[f"{name}_error"] = f"{type(exc).__name__}: {exc}"


# Modules whose presence in the test process breaks vLLM's in-process engine (tests/rollout shares the
# pytest session): Flask's werkzeug LocalProxy globals. moto's server imports Flask.
FORBIDDEN_IN_TEST_PROCESS = ("flask", "moto.server", "moto.moto_server.werkzeug_app")


def forbidden_modules_loaded() -> list[str]:
    return [name for name in FORBIDDEN_IN_TEST_PROCESS if name in sys.modules]


# ---- what stages leave behind ----------------------------------------------------------------------------


def step_metrics(run_dir: Path) -> dict[int, dict]:
    """The last record of each training step in a run's metrics.jsonl (a resumed run appends to it)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    by_step: dict[int, dict] = {}
    for record in records:
        if "loss" in record:
            by_step[int(record["step"])] = record
    return by_step


def flip_bytes(path: Path) -> None:
    """Invert 16 bytes in the middle of a file (same size: only its sha256 can tell)."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 16] = bytes(b ^ 0xFF for b in data[middle : middle + 16])
    path.write_bytes(bytes(data))


def policy_weights(store, stage_uri: str, local_dir: Path):
    from safetensors.torch import load_file

    folder = store.reader(store.join(stage_uri, "policy")).download_dir("", local_dir)
    return load_file(str(folder / "model.safetensors"))


# Columns that name where and when a rollout was made rather than what was sampled.
ROLLOUT_LINEAGE_COLUMNS = ("policy_uri", "policy_version")


def rollout_rows(store, rollouts_uri: str) -> list[dict]:
    table = store.reader(rollouts_uri).read_table("rollouts.parquet")
    keep = [name for name in table.column_names if name not in ROLLOUT_LINEAGE_COLUMNS]
    return table.select(keep).to_pylist()
