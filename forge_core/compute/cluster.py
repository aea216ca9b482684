"""The Ray cluster a flow run computes on: an embedded one started here, or an existing one joined by address.

    cluster = connect(None)                      # embedded: loopback only, token auth, no dashboard
    cluster = connect("auto")                    # join the cluster this host belongs to (`ray start` ran here)
    cluster = connect("ray://head:10001")        # join through Ray Client
    cluster.pool_nodes("gpu-a")                  # live nodes labelled forgeflow.pool=gpu-a (`ray start --labels`)
    cluster.close()                              # shuts the embedded Ray down; a joined one only disconnects

The embedded cluster is hardened for a shared host:
- Loopback only: `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` makes every Ray listener bind 127.0.0.1, which
  `_node_ip_address` alone does not (`listeners_beyond_loopback` checks the sockets).
- Token auth: a fresh token in a private file (0600 in a 0700 folder), not Ray's umask-mode ~/.ray/auth_token.
- No dashboard unless `dashboard=True`; workers at normal priority (`RAY_worker_niceness=0`).
It is started on a thread that lives until `close()`: Ray's head processes get Linux's parent-death signal,
which fires when the forking *thread* ends, and a stage may first need the cluster on a short-lived thread.

Joining uses the caller's Ray auth environment; token mode is switched on when the caller chose no mode.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import secrets
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from forge_core.launch.registry import check_private

log = logging.getLogger(__name__)

POOL_LABEL = "forgeflow.pool"
LOCAL_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
AUTH_MODE_ENV = "RAY_AUTH_MODE"
TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"
TOKEN_ENV = "RAY_AUTH_TOKEN"
NICENESS_ENV = "RAY_worker_niceness"


@dataclass(frozen=True)
class NodeInfo:
    """One live Ray node as a stage sees it."""

    node_id: str
    address: str
    pool: str | None
    resources: dict[str, float] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)

    @property
    def gpus(self) -> float:
        return self.resources.get("GPU", 0.0)

    @property
    def cpus(self) -> float:
        return self.resources.get("CPU", 0.0)


@dataclass
class ComputeCluster:
    """A connection to a Ray cluster (module docstring). `start_s` is how long starting or joining it took."""

    address: str
    embedded: bool
    start_s: float
    token_path: Path | None = None
    # Whether close() ends the connection: False for one this process already had when connect() was called.
    owned: bool = True
    # Ends the thread the embedded cluster was started on (module docstring), after the shutdown.
    _release_starter: Callable[[], None] | None = field(default=None, repr=False)

    def nodes(self) -> list[NodeInfo]:
        """The cluster's live nodes."""
        import ray

        return [_node_info(node) for node in ray.nodes() if node.get("Alive")]

    def pool_nodes(self, pool: str) -> list[NodeInfo]:
        """The live nodes of `pool` (label `forgeflow.pool=<pool>`)."""
        return [node for node in self.nodes() if node.pool == pool]

    def describe_pool(self, pool: str | None) -> str:
        """For messages: the live nodes of `pool` (every node when None) with their CPUs and GPUs, or the pools."""
        nodes = self.pool_nodes(pool) if pool else self.nodes()
        if not nodes:
            pools = sorted({n.pool for n in self.nodes() if n.pool})
            return f"no live node is labelled {POOL_LABEL}={pool} (pools with live nodes: {pools or 'none'})"
        parts = [f"{n.node_id[:8]} at {n.address} ({n.cpus:g} CPU, {n.gpus:g} GPU)" for n in nodes]
        where = f"in pool {pool!r}" if pool else "in the cluster"
        return f"{len(nodes)} live node(s) {where}: " + ", ".join(parts)

    def close(self) -> None:
        """Disconnect (when this object made the connection); the embedded cluster is shut down with it."""
        import ray

        if self.owned and ray.is_initialized():
            ray.shutdown()
        if self._release_starter is not None:
            self._release_starter()


def _node_info(node: dict) -> NodeInfo:
    labels = dict(node.get("Labels") or {})
    return NodeInfo(
        node_id=node["NodeID"],
        address=node.get("NodeManagerAddress", ""),
        pool=labels.get(POOL_LABEL),
        resources=dict(node.get("Resources") or {}),
        labels=labels,
    )


def private_token_file(folder: Path | None = None) -> Path:
    """A fresh random Ray token in a private file (0600 in a 0700 folder); `folder` defaults to a new temp one.

    Raises:
        ValueError: `folder` exists but is not a folder of this user with mode 0700.
    """
    folder = Path(folder) if folder is not None else Path(tempfile.mkdtemp(prefix="forgeflow-ray-"))
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    check_private(folder, "the Ray token folder")
    path = folder / "ray-auth-token"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(secrets.token_hex(32))
    return path


def embedded_environment(token_path: Path) -> dict[str, str]:
    """Variables that make a Ray started here loopback-only, token-authenticated, workers at normal priority."""
    return {LOCAL_ONLY_ENV: "0", AUTH_MODE_ENV: "token", TOKEN_PATH_ENV: str(token_path), NICENESS_ENV: "0"}


def apply_environment(env: dict[str, str]) -> None:
    """Set Ray's variables for this process and the Ray processes it starts.

    Ray caches all three (C++ config, token loader, `ray_constants.ENABLE_RAY_CLUSTER`); when Ray is already
    imported they are reloaded here, so a process that joined one cluster can start an embedded one.
    """
    os.environ.update(env)
    import sys

    if "ray" in sys.modules:
        from ray._private import ray_constants
        from ray._raylet import AuthenticationTokenLoader, Config

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()
        ray_constants.ENABLE_RAY_CLUSTER = os.environ.get(LOCAL_ONLY_ENV, "1").lower() not in ("0", "false")


def connect(
    address: str | None,
    *,
    num_cpus: int | None = None,
    num_gpus: int | None = None,
    dashboard: bool = False,
    labels: dict[str, str] | None = None,
) -> ComputeCluster:
    """Start the embedded Ray (`address` None) or join the cluster at `address` (what `ray.init` takes).

    `num_cpus`, `num_gpus`, `labels`: the embedded node's (Ray's own detection when None); `dashboard`: start
    Ray's dashboard on 127.0.0.1. A process already connected keeps that connection: the result then has
    `owned` False and its close() leaves it open.
    """
    import ray

    if ray.is_initialized():
        current = ray.get_runtime_context().gcs_address
        return ComputeCluster(address=current, embedded=False, start_s=0.0, owned=False)
    started = time.monotonic()
    if address is None:
        cluster = _on_a_thread_of_its_own(
            lambda: _init(None, num_cpus=num_cpus, num_gpus=num_gpus, dashboard=dashboard, labels=labels)
        )
    else:
        with _sigterm_handler_kept():
            cluster = _init(address, num_cpus=num_cpus, num_gpus=num_gpus, dashboard=dashboard, labels=labels)
    cluster.start_s = time.monotonic() - started
    log.info(
        "%s Ray cluster at %s in %.1f s",
        "started an embedded" if cluster.embedded else "joined the",
        cluster.address,
        cluster.start_s,
    )
    return cluster


def _on_a_thread_of_its_own(start: Callable[[], ComputeCluster]) -> ComputeCluster:
    """`start()` on a new thread that waits for the cluster's close; its exception is raised here. Off the main
    thread `ray.init` also leaves the process's signal handlers alone."""
    ready, released = threading.Event(), threading.Event()
    outcome: dict = {}

    def start_and_stay() -> None:
        try:
            outcome["cluster"] = start()
        except BaseException as exc:  # noqa: BLE001 - raised again on the caller's thread
            outcome["error"] = exc
        ready.set()
        if "cluster" in outcome:
            released.wait()

    threading.Thread(target=start_and_stay, name="forge-ray-embedded", daemon=True).start()
    ready.wait()
    if "error" in outcome:
        raise outcome["error"]
    cluster = outcome["cluster"]
    cluster._release_starter = released.set
    return cluster


@contextlib.contextmanager
def _sigterm_handler_kept() -> Iterator[None]:
    """Keep this process's SIGTERM handler across `ray.init`, which replaces it (on the main thread) with one that
    only exits and so would skip the flow's handler that ends the run's launches."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handler = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        if handler is not None:
            signal.signal(signal.SIGTERM, handler)


def _init(
    address: str | None,
    *,
    num_cpus: int | None,
    num_gpus: int | None,
    dashboard: bool,
    labels: dict[str, str] | None,
) -> ComputeCluster:
    import ray

    if address is None:
        token_path = private_token_file()
        apply_environment(embedded_environment(token_path))
        context = ray.init(
            # "local": a new cluster; with no address Ray would join the newest one started on this machine.
            address="local",
            include_dashboard=dashboard,
            dashboard_host="127.0.0.1",
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            labels=labels,
            log_to_driver=False,
            configure_logging=False,
        )
        embedded = True
    else:
        apply_environment({AUTH_MODE_ENV: os.environ.get(AUTH_MODE_ENV, "token")})
        token_path = None
        context = ray.init(address=address, log_to_driver=False, configure_logging=False)
        embedded = False
    return ComputeCluster(
        address=context.address_info.get("gcs_address") or address or "",
        embedded=embedded,
        start_s=0.0,
        token_path=token_path,
    )


@dataclass(frozen=True)
class Listener:
    """A listening TCP socket of some process."""

    address: str
    port: int
    pid: int
    process: str

    @property
    def loopback(self) -> bool:
        address = self.address.removeprefix("::ffff:")  # an IPv4-mapped IPv6 address
        return ipaddress.ip_address(address).is_loopback


def listeners(pids: Iterable[int] | None = None) -> list[Listener]:
    """The listening TCP sockets of `pids` (every process this user can see when None)."""
    import psutil

    wanted = set(pids) if pids is not None else None
    found = []
    for conn in psutil.net_connections(kind="inet"):
        if conn.status != psutil.CONN_LISTEN or not conn.pid or (wanted is not None and conn.pid not in wanted):
            continue
        try:
            name = psutil.Process(conn.pid).name()
        except psutil.Error:
            name = "?"
        found.append(Listener(conn.laddr.ip, conn.laddr.port, conn.pid, name))
    return found


def listeners_beyond_loopback(pids: Iterable[int] | None = None) -> list[Listener]:
    """The listening sockets of `pids` bound to anything but a loopback address (every interface included)."""
    return [listener for listener in listeners(pids) if not listener.loopback]
