"""A fatal error (bad data) is not retried, and its message reaches the flow's failure."""

from __future__ import annotations

import json
import re

import pytest
from fault_kit import TINY_CONFIG, flow_run, task_runs
from prefect import flow

from forge_core.config import config_from_dict, config_to_json, load_config
from tasks import stage_task

pytestmark = pytest.mark.integration


BAD_ROWS = (3, 7, 11, 15)


@flow(name="faults-prepare-only")
def prepare_only(config_json: str) -> str:
    cfg = config_from_dict(json.loads(config_json))
    return stage_task(cfg, "prepare").with_options(retries=2, retry_delay_seconds=0)(cfg, "prepare", {})


@pytest.mark.fault(
    fault="bad data: 4 of 20 source rows without their completion (20% rejected > "
    "data.max_reject_fraction=0.05)",
    where="prepare_data task (plain worker), 2 retries allowed",
    checked="the launcher calls it fatal; the task runs once; the flow run fails with the worker's message "
    "(file, row, reason, fix)",
)
def test_bad_data_fails_at_once_and_its_message_reaches_the_flow(prefect_api, tmp_path, fault_row):
    source = tmp_path / "rows.jsonl"
    # Bad data is a share of rejected rows above data.max_reject_fraction (a few bad rows are tolerated and
    # dropped): 4 of 20 rows lack their completion, 20% against a threshold of 5%, clear of the boundary.
    rows = [{"prompt": f"{i}+{i}=", "completion": str(2 * i)} for i in range(20)]
    for i in BAD_ROWS:
        rows[i] = {"prompt": f"{i}+{i}=", "answer": str(2 * i)}
    source.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = load_config(
        TINY_CONFIG,
        [
            f"storage.root=file://{tmp_path}/store",
            f"logging.dir={tmp_path}/runs",
            f"data.source={source}",
            "data.tokenizer.vocab_size=300",
            "data.max_reject_fraction=0.05",
        ],
    )

    state = prepare_only(config_to_json(cfg), return_state=True)

    assert state.is_failed()
    flow_run_id = state.state_details.flow_run_id
    assert task_runs(flow_run_id)["prepare_data"].run_count == 1
    message = flow_run(flow_run_id).state.message
    assert "fatal" in message and str(source) in message, message
    assert "4 of 20 rows rejected" in message and "data.max_reject_fraction=0.05" in message, message
    assert all(f"row {i + 1}: missing_field" in message for i in BAD_ROWS), message  # 1-based line numbers
    assert "Fix the rows" in message, message
    fault_row.fact(f"run_count=1; the flow's failure says: {_summary(message)}")


def _summary(message: str) -> str:
    """The outcome and the reject summary of the flow's failure message."""
    summary = re.search(r"\d+ of \d+ rows rejected \([^)]*\)", message)
    return f"fatal, {summary.group(0) if summary else message[:80]}"
