"""Retention deleted every attempt's files of a checkpoint it removed: an attempt that committed between the
manifest's delete and the files' delete was left committed with its files gone (ArtifactCorrupted). Only the
committed attempt's files go now."""

from __future__ import annotations

import pytest

from forge_core.storage.manifest import new_attempt_id


@pytest.mark.fault(
    fault="retention deletes a committed checkpoint while another attempt of the same key is writing its files",
    where="ObjectStore.delete_artifact (checkpoint retention, storage.keep_checkpoints)",
    checked="only the committed attempt's files are deleted, after the manifest; the other attempt's files "
    "stay, it commits afterwards and its artifact reads back verified",
)
def test_retention_deletes_only_the_committed_attempt(file_store, fault_row):
    uri = file_store.artifact_uri("sft", "retention-key")
    first, second = new_attempt_id(), new_attempt_id()
    committed = file_store.writer(uri, kind="checkpoint", stage="sft", attempt=first)
    writing = file_store.writer(uri, kind="checkpoint", stage="sft", attempt=second)
    committed.write_bytes("shard.bin", b"a" * 100)
    writing.write_bytes("shard.bin", b"b" * 100)
    committed.commit(config={}, inputs={}, metrics={})

    file_store.delete_artifact(uri)
    assert not file_store.is_committed(uri)
    assert not file_store.list_files(file_store.files_uri(uri, first))

    writing.commit(config={}, inputs={}, metrics={})
    reader = file_store.reader(uri)
    assert reader.read_bytes("shard.bin") == b"b" * 100  # verified against the new manifest
    fault_row.fact("the committed attempt's 1 file deleted, the writing attempt's kept and committed after")
