"""Which vLLM engine a rollout/evaluate stage uses: its own (`rollout.engine_lifetime: stage`) or the flow's
long-lived engine service (`flow`, forge_core.rollout.service).

    with stage_generator(cfg, policy, seed) as generator:     # generator.generate(prompts, sampling, seed)
        run_rollout(plan, generator)
    ...
    stop_flow_engines(cfg)            # the run's FlowResources (forge_core.run.resources), at the flow's end

With `flow`, the stage connects to the `rollout.num_engines` services under `engine_state_dir(cfg)` (starting
those that do not answer), loads its policy version in place, generates (prompts split across the live
engines, a dead engine's prompts re-routed to the others: forge_core.rollout.router), and disconnects; the
services keep running for the next stage.

The state folder belongs to ONE flow run (`run_identity(cfg)`: `launch.run_id`, which the flow sets to its
Prefect flow run id, else a fresh id for this process), so two concurrent runs of one config never share an
engine or a trainer job, and every stop touches only its own run's folder:
  default        `<tempdir>/forgeflow-engines-<uid>/<run name>-<hash>`, the hash over the run name, the storage
                 root, the working directory and the run identity;
  configured     `<rollout.engine_state_dir>/run-<hash of the run identity>`.
A re-run of a flow is a new run: it starts its own engines (the old run's were ended by their owner watchdog
or are reaped as orphans: forge_core.launch). The GRPO trainer job's folder is `<that folder>-trainer`
(forge_core.run.resources.trainer_state_dir). `stop_flow_engines` removes the run's folder once its services
are stopped; only the run's FlowResources calls it in a flow.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

from forge_core.artifacts.policy import PolicyRef
from forge_core.config import RunConfig
from forge_core.rollout.engine import EngineOptions
from forge_core.rollout.protocol import GenerationEngine
from forge_core.rollout.service import EngineService, check_private, stop_services

STAGE, FLOW = "stage", "flow"
RUN_FOLDER_PREFIX = "run-"
RUN_HASH_CHARS = 10
# stop_flow_engines at a flow's normal end; a failing run passes less (forge_core.run.resources).
STOP_GRACE_S = 30.0


# This process's run identity when the config names none (a flow always does: launch.run_id).
_PROCESS_RUN_ID = f"process-{uuid.uuid4().hex}"


def run_identity(cfg: RunConfig) -> str:
    """The flow run the config runs in (`launch.run_id`), else a fresh id for this process."""
    return cfg.launch.run_id or _PROCESS_RUN_ID


def with_run_id(cfg: RunConfig, run_id: str | None) -> RunConfig:
    """`cfg` with `launch.run_id` set (a fresh id when `run_id` is empty): what a flow hands its stages."""
    launch = dataclasses.replace(cfg.launch, run_id=run_id or f"run-{uuid.uuid4().hex}")
    return dataclasses.replace(cfg, launch=launch)


def _short_hash(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:RUN_HASH_CHARS]


def default_engine_state_dir(cfg: RunConfig) -> Path:
    """`<tempdir>/forgeflow-engines-<uid>/<run name>-<hash>` (module docstring); the base is made private."""
    base = Path(tempfile.gettempdir()) / f"forgeflow-engines-{os.getuid()}"
    base.mkdir(mode=0o700, exist_ok=True)
    # Another user could have made it first in a shared temp dir: then it is not ours to put sockets in.
    check_private(base, "engine state base folder (set rollout.engine_state_dir to avoid it)")
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", cfg.name).strip("-")[:24] or "run"
    return base / f"{slug}-{_short_hash(cfg.name, cfg.storage.root, os.getcwd(), run_identity(cfg))}"


def engine_state_dir(cfg: RunConfig) -> Path:
    """Where this run's engine services live: `<rollout.engine_state_dir>/run-<hash>`, else the default."""
    configured = cfg.rollout.engine_state_dir
    if not configured:
        return default_engine_state_dir(cfg)
    return Path(configured).expanduser().absolute() / f"{RUN_FOLDER_PREFIX}{_short_hash(run_identity(cfg))}"


@contextlib.contextmanager
def stage_generator(cfg: RunConfig, policy: PolicyRef, seed: int) -> Iterator[GenerationEngine]:
    """The engine(s) a rollout/evaluate stage samples `policy` with, serving `policy.version` (module
    docstring); closed at the end (the flow's services only disconnect).

    `seed` is the engine's own seed; samples depend on the per-request seeds only.
    """
    rollout = cfg.rollout
    if rollout.engine_lifetime == FLOW:
        generator: GenerationEngine = EngineService.ensure_engines(
            engine_state_dir(cfg), rollout, policy.local_dir, policy.version, seed=seed
        )
    else:
        from forge_core.rollout.pool import open_generator

        engine = EngineOptions.from_config(rollout, seed=seed)
        generator = open_generator(
            policy.local_dir, engine, rollout.num_engines, policy_version=policy.version
        )
    with contextlib.closing(generator):
        yield generator


def stop_flow_engines(cfg: RunConfig, grace_s: float = STOP_GRACE_S) -> list[int]:
    """Stop all the run's engine services (nothing when there are none) and remove the run's state folder;
    returns the pids stopped. `grace_s`: how long each service gets to exit after its shutdown request
    (then SIGTERM, and SIGKILL 5 s later); they stop concurrently.

    Safe to call whatever `rollout.engine_lifetime` says: a flow calls it in its `finally`.
    """
    state = engine_state_dir(cfg)
    stopped = stop_services(state, grace_s=grace_s)
    shutil.rmtree(state, ignore_errors=True)  # this run's only: the next stage (if any) makes it again
    return stopped
