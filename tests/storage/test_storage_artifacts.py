"""Artifact commit protocol, verified reads, listing, folders and pointers on memory://, file:// and s3://."""

from __future__ import annotations

import json
import os
import socket

import pyarrow as pa
import pytest

from forge_core.storage import (
    MANIFEST_NAME,
    ArtifactAlreadyCommitted,
    ArtifactCorrupted,
    ArtifactNotCommitted,
    PointerConflict,
    code_version,
)


def _write_simple(store, kind="data", key="k1", payload=b"hello world", **commit_kwargs):
    uri = store.artifact_uri(kind, key)
    w = store.writer(uri, kind=kind, stage="prepare")
    w.write_bytes("blob.bin", payload)
    w.write_json("meta/info.json", {"rows": 3})
    manifest = w.commit(
        config=commit_kwargs.get("config", {"lr": 0.1}),
        inputs=commit_kwargs.get("inputs", {}),
        metrics=commit_kwargs.get("metrics", {"rows": 3}),
    )
    return uri, manifest


def test_commit_then_verified_read_round_trip(store):
    source_uri, _ = _write_simple(store, key="source")
    uri = store.artifact_uri("sft", "k2")
    w = store.writer(uri, kind="sft", stage="sft")
    w.write_bytes("a.bin", b"\x00\x01" * 1000)
    w.write_json("cfg.json", {"b": [1, 2], "a": "x"})
    with w.open("stream/log.txt") as f:
        for i in range(100):
            f.write(f"line {i}\n".encode())
    assert not store.is_committed(uri)

    manifest = w.commit(config={"steps": 3}, inputs={"data": source_uri}, metrics={"loss": float("nan")})

    assert store.is_committed(uri)
    r = store.reader(uri)
    assert r.manifest == manifest
    assert r.manifest.kind == "sft" and r.manifest.stage == "sft" and r.manifest.key == "k2"
    assert set(r.manifest.files) == {"a.bin", "cfg.json", "stream/log.txt"}
    assert r.manifest.files["a.bin"].size == 2000
    assert r.manifest.inputs["data"].uri == source_uri
    assert r.manifest.inputs["data"].manifest_sha256 == store.manifest_sha256(source_uri)
    assert r.manifest.code_version == code_version()
    assert r.manifest.host == socket.gethostname()
    assert r.manifest.created_at <= r.manifest.committed_at
    assert r.manifest.metrics == {"loss": "nan"}
    assert r.read_bytes("a.bin") == b"\x00\x01" * 1000
    assert r.read_json("cfg.json") == {"b": [1, 2], "a": "x"}
    with r.open("stream/log.txt") as f:
        assert f.readline() == b"line 0\n"
        assert f.read().endswith(b"line 99\n")
    assert r.manifest_sha256 == store.manifest_sha256(uri)
    with pytest.raises(FileNotFoundError, match="no file 'nope.bin'"):
        r.read_bytes("nope.bin")


@pytest.mark.parametrize("store", ["s3"], indirect=True)
def test_multipart_stream_upload_round_trip(store):
    """A file larger than one upload part goes through S3 multipart and reads back verified."""
    chunk = bytes(range(256)) * 4096  # 1 MiB
    uri = store.artifact_uri("sft", "big")
    w = store.writer(uri, kind="sft", stage="sft")
    with w.open("shard.bin") as f:
        for _ in range(17):  # 17 MiB = two 8 MiB parts + a 1 MiB tail
            f.write(chunk)
    w.commit(config={}, inputs={}, metrics={})
    assert store.size_of(store.reader(uri).file_uri("shard.bin")) == 17 * len(chunk)
    assert store.reader(uri).read_bytes("shard.bin") == chunk * 17


def test_crash_before_commit_leaves_nothing_committed(store):
    uri = store.artifact_uri("data", "crashed")
    w = store.writer(uri, kind="data", stage="prepare")
    w.write_bytes("part-0.bin", b"x" * 100)
    # The process "dies" here: files are written, commit() never runs.
    del w

    assert not store.is_committed(uri)
    with pytest.raises(ArtifactNotCommitted, match="crashed"):
        store.reader(uri)
    assert store.list_committed("data") == []

    # The retry writes over the leftovers and commits; only what it wrote is listed.
    retry = store.writer(uri, kind="data", stage="prepare")
    retry.write_bytes("part-1.bin", b"y" * 10)
    retry.commit(config={}, inputs={}, metrics={})
    assert set(store.reader(uri).manifest.files) == {"part-1.bin"}


def test_exception_inside_open_does_not_record_the_file(store):
    uri = store.artifact_uri("data", "partial")
    w = store.writer(uri, kind="data", stage="prepare")
    with pytest.raises(RuntimeError, match="boom"), w.open("half.bin") as f:
        f.write(b"partial")
        raise RuntimeError("boom")
    w.write_bytes("ok.bin", b"ok")
    manifest = w.commit(config={}, inputs={}, metrics={})
    assert set(manifest.files) == {"ok.bin"}


def test_committed_artifact_is_immutable(store):
    uri, _ = _write_simple(store)
    with pytest.raises(ArtifactAlreadyCommitted):
        store.writer(uri, kind="data", stage="prepare")


def test_two_writers_of_the_same_files_keep_the_first_commit_intact(store):
    """In one process, in a fixed order (tests/storage/test_commit_race.py races real processes): the second
    writer writes the same file names after the first committed, commits, aborts; the first stays whole."""
    uri = store.artifact_uri("data", "race")
    first = store.writer(uri, kind="data", stage="prepare")
    second = store.writer(uri, kind="data", stage="prepare")
    first.write_bytes("a.bin", b"first")
    first.commit(config={}, inputs={}, metrics={})
    second.write_bytes("a.bin", b"second, longer")  # same name, after the commit: its own attempt's object
    with pytest.raises(
        ArtifactAlreadyCommitted, match=f"already committed by attempt {first.attempt}"
    ) as info:
        second.commit(config={}, inputs={}, metrics={})
    assert (info.value.uri, info.value.attempt) == (uri, first.attempt)
    assert second.abort() == 1
    reader = store.reader(uri)
    assert reader.manifest.attempt == first.attempt and reader.read_bytes("a.bin") == b"first"
    assert sorted(store.list_files(uri)) == [store.manifest_uri(uri), first.file_uri("a.bin")]


def test_commit_requires_committed_inputs(store):
    uri = store.artifact_uri("sft", "needs-input")
    w = store.writer(uri, kind="sft", stage="sft")
    w.write_bytes("a.bin", b"a")
    with pytest.raises(ArtifactNotCommitted):
        w.commit(config={}, inputs={"data": store.artifact_uri("data", "missing")}, metrics={})
    assert not store.is_committed(uri)


@pytest.mark.parametrize(
    "rel", [MANIFEST_NAME, "sub/_MANIFEST.json", "_checkpoints/step-1/x", "../x", "/abs"]
)
def test_writer_rejects_reserved_and_escaping_names(store, rel):
    w = store.writer(store.artifact_uri("data", "names"), kind="data", stage="prepare")
    with pytest.raises(ValueError):
        w.write_bytes(rel, b"x")


def test_corrupted_file_is_detected_naming_uri_and_file(store, overwrite_object):
    uri, _ = _write_simple(store, payload=b"0123456789")
    overwrite_object(
        store, store.reader(uri).file_uri("blob.bin"), b"0123456788"
    )  # same size, one byte differs
    r = store.reader(uri)
    with pytest.raises(ArtifactCorrupted, match="sha256") as info:
        r.read_bytes("blob.bin")
    assert info.value.file == "blob.bin" and info.value.uri == uri
    assert uri in str(info.value) and "'blob.bin'" in str(info.value)
    assert r.read_json("meta/info.json") == {"rows": 3}  # the other file is intact


def test_truncated_file_is_detected(store, overwrite_object):
    uri, _ = _write_simple(store, payload=b"0123456789")
    overwrite_object(store, store.reader(uri).file_uri("blob.bin"), b"01234")
    with pytest.raises(ArtifactCorrupted, match=r"'blob.bin' is corrupted: truncated") as info:
        store.reader(uri).read_bytes("blob.bin")
    assert info.value.file == "blob.bin"


def test_missing_file_is_detected(store, overwrite_object, tmp_path):
    uri, _ = _write_simple(store)
    overwrite_object(store, store.reader(uri).file_uri("meta/info.json"), None)
    r = store.reader(uri)
    with pytest.raises(ArtifactCorrupted, match=r"'meta/info.json' is corrupted: missing"):
        r.read_json("meta/info.json")
    with pytest.raises(ArtifactCorrupted, match="meta/info.json"):
        r.download_dir("meta", tmp_path / "out")
    assert not (tmp_path / "out" / "info.json").exists()


def test_unreadable_manifest_is_corrupted_not_committed(store, overwrite_object):
    uri, _ = _write_simple(store)
    overwrite_object(store, store.manifest_uri(uri), b"{not json")
    with pytest.raises(ArtifactCorrupted, match=MANIFEST_NAME):
        store.reader(uri)
    assert store.list_committed("data") == []


def test_parquet_round_trip_preserves_schema(store):
    table = pa.table(
        {
            "prompt_ids": pa.array([[1, 2, 3], [], [7]], type=pa.list_(pa.int32())),
            "reward": pa.array([0.5, 1.0, -1.0], type=pa.float32()),
            "text": ["a", "bb", None],
            "group": pa.array([0, 0, 1], type=pa.int64()),
        }
    )
    uri = store.artifact_uri("rollouts", "r1")
    w = store.writer(uri, kind="rollouts", stage="rollout")
    w.write_table("rollouts.parquet", table)
    with w.table_writer("streamed.parquet", table.schema) as parquet:
        for batch in table.to_batches(max_chunksize=1):
            parquet.write_batch(batch)
    manifest = w.commit(config={}, inputs={}, metrics={})

    r = store.reader(uri)
    back = r.read_table("rollouts.parquet")
    assert back.schema.equals(table.schema) and back.equals(table)
    assert back.schema.field("prompt_ids").type == pa.list_(pa.int32())
    assert "prompt_ids: list<item: int32>" in manifest.schema["rollouts.parquet"]
    assert manifest.schema["streamed.parquet"] == manifest.schema["rollouts.parquet"]
    assert r.read_table("streamed.parquet", columns=["reward"]).column("reward").to_pylist() == [
        0.5,
        1.0,
        -1.0,
    ]
    batches = list(r.iter_batches("streamed.parquet", batch_size=2))
    assert pa.Table.from_batches(batches).equals(table)


def test_list_committed_ignores_uncommitted_and_sorts_by_commit_time(store):
    older, _ = _write_simple(store, key="zz-older")
    newer, _ = _write_simple(store, key="aa-newer")
    _write_simple(store, kind="eval", key="other-kind")
    pending = store.writer(store.artifact_uri("data", "pending"), kind="data", stage="prepare")
    pending.write_bytes("x.bin", b"x")

    assert store.list_committed("data") == [older, newer]
    assert store.list_committed("eval") == [store.artifact_uri("eval", "other-kind")]
    assert store.list_committed("sft") == []
    assert store.list_committed("data", under=store.join(store.root, "eval")) == []


def test_put_dir_download_dir_round_trip(store, tmp_path):
    model = tmp_path / "hf_model"
    (model / "tokenizer").mkdir(parents=True)
    (model / "config.json").write_text(json.dumps({"hidden_size": 8}))
    (model / "model.safetensors").write_bytes(os.urandom(3000))
    (model / "tokenizer" / "tokenizer.json").write_text("{}")
    uri = store.artifact_uri("sft", "with-model")
    w = store.writer(uri, kind="sft", stage="sft")
    written = w.put_dir(model, "policy")
    w.commit(config={}, inputs={}, metrics={})
    assert written == ["policy/config.json", "policy/model.safetensors", "policy/tokenizer/tokenizer.json"]

    out = store.reader(uri).download_dir("policy", tmp_path / "downloaded")
    for name in ("config.json", "model.safetensors", "tokenizer/tokenizer.json"):
        assert (out / name).read_bytes() == (model / name).read_bytes()
    assert not [p for p in out.rglob("*") if "forge-tmp" in p.name]


def test_put_dir_at_the_artifact_root(store, tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    w = store.writer(store.artifact_uri("policy", "root-dir"), kind="policy", stage="sft")
    assert w.put_dir(tmp_path / "m") == ["config.json"]


def test_nested_checkpoint_is_an_independent_artifact(store):
    parent = store.artifact_uri("sft", "run")
    checkpoint = store.join(parent, "_checkpoints", "step-3")
    ckpt_writer = store.writer(checkpoint, kind="checkpoint", stage="sft")
    ckpt_writer.write_bytes("__0_0.distcp", b"weights")
    ckpt_writer.write_bytes(".metadata", b"meta")
    ckpt_writer.commit(config={}, inputs={}, metrics={"step": 3})
    uncommitted = store.writer(store.join(parent, "_checkpoints", "step-4"), kind="checkpoint", stage="sft")
    uncommitted.write_bytes("__0_0.distcp", b"half")

    w = store.writer(parent, kind="sft", stage="sft")
    w.write_bytes("policy/model.safetensors", b"final")
    with pytest.raises(ValueError, match="_checkpoints"):
        w.write_bytes("_checkpoints/step-5/x", b"no")
    w.commit(config={}, inputs={}, metrics={})

    assert list(store.reader(parent).manifest.files) == ["policy/model.safetensors"]
    assert store.reader(checkpoint).read_bytes("__0_0.distcp") == b"weights"
    assert store.list_committed("checkpoint", under=parent) == [checkpoint]
    assert store.list_committed("sft") == [parent]


def test_adopt_existing_hashes_foreign_files_of_its_own_attempt_only(store, overwrite_object):
    uri = store.artifact_uri("sft", "adopt")
    w = store.writer(uri, kind="sft", stage="sft")
    # What another tool (DCP) wrote where it was told: under the writer's attempt prefix...
    for rel, data in {"dcp/__0_0.distcp": b"a" * 5000, "dcp/.metadata": b"m"}.items():
        overwrite_object(store, w.file_uri(rel), data)
    # ...and what must never be adopted: files at the artifact root, another attempt's, a nested artifact.
    overwrite_object(store, store.join(uri, "dcp", "root.bin"), b"r")
    other = store.writer(uri, kind="sft", stage="sft")
    overwrite_object(store, other.file_uri("dcp/__0_0.distcp"), b"other attempt")
    inner = store.writer(store.join(uri, "dcp", "inner"), kind="checkpoint", stage="sft")
    inner.write_bytes("y.bin", b"y")
    inner.commit(config={}, inputs={}, metrics={})

    assert w.adopt_existing("dcp") == ["dcp/.metadata", "dcp/__0_0.distcp"]
    manifest = w.commit(config={}, inputs={}, metrics={})
    assert set(manifest.files) == {"dcp/.metadata", "dcp/__0_0.distcp"}
    assert store.reader(uri).read_bytes("dcp/__0_0.distcp") == b"a" * 5000
    with pytest.raises(ValueError, match="no files"):
        store.writer(store.artifact_uri("sft", "empty"), kind="sft", stage="sft").adopt_existing("")


def test_pointer_compare_and_swap(store):
    assert store.pointer_read("promoted-policy") is None
    assert store.pointer_state("promoted-policy").version == 0
    first, _ = _write_simple(store, key="v1")
    second, _ = _write_simple(store, key="v2")
    state = store.pointer_write("promoted-policy", first, expected_version=0)
    assert (state.uri, state.version) == (first, 1) and store.pointer_state("promoted-policy") == state
    assert state.manifest_sha256 == store.manifest_sha256(first)
    store.pointer_write("promoted-policy", second, expected_version=1)
    assert store.pointer_read("promoted-policy") == second
    # A writer that decided on version 1 lost: the pointer moved to version 2 since.
    with pytest.raises(PointerConflict, match="expected version 1, but it is at version 2") as info:
        store.pointer_write("promoted-policy", first, expected_version=1)
    assert info.value.current == store.pointer_state("promoted-policy")
    with pytest.raises(PointerConflict):
        store.pointer_write("promoted-policy", first, expected_version=7)  # a version it never had
    with pytest.raises(ArtifactNotCommitted):
        store.pointer_write("promoted-policy", store.artifact_uri("data", "never"), expected_version=2)
    with pytest.raises(ValueError):
        store.pointer_write("../escape", first, expected_version=0)
    assert store.pointer_state("promoted-policy").uri == second


def test_a_format_1_pointer_is_read_and_swapped(store):
    """Pointers written before compare-and-swap (one object, `_pointers/<name>.json`) stay readable."""
    old, _ = _write_simple(store, key="old")
    new, _ = _write_simple(store, key="new")
    store.put_bytes(store.pointer_uri("legacy"), json.dumps({"name": "legacy", "uri": old}).encode())
    assert (store.pointer_read("legacy"), store.pointer_state("legacy").version) == (old, 0)
    store.pointer_write("legacy", new, expected_version=0)
    assert store.pointer_state("legacy").uri == new


def test_a_format_1_manifest_with_files_at_the_root_is_read(store, overwrite_object):
    """Artifacts committed before attempt prefixes (format_version 1) keep verifying and reading."""
    uri = store.artifact_uri("data", "v1")
    overwrite_object(store, store.join(uri, "a.bin"), b"payload")
    w = store.writer(store.artifact_uri("data", "template"), kind="data", stage="prepare")
    w.write_bytes("a.bin", b"payload")
    raw = json.loads(w.commit(config={}, inputs={}, metrics={}).to_json_bytes())
    del raw["attempt"]
    raw["format_version"] = 1
    store.put_bytes(store.manifest_uri(uri), json.dumps(raw).encode())
    reader = store.reader(uri)
    assert reader.manifest.attempt is None and reader.files_uri == uri
    assert reader.read_bytes("a.bin") == b"payload"


def test_artifact_without_files_commits(store):
    uri = store.artifact_uri("eval", "empty")
    manifest = store.writer(uri, kind="eval", stage="evaluate").commit(
        config={}, inputs={}, metrics={"acc": 0.5}
    )
    assert manifest.files == {} and store.reader(uri).manifest.metrics == {"acc": 0.5}
    assert store.list_committed("eval") == [uri]


def test_commit_rejects_config_that_is_not_json(store):
    w = store.writer(store.artifact_uri("data", "bad-config"), kind="data", stage="prepare")
    with pytest.raises(ValueError, match="plain JSON"):
        w.commit(config={"when": object()}, inputs={}, metrics={})
    assert not store.is_committed(w.uri)


def test_store_from_config_section(tmp_path):
    from forge_core.config.schema import StorageConfig
    from forge_core.storage import ObjectStore

    cfg = StorageConfig(root=str(tmp_path / "s"), retries=2, retry_backoff_s=0.25)
    store = ObjectStore.from_config(cfg)
    assert store.root == f"file://{tmp_path}/s"
    assert (store.retrier.retries, store.retrier.backoff_s) == (2, 0.25)


def test_sweeping_stale_attempts_spares_the_committed_one_and_young_ones(store):
    uri = store.artifact_uri("data", "swept")
    old = "20200101T000000Z-{}"  # attempt ids start with their creation time
    winner = store.writer(uri, kind="data", stage="prepare", attempt=old.format("a" * 12))
    crashed = store.writer(uri, kind="data", stage="prepare", attempt=old.format("b" * 12))
    young = store.writer(uri, kind="data", stage="prepare")  # a new id: may still be writing
    for writer in (winner, crashed, young):
        writer.write_bytes("part.bin", writer.attempt.encode())
    winner.commit(config={}, inputs={}, metrics={})
    never_committed = store.writer(
        store.artifact_uri("data", "crashed"), kind="data", stage="prepare", attempt=old.format("c" * 12)
    )
    never_committed.write_bytes("part.bin", b"x")

    swept = store.sweep_stale_attempts(older_than_s=86400)

    assert sorted(swept) == sorted([crashed.files_uri, never_committed.files_uri])
    assert store.reader(uri).read_bytes("part.bin") == winner.attempt.encode()
    assert store.list_files(young.files_uri) and not store.list_files(crashed.files_uri)
    assert store.sweep_stale_attempts(older_than_s=86400) == []
