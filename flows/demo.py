"""`make demo`: post-train a tiny model end to end on this CPU and show what happened.

    make demo                                          # = .venv/bin/python -m flows.demo
    .venv/bin/python -m flows.demo seed=1              # key=value overrides on top of configs/demo_cpu.yaml
    .venv/bin/python -m flows.demo --verbose grpo.iterations=2   # also stream every worker's log lines
    .venv/bin/python -m flows.demo --config configs/demo_tools_cpu.yaml   # the tool-use demo (make demo-tools)

Runs the `post-train` flow on Prefect's ephemeral local API. The terminal shows stage lines and progress bars;
worker logs go to the Prefect API (and the terminal with --verbose). It ends with the run's report
(flows.report.finish_run). Re-running with the same config skips every committed stage. Exits 1 when GRPO
stopped early for lack of learning signal, 2 on a config error.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

DEMO_CONFIG = str(Path(__file__).resolve().parents[1] / "configs" / "demo_cpu.yaml")


def _prepare_environment() -> None:
    """Settings Prefect reads at import time, so this runs before anything imports prefect."""
    from flows.local_prefect import use_local_server_settings

    use_local_server_settings()
    os.environ.setdefault("FORGE_PROGRESS_BARS", "1")


class _HideWorkerLines(logging.Filter):
    """Drops task-run INFO records (forwarded worker lines) from the console; the Prefect API still gets them."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.name.startswith("prefect.task_runs") and record.levelno < logging.WARNING)


def _quiet_worker_logs() -> None:
    import prefect  # noqa: F401 - importing prefect installs its console handler on the root logger

    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, _HideWorkerLines) for f in handler.filters):
            handler.addFilter(_HideWorkerLines())


def run_demo(overrides: list[str], verbose: bool = False, config: str = DEMO_CONFIG) -> dict:
    """Run the demo flow with `overrides` on top of `config`, print its report; returns the summary dict
    (with `summary_path`). Raises ConfigError before Prefect starts on a bad config."""

    _prepare_environment()
    from flows.post_train import post_train
    from flows.report import finish_run
    from forge_core.config import load_config
    from forge_core.credentials import hide_credentials_in_overrides
    from forge_core.models.flavors import from_scratch_flavor

    cfg = load_config(config, overrides)  # fails here, before Prefect starts, on a bad override
    if not verbose:
        _quiet_worker_logs()
    samples = cfg.rollout.prompts_per_iteration * cfg.rollout.sampling.group_size
    task = {"demo": "addition", "demo_tools": "multiplication with a calculator tool"}.get(cfg.data.source, "")
    stops_early = cfg.sft.select == "best" and (cfg.sft.patience or cfg.sft.target is not None)
    print(
        f"forgeflow demo: {cfg.model.family}/{from_scratch_flavor(cfg.model.flavor)} from scratch on {cfg.data.demo.num_digits}-digit "
        f"{task}; SFT {'up to ' if stops_early else ''}{cfg.sft.steps} steps on {cfg.data.demo.num_sft} examples, then {cfg.grpo.iterations} "
        f"GRPO iterations of {samples} {'episodes' if cfg.rollout.env.enabled else 'rollouts'}; held-out eval on "
        f"{cfg.eval.num_prompts} prompts\nstore {cfg.storage.root}, runs {cfg.logging.dir}",
        flush=True,
    )
    started = time.time()
    summary = post_train(config, hide_credentials_in_overrides(overrides))  # Prefect records parameters
    return finish_run(summary, cfg, started, config)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flows.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--verbose", action="store_true", help="also print every worker's log lines")
    parser.add_argument(
        "--config", default=DEMO_CONFIG, help="the run's YAML (default configs/demo_cpu.yaml; the tool-use demo: "
        "configs/demo_tools_cpu.yaml)"
    )
    parser.add_argument("overrides", nargs="*", help="dotted.key=value on top of the config")
    args = parser.parse_args(argv)
    from forge_core.config import ConfigError

    try:
        summary = run_demo(args.overrides, verbose=args.verbose, config=str(Path(args.config).resolve()))
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    return 1 if summary.get("stopped") else 0


if __name__ == "__main__":
    sys.exit(main())
