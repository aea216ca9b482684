"""Content fingerprints of what a stage reads from outside the store (a data source, a tokenizer or model
folder), and the per-file hash cache that keeps them cheap to recompute.

    folder_fingerprint("/models/llama-8b", what="model.hf_path")     # every file of the folder
    folder_fingerprint("s3://b/tok", opts, names=("tokenizer.json",), what="data.tokenizer.path")
    files_fingerprint(fs, {"train.jsonl": "/data/train.jsonl"})
    entries_fingerprint({"model.safetensors": "<sha256>"})           # e.g. from a committed manifest

A fingerprint is sha256 over the sorted (relative name, file sha256) pairs, so a byte-identical copy elsewhere
has the same fingerprint and one rewritten file changes it. Names starting with `.` or `_` (hub caches, git
folders, `_MANIFEST.json`, `_SUCCESS`) are not content and are skipped in folders.

A file's sha256 is cached under what proves its bytes did not change: (path, size, mtime_ns, ctime_ns, inode)
on a local disk, (path, size, ETag) on S3; other filesystems are hashed every time. A local file changed less
than `FINGERPRINT_RACY_WINDOW_S` before hashing is not cached: timestamps are coarser than writes (git's
"racy clean" problem). The cache is one JSON file, `$FORGE_HASH_CACHE` (default
`$XDG_CACHE_HOME/forgeflow/content-hashes.json`; `off` disables it), private to the user, bounded to
`MAX_CACHE_ENTRIES` (oldest first out); concurrent writers merge, and a lost or corrupt cache costs a re-hash.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import posixpath
import time
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import ClassVar

import fsspec

from forge_core.timings import FINGERPRINT_RACY_WINDOW_S

CACHE_ENV = "FORGE_HASH_CACHE"
MAX_CACHE_ENTRIES = 4096
_CHUNK_BYTES = 4 << 20
_CACHE_FORMAT = 1


def is_content_name(rel: str) -> bool:
    """False for names that are metadata, not content: any path segment starting with `.` or `_`."""
    return not any(segment.startswith((".", "_")) for segment in rel.split("/"))


def entries_fingerprint(entries: Mapping[str, str]) -> str:
    """sha256 over the sorted `{relative name: file sha256}` pairs."""
    digest = hashlib.sha256()
    for rel in sorted(entries):
        digest.update(rel.encode("utf-8") + b"\x00" + entries[rel].encode("ascii") + b"\n")
    return digest.hexdigest()


def files_fingerprint(fs: fsspec.AbstractFileSystem, files: Mapping[str, str]) -> str:
    """Fingerprint of `{relative name: path in fs}`, each file hashed through the cache."""
    cache = _HashCache.current()
    try:
        return entries_fingerprint({rel: _file_sha256(fs, path, cache) for rel, path in files.items()})
    finally:
        cache.save()


def folder_fingerprint(
    uri: str,
    storage_options: dict | None = None,
    names: Iterable[str] | None = None,
    what: str = "folder",
) -> str:
    """Fingerprint of the content files under the folder `uri` (a local path or any fsspec URI), or of only
    the `names` present; ValueError naming `what` when the folder does not exist or holds no such file."""
    fs, root = fsspec.core.url_to_fs(uri, **(storage_options or {}))
    if not fs.isdir(root):
        raise ValueError(f"{what}={uri}: no such folder; give a local folder or a storage URI of one")
    root = root.rstrip("/")
    files = {posixpath.relpath(path, root): path for path in fs.find(root)}
    wanted = set(names) if names is not None else None
    files = {
        rel: path
        for rel, path in files.items()
        if is_content_name(rel) and (wanted is None or rel in wanted)
    }
    if not files:
        expected = f" (expected one of {sorted(wanted)})" if wanted is not None else ""
        raise ValueError(f"{what}={uri}: the folder holds no files{expected}")
    return files_fingerprint(fs, files)


def _file_sha256(fs: fsspec.AbstractFileSystem, path: str, cache: _HashCache) -> str:
    validator = _validator(fs, path)
    if validator is not None and (cached := cache.get(validator)) is not None:
        return cached
    digest = hashlib.sha256()
    with fs.open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    sha256 = digest.hexdigest()
    # Re-validated after hashing: a file written while it was read must not be cached as that content.
    if validator is not None and _validator(fs, path) == validator:
        cache.put(validator, sha256)
    return sha256


def _validator(fs: fsspec.AbstractFileSystem, path: str) -> str | None:
    """A string that changes whenever the file's bytes may have changed; None = do not cache."""
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    if "file" in protocols or "local" in protocols:
        st = os.stat(path)
        if time.time() - max(st.st_mtime, st.st_ctime) < FINGERPRINT_RACY_WINDOW_S:
            return None
        identity = ["file", os.path.abspath(path), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
        return json.dumps(identity)
    if "s3" in protocols:
        info = fs.info(path)
        etag = info.get("ETag") or info.get("etag")
        return json.dumps(["s3", path, int(info["size"]), etag]) if etag else None
    return None


def _cache_path() -> Path | None:
    configured = os.environ.get(CACHE_ENV)
    if configured == "off":
        return None
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "forgeflow" / "content-hashes.json"


class _HashCache:
    """The on-disk file-hash cache (module docstring); one instance per cache path in a process."""

    _instances: ClassVar[dict[Path | None, _HashCache]] = {}

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._entries: dict[str, str] = self._load() if path is not None else {}
        self._new: dict[str, str] = {}

    @classmethod
    def current(cls) -> _HashCache:
        path = _cache_path()
        if path not in cls._instances:
            cls._instances[path] = cls(path)
        return cls._instances[path]

    def get(self, validator: str) -> str | None:
        return self._new.get(validator) or self._entries.get(validator)

    def put(self, validator: str, sha256: str) -> None:
        if self.path is not None:
            self._new[validator] = sha256

    def save(self) -> None:
        """Merge the new entries into the file (another process may have added its own), oldest dropped."""
        if self.path is None or not self._new:
            return
        merged = {**self._load(), **self._new}
        merged = dict(list(merged.items())[-MAX_CACHE_ENTRIES:])
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        staging = self.path.with_name(f".{self.path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
        fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "w") as out:
                json.dump({"format": _CACHE_FORMAT, "entries": merged}, out)
            os.replace(staging, self.path)
        except OSError:
            # A cache that cannot be written (read-only home, full disk) only costs re-hashing later.
            with contextlib.suppress(OSError):
                staging.unlink()
            return
        self._entries, self._new = merged, {}

    def _load(self) -> dict[str, str]:
        try:
            if self.path.stat().st_uid != os.getuid():
                return {}  # another user's file could claim any hash for any file: never trust it
            raw = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        entries = raw.get("entries") if isinstance(raw, dict) and raw.get("format") == _CACHE_FORMAT else None
        if not isinstance(entries, dict):
            return {}
        return {k: v for k, v in entries.items() if isinstance(k, str) and isinstance(v, str)}
