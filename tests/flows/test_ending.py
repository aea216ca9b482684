"""Every run ends the same way, whichever entry point started it (`forgeflow run`, `make demo`, `python -m
flows.post_train`: flows.report.finish_run): the stage table, the learning table, the final policy with the
command that exports it, the plot, the flow run, the summary file, the wandb runs; and it records the run for
`forgeflow export last` and `forgeflow status` (flows.last_run). A run that GRPO's no-signal watch stops ends
the same way, after evaluating the last policy it trained.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from flows.cli import main
from flows.last_run import read_run
from forge_core.config import load_config
from forge_core.storage import ObjectStore

pytestmark = pytest.mark.integration


def test_a_run_stopped_without_learning_signal_evaluates_its_last_policy_and_prints_the_ending(
    prefect_api, tiny_overrides, capsys
):
    """A constant reward: every group scores the same, so GRPO makes no step; K=1 stops after grpo-1."""
    overrides = [
        *tiny_overrides,
        "rollout.rewards=[{name: 'tests.flows.constant_reward:one'}]",
        "grpo.iterations=3",
        "grpo.max_no_signal_iterations=1",
        "rollout.engine_lifetime=flow",  # one engine and one trainer job for the flow run
        "grpo.trainer_lifetime=flow",
        "launch.sft.nproc_per_node=1",
        "launch.grpo.nproc_per_node=1",
    ]

    assert main(["run", "configs/tiny_test.yaml", *overrides]) == 1  # stopped: not the run asked for

    out = capsys.readouterr().out
    cfg = load_config("configs/tiny_test.yaml", overrides)
    record = read_run(cfg.logging.dir)
    stages = [row["stage"] for row in record["stages"]]
    assert stages == ["prepare", "sft", "eval-sft", "rollout-1", "grpo-1", "eval-grpo-1"]  # evaluated, then stopped
    assert [point["label"] for point in record["evals"]] == ["sft", "grpo-1"]
    assert re.match(r"stopped after 1 GRPO iterations in a row without learning signal \(last: grpo-1: it made no "
                    r"optimizer step and its rollouts carried no reward variance.*grpo.max_no_signal_iterations=1",
                    record["stopped"]), record["stopped"]
    # The ending, as every entry point prints it.
    assert record["stopped"] in out
    for row in record["stages"]:
        assert re.search(rf"^{row['stage']}\s.*{re.escape(row['artifact'])}", out, re.MULTILINE), row["stage"]
    assert "Held-out exact match" in out
    assert f"forgeflow export {record['final_policy_uri']}/policy " in out
    assert record["plot_path"] in out and record["flow_run_id"] in out
    assert json.loads(Path(re.search(r"^summary:\s+(\S+)", out, re.MULTILINE)[1]).read_text()) == record
    store = ObjectStore.from_config(cfg.storage)
    assert store.read_manifest(record["final_policy_uri"]).metrics["train/steps"] == 0
    assert record["final_policy_uri"] == record["evals"][-1]["policy_uri"]
