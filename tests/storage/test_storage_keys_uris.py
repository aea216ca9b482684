"""Content keys, code version, root normalization and safe key joining."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from forge_core.storage import ObjectStore, canonical_json, content_key, normalize_root_uri, safe_join
from forge_core.storage.keys import source_tree_hash

REPO_ROOT = Path(__file__).resolve().parents[2]
_KEY_SCRIPT = """
import json
from forge_core.storage import code_version, content_key
cfg = {"lr": 0.002, "layers": [2, {"b": None, "a": True}], "name": "demo", "x": 1e-7}
print(json.dumps([code_version(), content_key("sft", cfg, {"data": "ab" * 32}, code_version())]))
"""


def test_content_key_is_stable_across_processes():
    env = {**os.environ, "PYTHONHASHSEED": "random"}
    outputs = [
        json.loads(
            subprocess.run(
                [sys.executable, "-c", _KEY_SCRIPT],
                cwd=REPO_ROOT,
                env=env,
                check=True,
                capture_output=True,
                text=True,
            ).stdout
        )
        for _ in range(2)
    ]
    assert outputs[0] == outputs[1]
    version, key = outputs[0]
    assert len(key) == 20 and int(key, 16) >= 0
    # The same identity computed here, with the dict written in another key order, gives the same key.
    cfg = {"x": 1e-7, "name": "demo", "layers": [2, {"a": True, "b": None}], "lr": 0.002}
    assert content_key("sft", cfg, {"data": "ab" * 32}, version) == key


def test_content_key_changes_with_every_part_of_the_identity():
    base = content_key("sft", {"lr": 1}, {"data": "a"}, "v1")
    variants = [
        content_key("grpo", {"lr": 1}, {"data": "a"}, "v1"),
        content_key("sft", {"lr": 2}, {"data": "a"}, "v1"),
        content_key("sft", {"lr": 1.0000001}, {"data": "a"}, "v1"),
        content_key("sft", {"lr": 1}, {"data": "b"}, "v1"),
        content_key("sft", {"lr": 1}, {"other": "a"}, "v1"),
        content_key("sft", {"lr": 1}, {"data": "a"}, "v2"),
    ]
    assert len({base, *variants}) == 1 + len(variants)


def test_canonical_json_rejects_what_json_cannot_say_exactly():
    assert canonical_json({"b": 1, "a": [1.5, None]}) == '{"a":[1.5,null],"b":1}'
    with pytest.raises(ValueError, match=r"\$\.lr=nan"):
        canonical_json({"lr": float("nan")})
    with pytest.raises(ValueError, match="tuple"):
        canonical_json({"shape": (1, 2)})
    with pytest.raises(ValueError, match="key 1"):
        canonical_json({1: "a"})


def test_source_tree_hash_changes_when_code_changes(tmp_path):
    tree = tmp_path / "forge_core"
    shutil.copytree(REPO_ROOT / "forge_core" / "storage", tree / "storage")
    before = source_tree_hash(tree)
    (tree / "storage" / "__pycache__").mkdir(exist_ok=True)
    (tree / "storage" / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"compiled")
    assert source_tree_hash(tree) == before  # caches are not code
    keys_py = tree / "storage" / "keys.py"
    keys_py.write_text(keys_py.read_text() + "\n# a code change\n")
    assert source_tree_hash(tree) != before


@pytest.mark.parametrize(
    ("root", "expected"),
    [
        ("s3://bucket/prefix/", "s3://bucket/prefix"),
        ("s3://bucket", "s3://bucket"),
        ("memory://unit", "memory://unit"),
        ("/abs/store/", "file:///abs/store"),
        ("file:///abs/store", "file:///abs/store"),
    ],
)
def test_normalize_root_uri(root, expected):
    assert normalize_root_uri(root) == expected


def test_relative_roots_become_absolute_file_uris(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert normalize_root_uri("file://./.forge-store") == f"file://{tmp_path}/.forge-store"
    assert normalize_root_uri("store") == f"file://{tmp_path}/store"
    assert ObjectStore("./store").root == f"file://{tmp_path}/store"


@pytest.mark.parametrize("root", ["", "gs://bucket", "s3://", "memory://", "s3://bucket/../other"])
def test_bad_roots_are_rejected_naming_the_setting(root):
    with pytest.raises(ValueError, match="storage.root"):
        normalize_root_uri(root)


@pytest.mark.parametrize(
    "key", ["..", "a/../../b", "../etc/passwd", "/etc/passwd", "s3://other/bucket", "a\\..\\b", "a\x00b"]
)
def test_safe_join_rejects_keys_escaping_the_root(key):
    with pytest.raises(ValueError):
        safe_join("s3://bucket/root", key)


def test_safe_join_normalizes_harmless_keys():
    assert safe_join("s3://bucket/root", "a//b/./c", "d.json") == "s3://bucket/root/a/b/c/d.json"
    assert safe_join("file:///tmp/x", "..hidden") == "file:///tmp/x/..hidden"


def test_artifact_uri_takes_single_segments_only(tmp_path):
    store = ObjectStore(str(tmp_path))
    assert store.artifact_uri("data", "abc") == f"file://{tmp_path}/data/abc"
    for kind, key in [("data", "a/b"), ("..", "x"), ("data", ""), ("data", ".")]:
        with pytest.raises(ValueError):
            store.artifact_uri(kind, key)
    with pytest.raises(ValueError, match="scheme"):
        store.reader("s3://bucket/data/abc")
