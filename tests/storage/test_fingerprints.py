"""Content fingerprints of folders outside the store and the file-hash cache that keeps them cheap."""

from __future__ import annotations

import json
import os
import time

import pytest
from fsspec.implementations.local import LocalFileSystem

from forge_core.storage import fingerprints
from forge_core.storage.fingerprints import CACHE_ENV, files_fingerprint, folder_fingerprint


class CountingFileSystem(LocalFileSystem):
    """A local filesystem that counts the files it opens: hashing a file opens it, a cache hit does not."""

    cachable = False  # fsspec would otherwise hand back one shared instance

    def __init__(self):
        super().__init__()
        self.opened: list[str] = []

    def _open(self, path, mode="rb", **kwargs):
        self.opened.append(path)
        return super()._open(path, mode, **kwargs)


# Short enough to wait out in a test, far above this machine's timestamp granularity (about a millisecond).
SHORT_RACY_WINDOW_S = 0.2


@pytest.fixture
def cache_file(tmp_path, monkeypatch):
    path = tmp_path / "cache" / "content-hashes.json"
    monkeypatch.setenv(CACHE_ENV, str(path))
    monkeypatch.setattr(fingerprints, "FINGERPRINT_RACY_WINDOW_S", SHORT_RACY_WINDOW_S)
    return path


def _settled(path) -> str:
    """Wait until the file's last change is older than the racy window (what a checkpoint on disk is)."""
    deadline = time.monotonic() + 60
    while True:
        st = os.stat(path)
        if time.time() - max(st.st_mtime, st.st_ctime) > SHORT_RACY_WINDOW_S:
            return str(path)
        assert time.monotonic() < deadline, f"{path}: its ctime never got older than the racy window"
        time.sleep(0.05)


def _write_old(path, data: bytes) -> str:
    path.write_bytes(data)
    return _settled(path)


def test_an_unchanged_file_is_hashed_once_across_processes(tmp_path, cache_file):
    weights = _write_old(tmp_path / "model.safetensors", b"w" * 100_000)
    fs = CountingFileSystem()

    first = files_fingerprint(fs, {"model.safetensors": weights})
    assert fs.opened == [weights]
    assert cache_file.stat().st_mode & 0o077 == 0  # private to the user
    fingerprints._HashCache._instances.clear()  # a new process: only the file on disk is left
    again = files_fingerprint(fs, {"model.safetensors": weights})

    assert again == first
    assert fs.opened == [weights]  # the second plan did not read the file again


def test_a_rewritten_file_is_hashed_again_even_with_its_old_size_and_mtime(tmp_path, cache_file):
    weights = _write_old(tmp_path / "model.safetensors", b"w" * 100_000)
    old_mtime = os.stat(weights).st_mtime_ns
    fs = CountingFileSystem()
    first = files_fingerprint(fs, {"model.safetensors": weights})

    (tmp_path / "model.safetensors").write_bytes(b"v" + b"w" * 99_999)
    os.utime(weights, ns=(old_mtime, old_mtime))  # the same size and mtime: only ctime tells
    second = files_fingerprint(fs, {"model.safetensors": _settled(weights)})

    assert second != first
    assert fs.opened == [weights, weights]


def test_a_file_changed_within_the_racy_window_is_not_cached(tmp_path, cache_file, monkeypatch):
    monkeypatch.setattr(fingerprints, "FINGERPRINT_RACY_WINDOW_S", 3600.0)  # every file here is "just written"
    fresh = tmp_path / "train.jsonl"
    fresh.write_bytes(b"{}\n")
    files_fingerprint(LocalFileSystem(), {"train.jsonl": str(fresh)})

    entries = json.loads(cache_file.read_text())["entries"] if cache_file.exists() else {}
    assert not any(str(fresh) in key for key in entries)


def test_the_cache_is_bounded_and_keeps_the_newest_entries(tmp_path, cache_file, monkeypatch):
    monkeypatch.setattr(fingerprints, "MAX_CACHE_ENTRIES", 3)
    for i in range(5):
        (tmp_path / f"f{i}").write_bytes(bytes([i]) * 10)
    paths = [_settled(tmp_path / f"f{i}") for i in range(5)]
    for path in paths:
        files_fingerprint(LocalFileSystem(), {"f": path})

    entries = json.loads(cache_file.read_text())["entries"]
    assert len(entries) == 3
    assert [json.loads(key)[1] for key in entries] == paths[2:]


def test_a_corrupt_or_foreign_cache_is_ignored(tmp_path, cache_file):
    weights = _write_old(tmp_path / "w", b"w" * 10)
    cache_file.parent.mkdir(parents=True)
    cache_file.write_text("{not json")
    expected = files_fingerprint(LocalFileSystem(), {"w": weights})
    fingerprints._HashCache._instances.clear()

    entries = json.loads(cache_file.read_text())["entries"]
    (key,) = entries
    cache_file.write_text(json.dumps({"format": 1, "entries": {key: "0" * 64}}))  # a lie about the file
    os.chown(cache_file, 65534, 65534)  # ... in a file someone else owns
    fs = CountingFileSystem()

    assert files_fingerprint(fs, {"w": weights}) == expected
    assert fs.opened == [weights]


def test_folder_fingerprint_names_the_setting_when_the_folder_is_missing_or_empty(tmp_path, cache_file):
    with pytest.raises(ValueError, match=r"model.hf_path=.*nope: no such folder"):
        folder_fingerprint(str(tmp_path / "nope"), what="model.hf_path")
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "README.md").write_text("x")
    with pytest.raises(ValueError, match=r"data.tokenizer.path=.*no files \(expected one of \['tokenizer.json'\]\)"):
        folder_fingerprint(str(tmp_path / "tok"), names=["tokenizer.json"], what="data.tokenizer.path")
