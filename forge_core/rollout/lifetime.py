"""Which vLLM engine a rollout/evaluate stage uses: its own (`rollout.engine_lifetime: stage`) or the flow's
long-lived engine service (`flow`, forge_core.rollout.service).

    with stage_generator(cfg, policy, seed) as generator:     # stage code: generator.generate(prompts, ...)
        run_rollout(plan, generator)
    ...
    stop_flow_engines(cfg)                                     # the flow, at its end and on failure/cancel

With `flow`, the stage connects to the `rollout.num_engines` services under `engine_state_dir(cfg)` (starting
those that do not answer), loads its policy version in place, generates (prompts split across the live
engines, a dead engine's prompts re-routed to the others: service/router.py), and disconnects; the services
keep running for the next stage.
Default state folder: `<tempdir>/forgeflow-engines-<uid>/<run name>-<hash>`, the hash over the run name, the
storage root and the working directory, so reruns and resumes of one run find the engine their stages
started while two different runs (or the same name in two projects) do not share one. Two concurrent flows of
one run (same name, root and folder) would share it and trip each other's version checks: give them distinct
`rollout.engine_state_dir`s.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path

from forge_core.config import RunConfig
from forge_core.rollout.engine import EngineOptions
from forge_core.rollout.policy import PolicyRef
from forge_core.rollout.service import EngineService, check_private, stop_services

STAGE, FLOW = "stage", "flow"


def default_engine_state_dir(cfg: RunConfig) -> Path:
    """`<tempdir>/forgeflow-engines-<uid>/<run name>-<hash>` (module docstring); the base is made private."""
    base = Path(tempfile.gettempdir()) / f"forgeflow-engines-{os.getuid()}"
    base.mkdir(mode=0o700, exist_ok=True)
    # Another user could have made it first in a shared temp dir: then it is not ours to put sockets in.
    check_private(base, "engine state base folder (set rollout.engine_state_dir to avoid it)")
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", cfg.name).strip("-")[:24] or "run"
    identity = f"{cfg.name}\0{cfg.storage.root}\0{os.getcwd()}"
    return base / f"{slug}-{hashlib.sha256(identity.encode()).hexdigest()[:10]}"


def engine_state_dir(cfg: RunConfig) -> Path:
    """Where this run's engine service lives: `rollout.engine_state_dir`, else the default."""
    configured = cfg.rollout.engine_state_dir
    return Path(configured).expanduser().absolute() if configured else default_engine_state_dir(cfg)


@contextlib.contextmanager
def stage_generator(cfg: RunConfig, policy: PolicyRef, seed: int) -> Iterator:
    """The generator a rollout/evaluate stage samples `policy` with (module docstring).

    `seed` is the engine's own seed; samples depend on the per-request seeds only.
    """
    rollout = cfg.rollout
    if rollout.engine_lifetime == FLOW:
        router = EngineService.ensure_engines(
            engine_state_dir(cfg), rollout, policy.local_dir, policy.version, seed=seed
        )
        try:
            yield router.serving(policy.version, rollout.sampling)
        finally:
            router.close()  # the services stay up for the next stage
        return
    from forge_core.rollout.pool import open_generator

    engine = EngineOptions.from_config(rollout, seed=seed)
    with open_generator(policy.local_dir, rollout.sampling, engine, rollout.num_engines) as generator:
        yield generator


def stop_flow_engines(cfg: RunConfig) -> list[int]:
    """Stop all the run's engine services (nothing when there are none); returns the pids stopped.

    Safe to call whatever `rollout.engine_lifetime` says: a flow calls it in its `finally`.
    """
    return stop_services(engine_state_dir(cfg))
