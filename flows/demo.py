"""`make demo`: post-train a tiny model end to end on this CPU and show what happened.

    make demo                                          # = .venv/bin/python -m flows.demo
    .venv/bin/python -m flows.demo seed=1              # key=value overrides on top of configs/demo_cpu.yaml
    .venv/bin/python -m flows.demo --verbose grpo.iterations=2   # also stream every worker's log lines
    .venv/bin/python -m flows.demo --config configs/demo_tools_cpu.yaml   # the tool-use demo (make demo-tools)

Runs the `post-train` flow on Prefect's ephemeral local API with configs/demo_cpu.yaml: a local-folder object
store (./.forge-store), wandb offline (./.forge-runs), vLLM on CPU, torchrun with 2 ranks for SFT and GRPO.
The terminal shows one line per stage start/finish and a progress bar for SFT and GRPO; worker logs go to the
Prefect API (and to the terminal with --verbose). It ends with the stage table (duration, key metric,
artifact URI), held-out accuracy after SFT and after every GRPO iteration, the plot, the Prefect flow-run id
and the `wandb sync` command that uploads the offline runs later. Re-running with the same config skips
every committed stage.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

DEMO_CONFIG = str(Path(__file__).resolve().parents[1] / "configs" / "demo_cpu.yaml")


def _prepare_environment() -> None:
    """Settings Prefect reads at import time, so this runs before anything imports prefect."""
    # A cold SQLite database can take longer than Prefect's 20 s default to start on 2 cores.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("FORGE_PROGRESS_BARS", "1")


class _HideWorkerLines(logging.Filter):
    """Keeps the terminal to the flow's stage lines: task-run INFO records (every worker's log line, which
    the stage tasks forward) still reach the Prefect API, only the console skips them."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.name.startswith("prefect.task_runs") and record.levelno < logging.WARNING)


def _quiet_worker_logs() -> None:
    import prefect  # noqa: F401 - importing prefect installs its console handler on the root logger

    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, _HideWorkerLines) for f in handler.filters):
            handler.addFilter(_HideWorkerLines())


def _new_wandb_runs(log_dir: Path, since: float) -> list[Path]:
    """The wandb offline runs this demo wrote (a skipped stage writes none)."""
    return sorted(p for p in log_dir.glob("*/wandb/offline-run-*") if p.stat().st_mtime >= since)


def _rollout_rewards(summary: dict, cfg) -> list[float]:
    from forge_core.storage import ObjectStore

    store = ObjectStore.from_config(cfg.storage)
    return [float(store.read_manifest(uri).metrics["reward_mean"]) for uri in summary["rollouts"]]


def print_demo_report(summary: dict, cfg, started: float) -> None:
    """The end of `make demo`: stage table, learning curve, where the plot, runs and artifacts are."""
    from flows.report import format_learning, format_table

    print("\n" + format_table(summary["stages"]))
    print("\nHeld-out exact match (greedy) after SFT and after each GRPO iteration:")
    print(format_learning(summary["evals"], _rollout_rewards(summary, cfg)))
    evals = summary["evals"]
    if cfg.rollout.env.enabled:
        from flows.report import format_tool_use
        from forge_core.storage import ObjectStore

        store = ObjectStore.from_config(cfg.storage)
        print(f"\nTool use on the held-out prompts ({cfg.rollout.env.name}: {', '.join(cfg.rollout.env.tools)}):")
        print(format_tool_use(evals, [store.read_manifest(e["eval_uri"]).metrics for e in evals]))
    if len(evals) > 1:
        gain = 100 * (evals[-1]["accuracy"] - evals[0]["accuracy"])
        print(f"GRPO changed held-out accuracy by {gain:+.1f} points over the SFT policy.")
    log_dir = Path(cfg.logging.dir).resolve()
    print(f"\nfinal policy:  {summary['final_policy_uri']}")
    print(f"plot:          {summary['plot_path']}  (also on the Prefect flow run as an image artifact)")
    print(f"flow run:      {summary['flow_run_id']}  (browse it: .venv/bin/prefect server start)")
    print(f"summary:       {summary['summary_path']}")
    runs = _new_wandb_runs(log_dir, started)
    if runs:
        print(f"wandb:         {len(runs)} offline runs under {log_dir}")
        print(f"               upload later: .venv/bin/wandb sync {log_dir}/*/wandb/offline-run-*")
    else:
        print(f"wandb:         no new runs (every training stage was already committed); see {log_dir}")
    print(f"total:         {time.time() - started:.0f}s")


def run_demo(overrides: list[str], verbose: bool = False, config: str = DEMO_CONFIG) -> dict:
    """Run the demo flow with `overrides` on top of `config` (configs/demo_cpu.yaml), print the report, return
    the flow's summary (flows.post_train.PipelineSummary as a dict)."""
    _prepare_environment()
    from flows.post_train import post_train
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
    summary["summary_path"] = str(write_summary(summary, cfg))
    print_demo_report(summary, cfg, started)
    return summary


def write_summary(summary: dict, cfg) -> Path:
    """The flow's summary as JSON next to the run's plot, for scripts (docs/demo_seeds.py reads it)."""
    run_dir = Path(summary["plot_path"]).parent if summary.get("plot_path") else Path(cfg.logging.dir)
    path = run_dir / f"summary-{summary['flow_run_id']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return path


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
        run_demo(args.overrides, verbose=args.verbose, config=str(Path(args.config).resolve()))
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
