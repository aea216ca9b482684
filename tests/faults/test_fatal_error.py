"""A fatal error (bad data) is not retried, and its message reaches the flow's failure."""

from __future__ import annotations

import json

import pytest
from fault_kit import TINY_CONFIG, flow_run, task_runs
from prefect import flow

from forge_core.config import config_to_json, load_config
from tasks import prepare_data

pytestmark = pytest.mark.integration


@flow(name="faults-prepare-only")
def prepare_only(config_json: str) -> str:
    return prepare_data.with_options(retries=2, retry_delay_seconds=0)(config_json)


@pytest.mark.fault(
    fault="bad data: a source row without its completion",
    where="prepare_data task (plain worker), 2 retries allowed",
    checked="the launcher calls it fatal; the task runs once; the flow run fails with the worker's message "
    "(file, row, reason, fix)",
)
def test_bad_data_fails_at_once_and_its_message_reaches_the_flow(prefect_api, tmp_path, fault_row):
    source = tmp_path / "rows.jsonl"
    rows = [{"prompt": f"{i}+{i}=", "completion": str(2 * i)} for i in range(10)]  # 1 bad row: 10% > 5%
    rows[7] = {"prompt": "7+7=", "answer": "14"}
    source.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = load_config(
        TINY_CONFIG,
        [
            f"storage.root=file://{tmp_path}/store",
            f"logging.dir={tmp_path}/runs",
            f"data.source={source}",
            "data.tokenizer.vocab_size=300",
        ],
    )

    state = prepare_only(config_to_json(cfg), return_state=True)

    assert state.is_failed()
    flow_run_id = state.state_details.flow_run_id
    assert task_runs(flow_run_id)["prepare_data"].run_count == 1
    message = flow_run(flow_run_id).state.message
    assert "fatal" in message and str(source) in message and "row 7" in message, message
    assert "missing_field" in message, message
    fault_row.fact("run_count=1; flow state: " + message.split("\n", 1)[0][:90] + "...")
