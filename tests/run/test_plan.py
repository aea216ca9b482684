"""Stage planning: content-addressed keys depend on what can change the output, and only on that."""

from __future__ import annotations

from forge_core.config import load_config
from forge_core.run.plan import launch_spec_for, plan_stage
from forge_core.storage import ObjectStore


def _cfg(tmp_path, *overrides):
    return load_config("configs/tiny_test.yaml", [f"storage.root=file://{tmp_path}/store", *overrides])


def _committed_input(store: ObjectStore, kind: str, key: str, payload: bytes) -> str:
    uri = store.artifact_uri(kind, key)
    writer = store.writer(uri, kind=kind, stage="test")
    writer.write_bytes("payload.bin", payload)
    writer.commit(config={}, inputs={}, metrics={})
    return uri


def test_key_is_stable_and_ignores_resources_and_logging(tmp_path):
    store = ObjectStore(f"file://{tmp_path}/store")
    base = plan_stage(_cfg(tmp_path), store, "prepare")
    again = plan_stage(_cfg(tmp_path), store, "prepare")
    elsewhere = plan_stage(
        _cfg(tmp_path, "launch.prepare.deadline_s=99", "logging.wandb_project=x"), store, "prepare"
    )
    assert base.output_uri == again.output_uri == elsewhere.output_uri
    assert base.output_uri.startswith(store.root) and "/data/" in base.output_uri


def test_key_changes_with_stage_config_params_and_inputs(tmp_path):
    store = ObjectStore(f"file://{tmp_path}/store")
    data_a = _committed_input(store, "data", "a", b"a")
    data_b = _committed_input(store, "data", "b", b"b")
    cfg = _cfg(tmp_path)
    base = plan_stage(cfg, store, "sft", inputs={"data": data_a})
    assert plan_stage(_cfg(tmp_path, "sft.steps=5"), store, "sft", inputs={"data": data_a}).key != base.key
    assert plan_stage(cfg, store, "sft", inputs={"data": data_b}).key != base.key
    # A section SFT does not read (rollout sampling) leaves its key alone.
    assert (
        plan_stage(_cfg(tmp_path, "rollout.sampling.temperature=0.5"), store, "sft", {"data": data_a}).key
        == base.key
    )
    rollout_0 = plan_stage(cfg, store, "rollout", {"policy": data_a, "data": data_a}, {"iteration": 0})
    rollout_1 = plan_stage(cfg, store, "rollout", {"policy": data_a, "data": data_a}, {"iteration": 1})
    assert rollout_0.key != rollout_1.key


def test_launch_spec_uses_torchrun_for_training_stages_only(tmp_path):
    store = ObjectStore(f"file://{tmp_path}/store")
    cfg = _cfg(tmp_path, "storage.endpoint_url=http://127.0.0.1:9")
    sft = launch_spec_for(plan_stage(cfg, store, "sft", {}), cfg)
    prepare = launch_spec_for(plan_stage(cfg, store, "prepare"), cfg)
    assert sft.torchrun and sft.nproc_per_node == cfg.launch.sft.nproc_per_node
    assert not prepare.torchrun and prepare.nproc_per_node == 1
    assert sft.args[:1] == ["sft"] and sft.args[-1].endswith("/_spec.json")
    assert sft.env["FORGE_S3_ENDPOINT_URL"] == "http://127.0.0.1:9"


def test_unknown_stage_is_a_clear_error(tmp_path):
    import pytest

    with pytest.raises(ValueError, match="unknown; valid stages"):
        plan_stage(_cfg(tmp_path), ObjectStore(f"file://{tmp_path}/store"), "train")


def test_prepare_key_follows_source_file_contents(tmp_path):
    store = ObjectStore(f"file://{tmp_path}/store")
    source = tmp_path / "train.jsonl"
    overrides = [f"data.source={source}", "data.format=jsonl", "data.tokenizer.vocab_size=300"]
    source.write_text('{"prompt": "1+1=", "completion": "2"}\n')
    first = plan_stage(_cfg(tmp_path, *overrides), store, "prepare")
    source.write_text('{"prompt": "1+1=", "completion": "3"}\n')
    second = plan_stage(_cfg(tmp_path, *overrides), store, "prepare")
    assert first.key != second.key
