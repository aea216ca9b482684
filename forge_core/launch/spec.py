"""What to launch: `LaunchSpec`, and how it becomes a command line and an environment."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

from forge_core.launch.heartbeat import HEARTBEAT_DIR_ENV
from forge_core.launch.owner import OWNER_ENV, Owner

# Set by the launcher in every child; a user value would break leftover-process search or error capture.
LAUNCH_ID_ENV = "FORGE_LAUNCH_ID"
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
# torchrun substitutes ${rank} per worker; every worker line then starts with "[rank<global rank>]:".
LOG_PREFIX_TEMPLATE_ENV = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"
RANK_LINE_PREFIX_TEMPLATE = "[rank${rank}]:"
# The launch's deadline in seconds: a worker sets its collectives' timeout above it
# (forge_core.engine.distributed.process_group_timeout_s), so the launcher's deadline ends a hung rank first.
DEADLINE_ENV = "FORGE_LAUNCH_DEADLINE_S"
_RESERVED_ENV = (
    LAUNCH_ID_ENV, OWNER_ENV, ERROR_FILE_ENV, LOG_PREFIX_TEMPLATE_ENV, DEADLINE_ENV, HEARTBEAT_DIR_ENV
)  # fmt: skip


@dataclass(frozen=True)
class NodeRendezvous:
    """One node's part in a multi-node launch whose c10d rendezvous was arranged at run time
    (forge_core.compute.gang): `nnodes` nodes, this one `node_rank`, node 0's store at `endpoint`
    (host:port), `run_id` shared by every node of the launch, `local_addr` how the peers reach this node."""

    nnodes: int
    node_rank: int
    endpoint: str
    run_id: str
    local_addr: str | None = None

    def launch_fields(self) -> dict:
        """The LaunchSpec fields this node's launch takes from it."""
        return {
            "nnodes": self.nnodes,
            "node_rank": self.node_rank,
            "rdzv_endpoint": self.endpoint,
            "rdzv_id": self.run_id,
            "rdzv_is_host": self.node_rank == 0,
            "local_addr": self.local_addr,
        }


@dataclass(frozen=True)
class LaunchSpec:
    """One launch: `python -m <module> <args>` under torchrun (or plain python when `torchrun=False`).

    `rdzv_endpoint=None` with `nnodes=1` uses torchrun's `--standalone` (a free local port per launch);
    multi-node launches give the c10d endpoint `host:port` and start one launch per node.
    `deadline_s` counts from the start; `kill_grace_s` is how long SIGTERMed processes get before SIGKILL.
    `rank0_only_logs` forwards only global rank 0's lines (and the launcher's/torchrun's own) to the log;
    the `tail` of the result always keeps every rank.
    """

    module: str
    args: list[str] = field(default_factory=list)
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    deadline_s: float = 3600.0
    rank0_only_logs: bool = False
    torchrun: bool = True
    # Shared by all nodes of one multi-node job; None = torchrun's default.
    rdzv_id: str | None = None
    # Multi-node: whether this node hosts the c10d rendezvous store (node 0 does), stated rather than guessed
    # from the endpoint's host name (several nodes on one host would all guess yes); None = torchrun guesses.
    rdzv_is_host: bool | None = None
    # This node's address as its peers reach it (torchrun --local-addr); None = torchrun's default (its FQDN).
    local_addr: str | None = None
    kill_grace_s: float = 10.0
    tail_lines: int = 200

    def __post_init__(self) -> None:
        errors = self.check()
        if errors:
            raise ValueError("invalid LaunchSpec: " + "; ".join(errors))

    def check(self) -> list[str]:
        errors = []
        if not self.module or not isinstance(self.module, str):
            errors.append(f"module={self.module!r}: give a Python module path such as 'forge_core.run'")
        if not all(isinstance(a, str) for a in self.args):
            errors.append(f"args={self.args!r}: every argument must be a str")
        if self.nproc_per_node < 1 or self.nnodes < 1:
            errors.append(f"nproc_per_node={self.nproc_per_node}, nnodes={self.nnodes}: both must be >= 1")
        if not 0 <= self.node_rank < max(self.nnodes, 1):
            errors.append(f"node_rank={self.node_rank}: must be in [0, nnodes={self.nnodes})")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            errors.append(f"nnodes={self.nnodes}: multi-node launches need rdzv_endpoint='host:port'")
        if (self.rdzv_is_host is not None or self.local_addr is not None) and self.rdzv_endpoint is None:
            errors.append(
                f"rdzv_is_host={self.rdzv_is_host!r}, local_addr={self.local_addr!r}: only for a c10d rendezvous; "
                "give rdzv_endpoint='host:port' too"
            )
        if self.rdzv_endpoint is not None and ":" not in self.rdzv_endpoint:
            errors.append(f"rdzv_endpoint={self.rdzv_endpoint!r}: expected 'host:port'")
        if not self.torchrun and (self.nproc_per_node, self.nnodes, self.rdzv_endpoint) != (1, 1, None):
            errors.append(
                f"torchrun=False with nproc_per_node={self.nproc_per_node}, nnodes={self.nnodes}, "
                f"rdzv_endpoint={self.rdzv_endpoint!r}: plain python runs one process; set torchrun=True"
            )
        if self.deadline_s <= 0:
            errors.append(f"deadline_s={self.deadline_s}: must be > 0")
        if self.kill_grace_s < 0:
            errors.append(f"kill_grace_s={self.kill_grace_s}: must be >= 0")
        if self.tail_lines < 1:
            errors.append(f"tail_lines={self.tail_lines}: must be >= 1")
        bad_values = sorted(k for k, v in self.env.items() if not isinstance(v, str))
        if bad_values:
            errors.append(f"env keys {bad_values}: values must be str")
        reserved = sorted(k for k in self.env if k in _RESERVED_ENV)
        if reserved:
            errors.append(f"env keys {reserved}: set by the launcher for every launch; remove them from env")
        return errors

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


def build_command(spec: LaunchSpec, log_dir: str) -> list[str]:
    """The argv for this spec; torchrun writes its per-rank logs and error files under `log_dir`."""
    if not spec.torchrun:
        return [sys.executable, "-m", spec.module, *spec.args]
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc-per-node", str(spec.nproc_per_node),
        "--nnodes", str(spec.nnodes),
        "--node-rank", str(spec.node_rank),
        *_rendezvous_args(spec),
        # Retries belong to the caller (Prefect), which also decides whether a failure is worth one.
        "--max-restarts", "0",
        "--log-dir", log_dir,
        # Tee both streams of every rank so each line reaches us prefixed with its rank.
        "--tee", "3",
        "-m", spec.module, *spec.args,
    ]  # fmt: skip


def _rendezvous_args(spec: LaunchSpec) -> list[str]:
    if spec.rdzv_endpoint is None:
        return ["--standalone"]
    args = ["--rdzv-backend", "c10d", "--rdzv-endpoint", spec.rdzv_endpoint]
    if spec.rdzv_id is not None:
        args += ["--rdzv-id", spec.rdzv_id]
    if spec.rdzv_is_host is not None:
        args += ["--rdzv-conf", f"is_host={int(spec.rdzv_is_host)}"]
    if spec.local_addr is not None:
        args += ["--local-addr", spec.local_addr]
    return args


def build_env(
    spec: LaunchSpec,
    launch_id: str,
    error_file: str,
    heartbeat_dir: str | None = None,
) -> dict[str, str]:
    """os.environ, then the spec's env, then the launcher's own keys (validated not to clash)."""
    env = dict(os.environ)
    env.update(spec.env)
    env[LAUNCH_ID_ENV] = launch_id
    env[DEADLINE_ENV] = f"{spec.deadline_s:g}"
    if heartbeat_dir is not None:
        env[HEARTBEAT_DIR_ENV] = heartbeat_dir  # where ranks write their progress (heartbeat.py)
    else:
        env.pop(HEARTBEAT_DIR_ENV, None)  # never the launching process's own launch's folder
    env[OWNER_ENV] = str(Owner.this_process())  # the launch ends itself once this process is gone
    # For torchrun this is the agent's own file (it copies the root-cause rank's record into it);
    # torchrun points each rank at its own file under --log-dir. For plain python it is the worker's file.
    env[ERROR_FILE_ENV] = error_file
    # Pipes and tee files are block-buffered otherwise; lines would arrive late and out of order.
    env.setdefault("PYTHONUNBUFFERED", "1")
    if spec.torchrun:
        env[LOG_PREFIX_TEMPLATE_ENV] = RANK_LINE_PREFIX_TEMPLATE
    return env
