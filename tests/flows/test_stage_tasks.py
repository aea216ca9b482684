"""Stage tasks under a real Prefect API: retries of retryable failures, fail-fast on fatal ones, skipping.

Faults come from the workers' own test hook (FORGE_FAULT, forge_core/faults.py), not from mocks: a rank really
SIGKILLs itself or really raises, and torchrun, the launcher and Prefect handle it as they would in production.
"""

from __future__ import annotations

import asyncio

import pytest
from prefect import flow

from forge_core.config import config_to_json, load_config
from forge_core.storage import ObjectStore
from tasks import prepare_data, train_sft

pytestmark = pytest.mark.integration


@flow(name="sft-only")
def sft_only(config_json: str, sft_retries: int) -> str:
    data_uri = prepare_data(config_json)
    return train_sft.with_options(retries=sft_retries, retry_delay_seconds=0)(config_json, data_uri)


def _task_runs(flow_run_id) -> dict[str, object]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    async def read():
        async with get_client() as client:
            return await client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
            )

    return {run.name.rsplit("-", 1)[0]: run for run in asyncio.run(read())}


def _config_json(tiny_overrides, *more):
    return config_to_json(load_config("configs/tiny_test.yaml", [*tiny_overrides, *more]))


def test_killed_rank_is_retried_and_resumes(prefect_api, tiny_overrides, tmp_path, monkeypatch):
    # Rank 1 dies after step 3, i.e. after the committed step-2 checkpoint; the retry must resume from it.
    monkeypatch.setenv("FORGE_FAULT", "kill_rank:1:3")
    monkeypatch.setenv("FORGE_FAULT_ONCE", str(tmp_path / "fault-fired"))
    config_json = _config_json(tiny_overrides)

    state = sft_only(config_json, sft_retries=1, return_state=True)

    assert state.is_completed(), state.message
    sft_uri = state.result()
    runs = _task_runs(state.state_details.flow_run_id)
    assert runs["train_sft"].run_count == 2
    assert (tmp_path / "fault-fired").exists()
    store = ObjectStore(load_config("configs/tiny_test.yaml", tiny_overrides).storage.root)
    manifest = store.read_manifest(sft_uri)
    assert manifest.metrics["resumed_from_step"] == 2


def test_fatal_error_is_not_retried_and_names_the_cause(prefect_api, tiny_overrides, monkeypatch):
    monkeypatch.setenv("FORGE_FAULT", "raise_rank:0:1")
    config_json = _config_json(tiny_overrides)

    state = sft_only(config_json, sft_retries=2, return_state=True)

    assert state.is_failed()
    runs = _task_runs(state.state_details.flow_run_id)
    assert runs["train_sft"].run_count == 1
    with pytest.raises(Exception, match="InjectedFault"):
        state.result()


def test_committed_stages_are_skipped_on_rerun(prefect_api, tiny_overrides):
    config_json = _config_json(tiny_overrides)
    first = sft_only(config_json, sft_retries=0, return_state=True)
    assert first.is_completed(), first.message
    store = ObjectStore(load_config("configs/tiny_test.yaml", tiny_overrides).storage.root)
    committed_at = store.read_manifest(first.result()).committed_at

    second = sft_only(config_json, sft_retries=0, return_state=True)

    assert second.result() == first.result()
    assert store.read_manifest(second.result()).committed_at == committed_at
