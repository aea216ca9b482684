"""`forgeflow export <uri|run> <dir>`: a committed policy as a plain HF folder that transformers loads, copied
from a local or an S3 store and verified against its manifest; refused, with nothing written, for a corrupted
file, an uncommitted artifact, a non-empty target, and a push to the Hub without a token.

The policy is a random transformers checkpoint (tests/flows/test_foreign_checkpoints.py's) committed as a
training stage commits its export: a nested `policy` artifact inside an `sft` artifact.
"""

from __future__ import annotations

from pathlib import Path

import huggingface_hub
import pytest
import torch
import transformers

from flows.cli import main
from flows.last_run import record_run
from forge_core.config import load_config
from forge_core.storage import ObjectStore
from tests.flows.test_foreign_checkpoints import _checkpoint
from tests.rollout.conftest import commit_policy_stage


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("checkpoint")
    _checkpoint(folder, "qwen2")
    return folder


def _committed_sft(store: ObjectStore, checkpoint: Path, key: str = "exported") -> str:
    uri = store.artifact_uri("sft", key)
    commit_policy_stage(store, uri, checkpoint)
    return uri


def _loads_like(folder: Path, checkpoint: Path) -> None:
    """transformers loads the exported folder, weights and tokenizer, as the original checkpoint."""
    exported = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    original = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    tokens = tokenizer("What is 3 plus 4?", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert torch.equal(exported(tokens).logits, original(tokens).logits)
    assert sorted(p.name for p in folder.iterdir()) == sorted(p.name for p in checkpoint.iterdir())


def test_export_copies_a_committed_policy_to_an_hf_folder_transformers_loads(file_store, checkpoint, tmp_path, capsys):
    stage_uri = _committed_sft(file_store, checkpoint)

    assert main(["export", stage_uri, str(tmp_path / "from-stage")]) == 0
    _loads_like(tmp_path / "from-stage", checkpoint)
    assert str(tmp_path / "from-stage") in capsys.readouterr().out

    # The printed final policy (<stage>/policy) is accepted as well; an empty folder is a fine target.
    (tmp_path / "empty").mkdir()
    assert main(["export", file_store.join(stage_uri, "policy"), str(tmp_path / "empty")]) == 0
    _loads_like(tmp_path / "empty", checkpoint)


def test_export_reads_an_s3_store(s3_store, checkpoint, tmp_path, monkeypatch):
    stage_uri = _committed_sft(s3_store, checkpoint)
    monkeypatch.setenv("FORGE_S3_ENDPOINT_URL", s3_store.endpoint_url)

    assert main(["export", stage_uri, str(tmp_path / "model")]) == 0

    _loads_like(tmp_path / "model", checkpoint)


def test_export_of_a_recorded_run_reads_its_store(file_store, checkpoint, tmp_path):
    """`last` or a flow run id: the store and final policy a run's ending recorded in its logging dir."""
    stage_uri = _committed_sft(file_store, checkpoint)
    runs = tmp_path / "runs"
    cfg = load_config(None, [f"storage.root={file_store.root}", f"logging.dir={runs}"])
    record_run({"flow_run_id": "run-1", "final_policy_uri": stage_uri}, cfg)

    assert main(["export", "last", str(tmp_path / "last"), f"logging.dir={runs}"]) == 0
    assert main(["export", "run-1", str(tmp_path / "by-id"), f"logging.dir={runs}"]) == 0

    _loads_like(tmp_path / "last", checkpoint)
    _loads_like(tmp_path / "by-id", checkpoint)


def test_export_of_a_run_names_the_runs_folder_it_read(tmp_path, capsys):
    assert main(["export", "last", str(tmp_path / "model"), f"logging.dir={tmp_path}/runs"]) == 2

    err = capsys.readouterr().err
    assert f"{tmp_path}/runs" in err and "logging.dir=" in err, err


def test_export_refuses_a_corrupted_file_and_writes_nothing(file_store, checkpoint, tmp_path, capsys):
    stage_uri = _committed_sft(file_store, checkpoint)
    weights = file_store.reader(file_store.join(stage_uri, "policy")).file_uri("model.safetensors")
    path = Path(file_store.local_path(weights))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))

    assert main(["export", stage_uri, str(tmp_path / "model")]) == 2

    err = capsys.readouterr().err
    assert "model.safetensors" in err and "corrupted" in err, err
    assert not (tmp_path / "model").exists()
    assert list(tmp_path.iterdir()) == [tmp_path / "store"]  # no partial copy left next to the target


def test_export_refuses_an_uncommitted_artifact_and_a_non_empty_target(file_store, checkpoint, tmp_path, capsys):
    uncommitted = file_store.artifact_uri("grpo", "never-committed")
    file_store.put_bytes(file_store.join(uncommitted, "_attempts", "a1", "model.safetensors"), b"half")

    assert main(["export", uncommitted, str(tmp_path / "model")]) == 2
    err = capsys.readouterr().err
    assert uncommitted in err and "not committed" in err, err
    assert not (tmp_path / "model").exists()

    stage_uri = _committed_sft(file_store, checkpoint)
    target = tmp_path / "busy"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    assert main(["export", stage_uri, str(target)]) == 2
    err = capsys.readouterr().err
    assert str(target) in err and "not empty" in err, err
    assert sorted(p.name for p in target.iterdir()) == ["notes.txt"]


def test_export_refuses_an_artifact_that_holds_no_policy(file_store, tmp_path, capsys):
    data_uri = file_store.artifact_uri("data", "some-data")
    writer = file_store.writer(data_uri, kind="data", stage="prepare")
    writer.write_json("rows.json", {})
    writer.commit(config={}, inputs={}, metrics={})

    assert main(["export", data_uri, str(tmp_path / "model")]) == 2

    err = capsys.readouterr().err
    assert "'data'" in err and "sft" in err and "grpo" in err, err


def test_push_to_hub_without_a_token_is_refused_before_copying(file_store, checkpoint, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.delenv("HF_OIDC_RESOURCE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))  # no login either
    stage_uri = _committed_sft(file_store, checkpoint)

    assert main(["export", stage_uri, str(tmp_path / "model"), "--push-to-hub", "me/my-model"]) == 2

    err = capsys.readouterr().err
    assert "--push-to-hub" in err and "HF_TOKEN" in err, err
    assert not (tmp_path / "model").exists()
