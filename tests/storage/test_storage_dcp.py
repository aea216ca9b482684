"""DCP interop: torch.distributed.checkpoint writes through FsspecWriter(store.fsspec_path(uri),
**store.storage_options) into a nested checkpoint artifact, which is then adopted, committed and reloaded."""

from __future__ import annotations

import pytest

from forge_core.storage import CHECKPOINTS_DIR, ArtifactCorrupted


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
@pytest.mark.parametrize("store", ["file", pytest.param("s3", marks=pytest.mark.integration)], indirect=True)
def test_dcp_checkpoint_through_fsspec_is_adopted_committed_and_reloaded(store):
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    parent = store.artifact_uri("sft", "dcp-run")
    checkpoint = store.join(parent, CHECKPOINTS_DIR, "step-1")
    state = {"model": {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(4)}}
    # Single process, no process group: DCP runs with no_dist, into the writer's attempt prefix.
    ckpt_writer = store.writer(checkpoint, kind="checkpoint", stage="sft")
    shards_uri = store.fsspec_path(ckpt_writer.files_uri)
    dcp.save(state, storage_writer=FsspecWriter(shards_uri, **store.storage_options))

    adopted = ckpt_writer.adopt_existing()
    assert ".metadata" in adopted and any(name.endswith(".distcp") for name in adopted)
    ckpt_writer.commit(config={}, inputs={}, metrics={"step": 1})

    parent_writer = store.writer(parent, kind="sft", stage="sft")
    parent_writer.write_bytes("policy/model.safetensors", b"weights")
    assert not any(CHECKPOINTS_DIR in f for f in parent_writer.commit(config={}, inputs={}, metrics={}).files)
    assert store.list_committed("checkpoint", under=parent) == [checkpoint]

    reader = store.reader(checkpoint)
    assert reader.verify() == sorted(adopted)
    restored = {"model": {"w": torch.zeros(3, 4), "b": torch.zeros(4)}}
    dcp.load(
        restored, storage_reader=FsspecReader(store.fsspec_path(reader.files_uri), **store.storage_options)
    )
    assert torch.equal(restored["model"]["w"], state["model"]["w"])
    assert torch.equal(restored["model"]["b"], state["model"]["b"])

    shard = next(name for name in adopted if name.endswith(".distcp"))
    store.fs.pipe_file(store.path_of(reader.file_uri(shard)), b"garbage")
    with pytest.raises(ArtifactCorrupted, match=shard):
        store.reader(checkpoint).verify()
