"""Checkpoints are hashed while DCP writes them (forge_core.engine.hashing_dcp): the committed manifest equals
the one hashing the stored files afterwards would give, on a local folder and on moto's S3, for one rank in
this process and for two torchrun ranks (each hashes its own shard, rank 0 gathers); nothing is read back to
commit; a hashed list that does not match what is stored is refused."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from forge_core.engine import Checkpointer, checkpoint_uri
from forge_core.engine.checkpoint import ModelState
from forge_core.engine.distributed import DistContext
from forge_core.storage import ArtifactWriter, FileEntry, ObjectStore, StorageError
from tests.two_ranks import torchrun_two_ranks

WORKER = Path(__file__).with_name("hashed_checkpoint_worker.py")


@pytest.fixture(params=["file", pytest.param("s3", marks=pytest.mark.integration)])
def store(request, file_store):
    return file_store if request.param == "file" else request.getfixturevalue("s3_store")


def _files(entries: dict[str, FileEntry]) -> dict[str, dict]:
    return {rel: dataclasses.asdict(entry) for rel, entry in entries.items()}


def _hashed_after(store: ObjectStore, uri: str) -> dict[str, FileEntry]:
    """What hashing the committed attempt's stored files (reading them back) gives."""
    manifest = store.read_manifest(uri)
    again = ArtifactWriter(store, uri, kind="checkpoint", stage="sft", attempt=manifest.attempt)
    again.adopt_existing()
    return again.files


def test_one_rank_commit_equals_hashing_after_and_reads_nothing_back(store, monkeypatch):
    world_of_one = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    output = store.artifact_uri("sft", "hashed-one")
    checkpointer = Checkpointer(store, output, world_of_one, stage="sft", config={}, inputs={})
    model = torch.nn.Linear(300, 200)  # a shard of ~240 KB: several writes through the hashing stream
    # The commit must not read a single byte of the shards back.
    reads = []
    monkeypatch.setattr(store, "get_range", lambda *args, **kwargs: reads.append(args) or b"")
    ref = checkpointer.save(1, {"model": ModelState(model)}, {"cursor": 1})
    monkeypatch.undo()
    assert reads == []

    committed = store.read_manifest(ref.uri).files
    assert {".metadata", "__0_0.distcp"} <= set(committed)
    assert _files(committed) == _files(_hashed_after(store, ref.uri))
    assert committed["__0_0.distcp"].size > 200 * 300 * 4


@pytest.mark.integration
def test_two_ranks_each_hash_their_shards_and_the_manifest_equals_hashing_after(tmp_path, s3_store):
    stores = [f"file://{tmp_path}/store", f"{s3_store.root}={s3_store.endpoint_url}"]
    result = torchrun_two_ranks(str(WORKER), *stores)
    assert result.returncode == 0, result.stderr[-4000:]
    records = [
        json.loads(line.split("HASHED ", 1)[1]) for line in result.stdout.splitlines() if "HASHED " in line
    ]
    assert [r["store"] for r in records] == [s.split("=")[0] for s in stores]
    for record in records:
        assert record["while_writing"] == record["after"], record["store"]
        # Both ranks' shards and the global metadata, each hashed by the rank that wrote it.
        assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(record["while_writing"]), record
        assert record["resumed_step"] == 3 and record["reloaded_equal"], record


def test_hashed_entries_that_do_not_match_the_stored_files_are_refused(file_store):
    uri = checkpoint_uri(file_store, file_store.artifact_uri("sft", "mismatch"), 1)
    writer = ArtifactWriter(file_store, uri, kind="checkpoint", stage="sft")
    file_store.put_bytes(writer.file_uri("__0_0.distcp"), b"12345")
    file_store.put_bytes(writer.file_uri(".metadata"), b"meta")
    right = {"__0_0.distcp": FileEntry(5, "a" * 64), ".metadata": FileEntry(4, "b" * 64)}

    with pytest.raises(StorageError, match=r"__0_0.distcp: hashed 6, stored 5"):
        writer.adopt_hashed({**right, "__0_0.distcp": FileEntry(6, "a" * 64)})
    with pytest.raises(StorageError, match=r"\.metadata: hashed nothing, stored 4"):
        writer.adopt_hashed({"__0_0.distcp": right["__0_0.distcp"]})
    with pytest.raises(StorageError, match=r"__1_0.distcp: hashed 7, stored nothing"):
        writer.adopt_hashed({**right, "__1_0.distcp": FileEntry(7, "c" * 64)})
    assert writer.adopt_hashed(right) == [".metadata", "__0_0.distcp"]
    assert writer.files == right
