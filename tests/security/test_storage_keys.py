"""Storage keys built from user input cannot escape the run's prefix: `..`, absolute paths and foreign URIs
are rejected wherever a key enters the store, including file names read back from a tampered manifest."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from forge_core.storage import ObjectStore

pytestmark = pytest.mark.integration
ESCAPES = [
    "../outside",
    "a/../../outside",
    "/etc/passwd",
    "s3://other-bucket/key",
    "file:///tmp/x",
    "a\\..\\b",
]


@pytest.fixture
def store(tmp_path):
    return ObjectStore(f"file://{tmp_path}/store")


@pytest.mark.parametrize("key", ESCAPES)
def test_join_refuses_keys_that_leave_the_prefix(store, key):
    with pytest.raises(ValueError, match="storage key"):
        store.join(store.root, "run", key)


@pytest.mark.parametrize(
    ("kind", "key"), [("data", ".."), ("..", "k"), ("data", "a/b"), ("data/x", "k"), ("data", "")]
)
def test_artifact_kind_and_key_must_be_single_segments(store, kind, key):
    with pytest.raises(ValueError):
        store.artifact_uri(kind, key)


@pytest.mark.parametrize("rel", ESCAPES)
def test_writers_refuse_file_names_that_leave_the_artifact(store, tmp_path, rel):
    writer = store.writer(store.artifact_uri("data", "k"), kind="data", stage="prepare")
    with pytest.raises(ValueError):
        writer.write_bytes(rel, b"x")
    local = tmp_path / "f"
    local.write_bytes(b"x")
    with pytest.raises(ValueError):
        writer.put_file(local, rel)
    assert not (tmp_path / "outside").exists()


@pytest.mark.parametrize("name", ["../promoted", "a/b", "/abs", ".."])
def test_pointer_names_are_single_segments(store, name):
    with pytest.raises(ValueError, match="pointer name"):
        store.pointer_uri(name)
    with pytest.raises(ValueError, match="pointer name"):
        store.pointer_read(name)


def test_a_tampered_manifest_cannot_make_a_download_write_outside_its_folder(store, tmp_path):
    uri = store.artifact_uri("sft", "k")
    writer = store.writer(uri, kind="sft", stage="sft")
    writer.write_bytes("policy/config.json", b"{}")
    writer.commit(config={}, inputs={}, metrics={})
    # Someone with bucket access plants a file beside the store and lists it in the manifest.
    manifest_path = Path(store.local_path(store.manifest_uri(uri)))
    manifest = json.loads(manifest_path.read_text())
    entry = manifest["files"]["policy/config.json"]
    manifest["files"]["policy/../../../../planted"] = entry
    manifest_path.write_text(json.dumps(manifest))
    target = tmp_path / "download" / "policy"

    with pytest.raises(ValueError, match=r"'\.\.'"):
        store.reader(uri).download_dir("policy", target)
    assert not any(p.name == "planted" for p in tmp_path.rglob("*"))
    assert not os.path.exists(tmp_path / "planted")
