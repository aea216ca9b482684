"""`forgeflow status` says which store it read: without --config, the store the last run recorded in its logging
dir (flows.last_run), else the config's; and how to point it at another."""

from __future__ import annotations

from flows.cli import main
from flows.last_run import record_run
from forge_core.config import load_config
from forge_core.storage import ObjectStore


def _commit(store: ObjectStore, kind: str, key: str) -> str:
    uri = store.artifact_uri(kind, key)
    writer = store.writer(uri, kind=kind, stage=kind)
    writer.write_json("train_summary.json", {})
    writer.commit(config={}, inputs={}, metrics={})
    return uri


def test_status_without_a_config_reads_the_last_runs_store(prefect_api, file_store, tmp_path, capsys):
    sft_uri = _commit(file_store, "sft", "from-the-run")
    runs = tmp_path / "runs"
    record_run({"flow_run_id": "run-1", "final_policy_uri": sft_uri},
               load_config(None, [f"storage.root={file_store.root}", f"logging.dir={runs}"]))

    assert main(["status", f"logging.dir={runs}"]) == 0

    out = capsys.readouterr().out
    assert f"store {file_store.root}" in out and "run-1" in out and str(runs / "last-run.json") in out, out
    assert "sft       1 committed" in out, out
    assert "--config" in out and "storage.root=" in out, out  # how to read another store


def test_status_reads_the_store_it_is_given_and_names_it(prefect_api, file_store, tmp_path, capsys):
    _commit(file_store, "sft", "from-the-run")
    runs = tmp_path / "runs"
    record_run({"flow_run_id": "run-1", "final_policy_uri": ""},
               load_config(None, [f"storage.root={file_store.root}", f"logging.dir={runs}"]))
    other = ObjectStore(f"file://{tmp_path}/other")
    _commit(other, "grpo", "elsewhere")

    assert main(["status", f"logging.dir={runs}", f"storage.root={other.root}"]) == 0

    out = capsys.readouterr().out
    assert f"store {other.root}" in out, out
    assert "sft       0 committed" in out and "grpo      1 committed" in out, out
