"""Run one stage of a forgeflow pipeline from its spec (what a runner launches, under torchrun or not):

    python -m forge_core.run <stage> --spec <output_uri>/_specs/<attempt>.json [--endpoint-url http://host:9000]
    torchrun --standalone --nproc-per-node 2 -m forge_core.run sft --spec file:///.../_spec.json

Stages come from forge_core.stages (FORGE_STAGE_MODULES adds ones registered elsewhere) and run through
forge_core.run.scaffold.run_spec, wrapped in forge_core.launch.record_errors so an exception on any rank lands
in TORCHELASTIC_ERROR_FILE for the launcher. `--endpoint-url` names a custom S3 endpoint for reading the spec
(FORGE_S3_ENDPOINT_URL / AWS_ENDPOINT_URL work too). Every rank first runs `worker_process_setup`, which under
forge_core.launch starts the owner watchdog: once the launching flow process is gone the launch ends itself.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from forge_core.config.schema import StorageConfig
from forge_core.stages import is_stage, stage_names


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parse_args(argv)
    _worker_process_setup(args.stage)
    _error_recorder()(_run_stage)(args.stage, args.spec, args.endpoint_url)
    return 0


def _worker_process_setup(stage: str) -> None:
    from forge_core.run.scaffold import worker_process_setup

    worker_process_setup(stage)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m forge_core.run", description=__doc__.splitlines()[0])
    parser.add_argument("stage", help=f"one of: {', '.join(stage_names())}")
    parser.add_argument("--spec", required=True, help="URI of the stage spec (<output_uri>/_specs/<attempt>.json)")
    parser.add_argument("--endpoint-url", default=None, help="S3-compatible endpoint for reading the spec")
    args = parser.parse_args(argv)
    if not is_stage(args.stage):
        parser.error(f"unknown stage {args.stage!r}; valid stages: {', '.join(stage_names())}")
    return args


def _run_stage(stage: str, spec_uri: str, endpoint_url: str | None, run: Callable | None = None) -> None:
    """Read the spec, check it is `stage`'s, and run it (`run`: the scaffold's run_spec)."""
    from forge_core.run.spec import read_spec

    storage_cfg = StorageConfig(endpoint_url=endpoint_url) if endpoint_url else None
    spec = read_spec(spec_uri, storage_cfg)
    if spec.stage != stage:
        raise ValueError(
            f"stage spec {spec_uri} is for stage {spec.stage!r}, but the worker was started as {stage!r}; "
            f"run `python -m forge_core.run {spec.stage} --spec {spec_uri}`"
        )
    if run is None:
        from forge_core.run.scaffold import run_spec as run
    run(spec)


def _error_recorder() -> Callable[[Callable], Callable]:
    """torch's `record` plus the exception's class hierarchy, from which the launcher tells fatal from retryable."""
    from forge_core.launch import record_errors

    return record_errors


if __name__ == "__main__":  # the guard matters: vLLM's worker processes re-import this module
    sys.exit(main())
