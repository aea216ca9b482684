"""Run one stage of a forgeflow pipeline from its spec (what a task launches, under torchrun or not):

    python -m forge_core.run <stage> --spec <output_uri>/_spec.json [--endpoint-url http://host:9000]
    torchrun --standalone --nproc-per-node 2 -m forge_core.run sft --spec file:///.../_spec.json

Stages: prepare, sft, rollout, grpo, evaluate; each is `forge_core.run.<stage>:main(spec)`. Jobs (JOBS, e.g.
`python -m forge_core.run grpo-job --orders <dir>`) take their own arguments. The stage runs
wrapped in forge_core.launch.record_errors (torch's error recorder), so an exception on any rank lands in
TORCHELASTIC_ERROR_FILE where the launcher reads it. `--endpoint-url` names a custom S3 endpoint for
reading the spec itself (the FORGE_S3_ENDPOINT_URL / AWS_ENDPOINT_URL environment variables work too).

Under forge_core.launch (FORGE_LAUNCH_OWNER set) every rank first starts the owner watchdog: once the
launching flow process is gone the launch ends itself within ~2 s and no commit is published meanwhile
(forge_core.launch.owner).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable

from forge_core.config.schema import STAGES, StorageConfig

# Long-lived jobs (not stages): `python -m forge_core.run <job> <its own arguments>`.
JOBS = {"grpo-job": "forge_core.run.grpo_job"}  # the GRPO trainer job of grpo.trainer_lifetime=flow


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    _guard_against_a_dead_owner()
    if argv and argv[0] in JOBS:
        job_main = importlib.import_module(JOBS[argv[0]]).main
        _error_recorder()(job_main)(argv[1:])
        return 0
    args = _parse_args(argv)
    stage_main = _import_stage_main(args.stage)
    _error_recorder()(_run_stage)(args.stage, args.spec, args.endpoint_url, stage_main)
    return 0


def _guard_against_a_dead_owner() -> None:
    """Launched by forge_core.launch: end the whole launch once the launching (flow) process is gone, and never
    commit on its behalf (forge_core.launch.owner). Nothing happens in a process started by hand."""
    from forge_core.launch.owner import check_owner_alive, guard_launched_worker
    from forge_core.storage.writer import add_pre_commit_check

    if guard_launched_worker() is not None:
        add_pre_commit_check(check_owner_alive)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m forge_core.run", description=__doc__.splitlines()[0])
    parser.add_argument("stage", help=f"one of: {', '.join(STAGES)}")
    parser.add_argument("--spec", required=True, help="URI of the stage spec (<output_uri>/_spec.json)")
    parser.add_argument("--endpoint-url", default=None, help="S3-compatible endpoint for reading the spec")
    args = parser.parse_args(argv)
    if args.stage not in STAGES:
        parser.error(f"unknown stage {args.stage!r}; valid stages: {', '.join(STAGES)}")
    return args


def _import_stage_main(stage: str) -> Callable:
    module_name = f"forge_core.run.{stage}"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise  # the stage exists but one of its own imports is missing: show that error as it is
        raise SystemExit(
            f"forge_core.run: stage {stage!r} has no module {module_name} in this installation"
        ) from exc
    stage_main = getattr(module, "main", None)
    if not callable(stage_main):
        raise SystemExit(f"forge_core.run: {module_name} defines no main(spec) function")
    return stage_main


def _run_stage(stage: str, spec_uri: str, endpoint_url: str | None, stage_main: Callable) -> None:
    from forge_core.faults import set_current_stage
    from forge_core.run.scaffold import run_spec
    from forge_core.run.spec import read_spec

    set_current_stage(stage)  # FORGE_FAULT entries ending in @<stage> fire only in this stage's workers
    storage_cfg = StorageConfig(endpoint_url=endpoint_url) if endpoint_url else None
    spec = read_spec(spec_uri, storage_cfg)
    if spec.stage != stage:
        raise ValueError(
            f"stage spec {spec_uri} is for stage {spec.stage!r}, but the worker was started as {stage!r}; "
            f"run `python -m forge_core.run {spec.stage} --spec {spec_uri}`"
        )
    run_spec(stage_main, spec)


def _error_recorder() -> Callable[[Callable], Callable]:
    """forge_core.launch's recorder: torch's `record` plus the exception's class hierarchy, which the launcher
    uses to tell a fatal user error (ValueError, ConfigError) from a retryable crash."""
    from forge_core.launch import record_errors

    return record_errors


if __name__ == "__main__":  # the guard matters: vLLM's worker processes re-import this module
    sys.exit(main())
