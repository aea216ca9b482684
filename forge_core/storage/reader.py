"""ArtifactReader: verified reads of a committed artifact.

    r = store.reader(uri)                       # ArtifactNotCommitted if there is no manifest
    table = r.read_table("sft.parquet", columns=["input_ids"])
    for batch in r.iter_batches("rollouts.parquet", batch_size=4096): ...
    local = r.download_dir("policy", "/tmp/policy")   # an HF folder for vLLM / transformers

Every byte handed out is checked against the manifest's size and sha256; a missing, truncated or altered
file raises ArtifactCorrupted naming the artifact URI and the file.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tempfile
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from forge_core.storage.errors import ArtifactCorrupted
from forge_core.storage.manifest import TEMP_MARKER, FileEntry, Manifest
from forge_core.storage.streams import PART_BYTES, VerifyingReader
from forge_core.storage.uris import normalize_rel

_READ_BUFFER_BYTES = 2**20


class ArtifactReader:
    """Read access to one committed artifact; `manifest` and `manifest_sha256` describe it."""

    def __init__(self, store, uri: str, manifest: Manifest, manifest_bytes: bytes) -> None:
        self.store = store
        self.uri = uri.rstrip("/")
        self.manifest = manifest
        self.manifest_sha256 = hashlib.sha256(manifest_bytes).hexdigest()
        # Where the committed attempt's files are (`<uri>/_attempts/<attempt>`; format 1: `uri`).
        self.files_uri = store.files_uri(self.uri, manifest.attempt)

    def file_uri(self, rel: str) -> str:
        """The stored object of file `rel` (for tools that read by path, e.g. DCP or DuckDB: verify first)."""
        return self.store.join(self.files_uri, self._entry(rel)[0])

    def files(self, rel_prefix: str = "") -> list[str]:
        """Names of the artifact's files under `rel_prefix` ("" = all), sorted."""
        prefix = _dir_prefix(rel_prefix)
        return sorted(rel for rel in self.manifest.files if rel.startswith(prefix))

    def _entry(self, rel: str) -> tuple[str, FileEntry]:
        rel = normalize_rel(rel)
        entry = self.manifest.files.get(rel)
        if entry is None:
            raise FileNotFoundError(
                f"artifact {self.uri} has no file {rel!r}; its manifest lists {sorted(self.manifest.files)[:20]}"
            )
        return rel, entry

    def _corrupted(self, rel: str, reason: str) -> ArtifactCorrupted:
        return ArtifactCorrupted(f"artifact {self.uri}: file {rel!r} is corrupted: {reason}", self.uri, rel)

    def open(self, rel: str) -> io.BufferedReader:
        """A sequential binary stream of `rel`, verified when it reaches EOF (no seeking)."""
        rel, entry = self._entry(rel)
        file_uri = self.store.join(self.files_uri, rel)
        try:
            stored_size = self.store.size_of(file_uri)
        except FileNotFoundError as exc:
            raise self._corrupted(rel, "missing from storage") from exc
        if stored_size != entry.size:
            kind = "truncated" if stored_size < entry.size else "longer than recorded"
            raise self._corrupted(rel, f"{kind}: stored size {stored_size} bytes, manifest size {entry.size}")

        def read_range(start: int, end: int) -> bytes:
            try:
                return self.store.get_range(file_uri, start, end)
            except FileNotFoundError as exc:
                raise self._corrupted(rel, "deleted while being read") from exc

        def mismatch(reason: str) -> None:
            raise self._corrupted(rel, reason)

        raw = VerifyingReader(read_range, entry, mismatch, chunk_bytes=PART_BYTES)
        return io.BufferedReader(raw, buffer_size=_READ_BUFFER_BYTES)

    def verify(self, rel_prefix: str = "") -> list[str]:
        """Stream every file under `rel_prefix` and check it against the manifest (e.g. a checkpoint before
        DCP loads it with its own reader). Returns the names checked; ArtifactCorrupted on the first bad one."""
        names = self.files(rel_prefix)
        for rel in names:
            self.verify_file(rel)
        return names

    def verify_file(self, rel: str) -> None:
        with self.open(rel) as f:
            while f.read(PART_BYTES):
                pass

    def read_bytes(self, rel: str) -> bytes:
        with self.open(rel) as f:
            return f.read()

    def read_json(self, rel: str):
        return json.loads(self.read_bytes(rel))

    def read_table(self, rel: str, columns: list[str] | None = None) -> pa.Table:
        """The whole Parquet table (verified before parsing), optionally only `columns`."""
        return pq.read_table(pa.BufferReader(self.read_bytes(rel)), columns=columns)

    def iter_batches(
        self, rel: str, batch_size: int = 65536, columns: list[str] | None = None
    ) -> Iterator[pa.RecordBatch]:
        """Record batches of a Parquet file too large to hold in memory (verified on local disk first)."""
        with self.verified_local_file(rel) as path:
            parquet = pq.ParquetFile(path)
            try:
                yield from parquet.iter_batches(batch_size=batch_size, columns=columns)
            finally:
                parquet.close()

    @contextmanager
    def verified_local_file(self, rel: str) -> Iterator[str]:
        """A local path holding the verified bytes of `rel`: the file itself on file:// stores (hashed in
        place), else a temporary download removed on exit."""
        rel, _ = self._entry(rel)
        local = self.store.local_path(self.file_uri(rel))
        if local is not None:
            self.verify_file(rel)
            yield local
            return
        with tempfile.TemporaryDirectory(prefix="forge-read-") as tmp:
            path = os.path.join(tmp, Path(rel).name)
            self.download_file(rel, path)
            yield path

    def download_file(self, rel: str, local_path: str | os.PathLike) -> Path:
        """Copy `rel` to `local_path` (verified; written to a temp name first, so a failure leaves nothing)."""
        dest = Path(local_path)
        dest.parent.mkdir(parents=True, exist_ok=True)
        temp = dest.with_name(f"{dest.name}{TEMP_MARKER}{uuid.uuid4().hex}")
        try:
            with self.open(rel) as src, open(temp, "wb") as dst:
                while chunk := src.read(PART_BYTES):
                    dst.write(chunk)
            os.replace(temp, dest)
        finally:
            temp.unlink(missing_ok=True)
        return dest

    def download_dir(
        self, rel_prefix: str, local_dir: str | os.PathLike, select: Callable[[str], bool] | None = None
    ) -> Path:
        """Copy every file under `rel_prefix` (e.g. "policy") into `local_dir`, keeping relative paths;
        returns `local_dir`. `select`: copy only the files whose path below the prefix it accepts.
        FileNotFoundError when the artifact has no file under the prefix."""
        prefix = _dir_prefix(rel_prefix)
        names = self.files(rel_prefix)
        if not names:
            raise FileNotFoundError(f"artifact {self.uri} has no files under {rel_prefix!r}")
        root = Path(local_dir)
        root.mkdir(parents=True, exist_ok=True)
        for rel in names:
            if select is None or select(rel[len(prefix) :]):
                self.download_file(rel, root / rel[len(prefix) :])
        return root


def _dir_prefix(rel_prefix: str) -> str:
    prefix = normalize_rel(rel_prefix) if rel_prefix else ""
    return prefix + "/" if prefix else ""
