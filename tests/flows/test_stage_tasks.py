"""Stage tasks under a real Prefect API: retries of retryable failures, fail-fast on fatal ones, skipping.

Faults come from the workers' own test hook (FORGE_FAULT, forge_core/faults.py), not from mocks: a rank really
SIGKILLs itself or really raises, and torchrun, the launcher and Prefect handle it as they would in production.
Each test gives its SFT a step count no other test uses, so its SFT really runs whatever ran before it; the
data prep is shared through the session's store (tests/flows/conftest.py).
"""

from __future__ import annotations

import asyncio
import json

import pytest
from prefect import flow
from prefect_readers import task_runs

from forge_core.config import config_from_dict, config_to_json, load_config
from forge_core.storage import ObjectStore
from tasks import run_as_task, stage_task

pytestmark = pytest.mark.integration

SKIPPED_LOG = "output already committed"  # what run_stage logs when it skips a stage


@flow(name="sft-only")
def sft_only(config_json: str, sft_retries: int) -> str:
    cfg = config_from_dict(json.loads(config_json))
    data_uri = run_as_task(cfg, "prepare", {})
    sft = stage_task(cfg, "sft").with_options(retries=sft_retries, retry_delay_seconds=0)
    return sft(cfg, "sft", {"data": data_uri})


def _task_run_log(task_run_id) -> str:
    """Every log line of a task run, as the API (and the UI) has them."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterTaskRunId
    from prefect.client.schemas.sorting import LogSort
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=60)  # logs travel to the API in batches

    async def read():
        async with get_client() as client:
            return await client.read_logs(
                log_filter=LogFilter(task_run_id=LogFilterTaskRunId(any_=[task_run_id])),
                sort=LogSort.TIMESTAMP_ASC,
            )

    return "\n".join(log.message for log in asyncio.run(read()))


def _config(tiny_overrides, *more):
    return load_config("configs/tiny_test.yaml", [*tiny_overrides, *more])


def test_killed_rank_is_retried_resumes_and_a_rerun_skips(prefect_api, tiny_overrides, tmp_path, monkeypatch):
    # Rank 1 dies after step 3, i.e. after the committed step-2 checkpoint; the retry must resume from it.
    monkeypatch.setenv("FORGE_FAULT", "kill_rank:1:3@sft")
    monkeypatch.setenv("FORGE_FAULT_ONCE", str(tmp_path / "fault-fired"))
    cfg = _config(tiny_overrides, "sft.steps=5", "sft.checkpoint_every=2")
    config_json = config_to_json(cfg)

    state = sft_only(config_json, sft_retries=1, return_state=True)

    assert state.is_completed(), state.message
    assert (tmp_path / "fault-fired").exists()
    sft_run = task_runs(state.state_details.flow_run_id)["train_sft"]
    assert sft_run.run_count == 2
    # The retry is visible where an operator looks: the task's log names the failure and the retry.
    log = _task_run_log(sft_run.id)
    assert "rank 1: killed by SIGKILL (exit -9) [retryable;" in log and "Retry 1/1" in log, log
    store = ObjectStore.from_config(cfg.storage)
    sft_uri = state.result()
    manifest = store.read_manifest(sft_uri)
    assert manifest.metrics["resumed_from_step"] == 2
    assert manifest.metrics["steps"] == 5

    # Re-running the flow skips both committed stages: same outputs, untouched manifests, one run each.
    committed_at = {uri: store.read_manifest(uri).committed_at for uri in store.list_committed("data")}
    committed_at[sft_uri] = manifest.committed_at
    monkeypatch.delenv("FORGE_FAULT")

    rerun = sft_only(config_json, sft_retries=1, return_state=True)

    assert rerun.result() == sft_uri
    for name, task_run in task_runs(rerun.state_details.flow_run_id).items():
        assert task_run.state.is_completed() and task_run.run_count == 1, (name, task_run.state)
        assert SKIPPED_LOG in _task_run_log(task_run.id), name
    assert {uri: store.read_manifest(uri).committed_at for uri in committed_at} == committed_at


def test_fatal_error_is_not_retried_and_names_the_cause(prefect_api, tiny_overrides, monkeypatch):
    monkeypatch.setenv("FORGE_FAULT", "raise_rank:0:1@sft")
    config_json = config_to_json(_config(tiny_overrides, "sft.steps=3"))

    state = sft_only(config_json, sft_retries=2, return_state=True)

    assert state.is_failed()
    sft_run = task_runs(state.state_details.flow_run_id)["train_sft"]
    assert sft_run.run_count == 1
    assert sft_run.state.is_failed()
    # The worker's own exception, through torchrun's error file and the launcher, ends in the flow's failure.
    with pytest.raises(Exception, match="InjectedFault"):
        state.result()
