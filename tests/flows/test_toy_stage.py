"""A stage added through the stage registry alone (tests/toy_stage.py: one module with its body and one
record; nothing else in forgeflow names it) runs through the flow machinery under a real Prefect API: planned,
run by its runner (its own worker launch, which finds the stage through FORGE_STAGE_MODULES), committed by the
worker scaffold, and skipped on a re-run. The data prep is shared through the session's store."""

from __future__ import annotations

import json

import pytest
from prefect import flow
from prefect_readers import task_runs
from test_stage_tasks import SKIPPED_LOG, _task_run_log

from forge_core.config import config_from_dict, config_to_json, load_config
from forge_core.storage import ObjectStore
from tasks import run_as_task
from tests import toy_stage

pytestmark = pytest.mark.integration


@flow(name="toy-stage")
def toy_flow(config_json: str) -> dict[str, str]:
    cfg = config_from_dict(json.loads(config_json))
    data_uri = run_as_task(cfg, "prepare", {})
    return {"data": data_uri, "toy": run_as_task(cfg, "toy_count", {"data": data_uri})}


def test_a_stage_added_through_the_registry_alone_runs_commits_and_is_skipped_on_rerun(prefect_api, tiny_overrides):
    cfg = load_config("configs/tiny_test.yaml", tiny_overrides)
    store = ObjectStore.from_config(cfg.storage)

    state = toy_flow(config_to_json(cfg), return_state=True)

    assert state.is_completed(), state.message
    uris = state.result()
    manifest = store.read_manifest(uris["toy"])
    assert (manifest.kind, manifest.stage) == (toy_stage.TOY.kind, "toy_count")
    assert manifest.inputs["data"].uri == uris["data"]
    counts = store.reader(uris["toy"]).read_json("counts.json")
    assert counts["rows"] == store.read_manifest(uris["data"]).metrics["rows"]["sft"] == manifest.metrics["rows"]
    assert counts["longest"] >= 1
    toy_run = task_runs(state.state_details.flow_run_id)["toy_count"]
    assert toy_run.run_count == 1
    assert "toy_count: running in the Ray cluster" in _task_run_log(toy_run.id)

    rerun = toy_flow(config_to_json(cfg), return_state=True)

    assert rerun.result() == uris
    assert store.read_manifest(uris["toy"]).committed_at == manifest.committed_at
    toy_rerun = task_runs(rerun.state_details.flow_run_id)["toy_count"]
    assert SKIPPED_LOG in _task_run_log(toy_rerun.id)
