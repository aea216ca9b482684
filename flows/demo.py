"""`make demo`: post-train a tiny model end to end on this CPU and show what happened.

    make demo                                   # = .venv/bin/python -m flows.demo
    .venv/bin/python -m flows.demo grpo.iterations=2 seed=1   # overrides on top of configs/demo_cpu.yaml

Runs the `post-train` flow on Prefect's ephemeral local API with configs/demo_cpu.yaml: a local-folder object
store, wandb offline, vLLM on CPU, torchrun with 2 ranks for SFT and GRPO. Ends with a table of stages,
held-out accuracy per policy, the plot, the artifacts and how to upload the wandb runs later.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

DEMO_CONFIG = "configs/demo_cpu.yaml"


def _prepare_environment() -> None:
    # A cold SQLite database can take longer than Prefect's 20 s default to start on 2 cores.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("FORGE_PROGRESS_BARS", "1")


def _wandb_runs(log_dir: Path) -> list[Path]:
    return sorted(log_dir.glob("**/wandb/offline-run-*"))


def main(overrides: list[str]) -> int:
    _prepare_environment()
    from flows.post_train import post_train, print_report
    from forge_core.config import load_config

    cfg = load_config(DEMO_CONFIG, overrides)
    print(
        f"forgeflow demo: {cfg.model.family}/{cfg.model.flavor} on {cfg.data.demo.num_digits}-digit addition, "
        f"{cfg.sft.steps} SFT steps, {cfg.grpo.iterations} GRPO iterations; store {cfg.storage.root}"
    )
    summary = post_train(DEMO_CONFIG, overrides)
    print_report(summary)
    runs = _wandb_runs(Path(cfg.logging.dir))
    if runs:
        print(f"wandb:        {len(runs)} offline runs under {Path(cfg.logging.dir).resolve()}")
        print(
            f"              upload later with: wandb sync {Path(cfg.logging.dir).resolve()}/**/wandb/offline-run-*"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
