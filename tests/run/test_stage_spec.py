"""StageSpec: write/read round trip through real stores, validation, and the RunConfig inside."""

from __future__ import annotations

import pytest

from forge_core.config import ConfigError, config_to_dict, load_config
from forge_core.config.schema import StorageConfig
from forge_core.run.spec import SPEC_NAME, StageSpec, read_spec, write_spec


def make_spec(output_uri: str, **changes) -> StageSpec:
    cfg = load_config(None, ["sft.steps=7", "rollout.rewards.0.kwargs.tol=0.5"])
    fields = {
        "stage": "sft",
        "config": config_to_dict(cfg),
        "inputs": {"data": "file:///store/data/abc"},
        "output_uri": output_uri,
        "params": {"iteration": 3},
    }
    fields.update(changes)
    return StageSpec(**fields)


def test_write_read_round_trip_on_a_folder(file_store):
    spec = make_spec(file_store.artifact_uri("sft", "k1"))
    uri = write_spec(file_store, spec)
    assert uri == spec.output_uri + "/" + SPEC_NAME == spec.uri
    back = read_spec(uri)
    assert back == spec
    cfg = back.run_config()
    assert cfg.sft.steps == 7 and cfg.rollout.rewards[0].kwargs == {"tol": 0.5}
    # Identical specs are byte-identical on storage (a retry rewrites the same object).
    assert file_store.get_bytes(uri).decode() == spec.to_json()


def test_read_spec_by_plain_local_path(file_store):
    uri = write_spec(file_store, make_spec(file_store.artifact_uri("sft", "k2")))
    assert read_spec(file_store.local_path(uri)).params == {"iteration": 3}


@pytest.mark.integration
def test_round_trip_on_s3_with_endpoint_from_storage_config(s3_store, s3_endpoint):
    spec = make_spec(s3_store.artifact_uri("sft", "k3"), stage="grpo")
    uri = write_spec(s3_store, spec)
    assert uri.startswith("s3://")
    assert read_spec(uri, StorageConfig(endpoint_url=s3_endpoint, retries=1, retry_backoff_s=0.01)) == spec


def test_missing_spec_names_the_uri(tmp_path):
    with pytest.raises(FileNotFoundError, match="stage spec .*_spec.json does not exist"):
        read_spec(f"file://{tmp_path}/nothing/_spec.json")


def test_invalid_specs_are_value_errors(tmp_path):
    with pytest.raises(ValueError, match="stage='train': unknown; valid stages: prepare, sft, rollout, grpo"):
        make_spec("file:///x", stage="train")
    with pytest.raises(ValueError, match="inputs="):
        make_spec("file:///x", inputs={"data": 3})
    with pytest.raises(ValueError, match="output_uri=''"):
        make_spec("")
    with pytest.raises(ValueError, match="not plain JSON"):
        make_spec("file:///x", params={"when": object()})
    bad = tmp_path / "_spec.json"
    bad.write_text('{"stage": "sft", "config": {}}')
    with pytest.raises(ValueError, match=r"missing keys \['inputs', 'output_uri', 'params'\]"):
        read_spec(str(bad))
    bad.write_text("not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        read_spec(str(bad))


def test_run_config_reports_bad_config_inside_a_spec():
    spec = make_spec("file:///x", config={"sft": {"steps": "many"}})
    with pytest.raises(ConfigError, match="sft.steps='many': expected an int") as exc_info:
        spec.run_config()
    assert "the sft stage spec for file:///x" in str(exc_info.value)
