"""ArtifactWriter: one attempt at an artifact. Files go under the attempt's own prefix; `commit()` creates
`_MANIFEST.json` exclusively, last.

w = store.writer(uri, kind="sft", stage="sft")
with w.open("metrics.jsonl") as f:          # streamed in parts, hashed on the way
    f.write(b"...")
w.put_dir("/tmp/hf_model", "policy")        # an HF model folder
w.adopt_existing("")                        # files another tool (DCP) wrote under w.files_uri
w.adopt_hashed({"a.bin": FileEntry(size, sha256)})   # the same, hashed by that tool while writing
manifest = w.commit(config=cfg_dict, inputs={"data": data_uri}, metrics={"loss": 1.2})

Two writers of one key write to different prefixes `<uri>/_attempts/<attempt>/`; the first to create the
manifest owns the artifact and the other gets ArtifactAlreadyCommitted naming the winner (its `abort()`
removes its own files only). No writer ever writes, truncates or deletes a path another attempt owns.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import socket
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from forge_core.storage.errors import ArtifactAlreadyCommitted, ArtifactError, StorageError
from forge_core.storage.keys import code_version
from forge_core.storage.manifest import (
    CHECKPOINTS_DIR,
    MANIFEST_NAME,
    TEMP_MARKER,
    FileEntry,
    InputRef,
    Manifest,
    current_placement,
    is_attempt_id,
    new_attempt_id,
    utc_now_iso,
)
from forge_core.storage.streams import HashingWriter
from forge_core.storage.uris import normalize_rel

_COPY_CHUNK_BYTES = 8 * 2**20
# Run right before a manifest is published, with the artifact URI; raising refuses the commit (e.g.
# forge_core.launch.owner.check_owner_alive).
_pre_commit_checks: list[Callable[[str], None]] = []


def add_pre_commit_check(check: Callable[[str], None]) -> None:
    """Make every later commit of this process call `check(uri)` just before it writes the manifest."""
    if check not in _pre_commit_checks:
        _pre_commit_checks.append(check)


def arrow_schema_string(schema: pa.Schema) -> str:
    """The schema text recorded in manifests (field names and types, without pandas metadata)."""
    return schema.to_string(show_field_metadata=False, show_schema_metadata=False)


def _finite_or_text(value):
    """JSON has no NaN/inf: a diverged loss is recorded as the text "nan"/"inf" rather than failing commit."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite_or_text(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_text(v) for v in value]
    return value


def _is_reserved(rel: str) -> bool:
    """Files a writer may not own: any manifest, and the nested checkpoint artifacts."""
    segments = rel.split("/")
    return MANIFEST_NAME in segments or segments[0] == CHECKPOINTS_DIR


class ArtifactWriter:
    """Collects files (with size + sha256) under its attempt's prefix `files_uri`; `commit()` publishes them.
    Not thread-safe."""

    def __init__(self, store, uri: str, kind: str, stage: str, attempt: str | None = None) -> None:
        self.store = store
        self.uri = uri.rstrip("/")
        self.kind = kind
        self.stage = stage
        self.key = self.uri.rsplit("/", 1)[-1]
        self.attempt = attempt or new_attempt_id()
        if not is_attempt_id(self.attempt):
            raise ValueError(f"attempt={self.attempt!r}: must be one path segment of letters, digits, . _ -")
        # Where this attempt's files go: owned by this writer alone.
        self.files_uri = store.files_uri(self.uri, self.attempt)
        self.created_at = utc_now_iso()
        self._files: dict[str, FileEntry] = {}
        self._schema: dict[str, str] = {}
        self._open: set[str] = set()
        self._manifest: Manifest | None = None

    @property
    def files(self) -> dict[str, FileEntry]:
        return dict(self._files)

    def file_uri(self, rel: str) -> str:
        return self.store.join(self.files_uri, rel)

    def _writable_rel(self, rel: str) -> str:
        self._check_not_committed()
        rel = normalize_rel(rel)
        if not rel:
            raise ValueError(f"artifact {self.uri}: empty file name")
        if _is_reserved(rel):
            raise ValueError(
                f"artifact {self.uri}: file name {rel!r} is reserved ({MANIFEST_NAME} is written by commit(); "
                f"{CHECKPOINTS_DIR}/ holds nested checkpoint artifacts with writers of their own)"
            )
        if rel in self._open:
            raise ValueError(f"artifact {self.uri}: {rel!r} is already open for writing")
        return rel

    def _check_not_committed(self) -> None:
        if self._manifest is not None:
            raise ArtifactAlreadyCommitted(
                f"artifact {self.uri} was committed by this writer already", self.uri
            )

    # ---- writing --------------------------------------------------------------------------------------

    def open(self, rel: str, mode: str = "wb") -> HashingWriter:
        """A binary file to stream into; use it as a context manager. Recorded when closed cleanly."""
        if mode != "wb":
            raise ValueError(f"artifact files are write-once binary streams: mode must be 'wb', got {mode!r}")
        rel = self._writable_rel(rel)

        def record(entry: FileEntry) -> None:
            self._open.discard(rel)
            self._files[rel] = entry

        sink = self.store.open_part_sink(self.file_uri(rel))
        self._open.add(rel)
        return HashingWriter(sink, on_commit=record, on_abort=lambda: self._open.discard(rel))

    def write_bytes(self, rel: str, data: bytes) -> FileEntry:
        with self.open(rel) as f:
            f.write(data)
        return self._files[normalize_rel(rel)]

    def write_json(self, rel: str, obj) -> FileEntry:
        return self.write_bytes(rel, json.dumps(obj, sort_keys=True, indent=1).encode("utf-8"))

    def write_table(self, rel: str, table: pa.Table, **parquet_kwargs) -> FileEntry:
        """Write a Parquet file (schema recorded in the manifest); extra kwargs go to pq.write_table."""
        with self.open(rel) as f:
            pq.write_table(table, f, **parquet_kwargs)
        self._schema[normalize_rel(rel)] = arrow_schema_string(table.schema)
        return self._files[normalize_rel(rel)]

    @contextmanager
    def table_writer(self, rel: str, schema: pa.Schema, **parquet_kwargs):
        """A `pq.ParquetWriter` that streams record batches into `rel` (for tables larger than memory)."""
        with self.open(rel) as f, pq.ParquetWriter(f, schema, **parquet_kwargs) as parquet:
            yield parquet
        self._schema[normalize_rel(rel)] = arrow_schema_string(schema)

    def put_file(self, local_path: str | os.PathLike, rel: str) -> FileEntry:
        """Upload a local file, hashing it in the same pass."""
        with open(local_path, "rb") as src, self.open(rel) as dst:
            while chunk := src.read(_COPY_CHUNK_BYTES):
                dst.write(chunk)
        return self._files[normalize_rel(rel)]

    def put_dir(self, local_dir: str | os.PathLike, rel_prefix: str = "") -> list[str]:
        """Upload every file under `local_dir` (e.g. an HF model folder) to `<rel_prefix>/...`."""
        root = Path(local_dir)
        if not root.is_dir():
            raise ValueError(f"put_dir: {str(root)!r} is not a directory")
        written = []
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            relative = path.relative_to(root).as_posix()
            rel = normalize_rel(f"{rel_prefix}/{relative}" if rel_prefix else relative)
            self.put_file(path, rel)
            written.append(rel)
        return written

    def adopt_existing(self, rel_prefix: str = "") -> list[str]:
        """Record, hashing each by streaming it back, the files another tool (e.g. DCP's FsspecWriter) wrote
        under `<files_uri>/<rel_prefix>` (give the tool `writer.files_uri`, never the artifact URI); skips
        manifests, temp files, `_checkpoints/` and nested committed artifacts. Returns the adopted names;
        ValueError when there is nothing to adopt."""
        self._check_not_committed()
        base, adoptable = self._adoptable_files(rel_prefix)
        if not adoptable:
            raise ValueError(f"adopt_existing: no files under {base} to adopt; did the tool write elsewhere?")
        for rel, size in adoptable.items():
            self._files[rel] = self._hash_stored_file(rel, size)
        return list(adoptable)

    def adopt_hashed(self, entries: dict[str, FileEntry], rel_prefix: str = "") -> list[str]:
        """Like `adopt_existing`, for files the tool hashed while writing them (`entries`: {path relative to
        the prefix: FileEntry}): nothing is read back. Returns the names; StorageError unless the entries
        name exactly the adoptable files there at their stored sizes.
        """
        self._check_not_committed()
        prefix = normalize_rel(rel_prefix) if rel_prefix else ""
        given = {normalize_rel(f"{prefix}/{rel}" if prefix else rel): entry for rel, entry in entries.items()}
        base, stored = self._adoptable_files(rel_prefix)
        wrong = sorted(
            f"{rel}: hashed {given[rel].size if rel in given else 'nothing'}, stored {stored.get(rel, 'nothing')}"
            for rel in given.keys() | stored.keys()
            if rel not in given or stored.get(rel) != given[rel].size
        )
        if wrong:
            raise StorageError(f"adopt_hashed under {base}: hashed and stored files differ: {wrong}")
        self._files.update(sorted(given.items()))
        return sorted(given)

    def _adoptable_files(self, rel_prefix: str) -> tuple[str, dict[str, int]]:
        """(the prefix URI, {rel: size} of the files under it an artifact may own, sorted): no manifest, temp
        file, `_checkpoints/` entry or file of a nested committed artifact."""
        prefix = normalize_rel(rel_prefix) if rel_prefix else ""
        base = self.store.join(self.files_uri, prefix)
        listing = {self._rel_of(u): size for u, size in self.store.list_files(base).items()}
        nested = {rel.rsplit("/", 1)[0] + "/" for rel in listing if rel.endswith("/" + MANIFEST_NAME)}
        adoptable = {
            rel: size
            for rel, size in sorted(listing.items())
            if not (_is_reserved(rel) or TEMP_MARKER in rel or any(rel.startswith(n) for n in nested))
        }
        return base, adoptable

    def _rel_of(self, file_uri: str) -> str:
        assert file_uri.startswith(self.files_uri + "/"), (file_uri, self.files_uri)
        return file_uri[len(self.files_uri) + 1 :]

    def _hash_stored_file(self, rel: str, size: int) -> FileEntry:
        uri = self.file_uri(rel)
        digest = hashlib.sha256()
        for start in range(0, size, _COPY_CHUNK_BYTES):
            chunk = self.store.get_range(uri, start, min(start + _COPY_CHUNK_BYTES, size))
            digest.update(chunk)
        return FileEntry(size=size, sha256=digest.hexdigest())

    # ---- commit ---------------------------------------------------------------------------------------

    def commit(
        self, config: dict, inputs: dict[str, str], metrics: dict, schema: dict | None = None
    ) -> Manifest:
        """Create `_MANIFEST.json` exclusively (last): from now on the artifact exists for readers.

        `inputs` maps name -> committed artifact URI (recorded with its manifest sha256); `schema` adds or
        overrides {table file: arrow schema string} entries for tables written by hand. Raises
        ArtifactAlreadyCommitted (naming the winning attempt) when another writer's manifest is there first.
        """
        self._check_not_committed()
        if self._open:
            raise ValueError(
                f"artifact {self.uri}: files still open for writing: {sorted(self._open)}; close them"
            )
        table_schemas = {**self._schema, **(schema or {})}
        unknown = sorted(set(table_schemas) - set(self._files))
        if unknown:
            raise ValueError(f"artifact {self.uri}: schema names files that were not written: {unknown}")
        self._check_uploaded()
        manifest = Manifest(
            kind=self.kind,
            stage=self.stage,
            key=self.key,
            files=dict(sorted(self._files.items())),
            schema=table_schemas,
            config=config,
            inputs={
                name: InputRef(uri, self.store.manifest_sha256(uri)) for name, uri in sorted(inputs.items())
            },
            code_version=code_version(),
            host=socket.gethostname(),
            created_at=self.created_at,
            committed_at=utc_now_iso(),
            metrics=_finite_or_text(metrics),
            attempt=self.attempt,
            placement=current_placement(),
        )
        try:
            data = manifest.to_json_bytes()
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"artifact {self.uri}: config and metrics must be plain JSON data: {exc}"
            ) from exc
        for check in _pre_commit_checks:
            check(self.uri)
        if not self.store.create_exclusive(self.store.manifest_uri(self.uri), data):
            raise self._lost_to_winner()
        self._manifest = manifest
        return manifest

    def _lost_to_winner(self) -> ArtifactAlreadyCommitted:
        try:
            winner = self.store.read_manifest(self.uri).attempt
        except ArtifactError:
            winner = None  # unreadable or deleted again since: still not ours
        return ArtifactAlreadyCommitted(
            f"artifact {self.uri} is already committed by attempt {winner or '(unknown)'}; this writer "
            f"(attempt {self.attempt}) keeps its files apart under {self.files_uri} and its commit is dropped",
            self.uri,
            attempt=winner,
        )

    def abort(self) -> int:
        """Delete this attempt's own files (after losing a commit race, or giving up). Never touches another
        attempt's files; refused after this writer committed. Returns how many objects were deleted."""
        self._check_not_committed()
        return self.store.delete_prefix(self.files_uri)

    def _check_uploaded(self) -> None:
        """One listing confirms every recorded file is stored at its recorded size before we commit to it."""
        stored = {self._rel_of(u): size for u, size in self.store.list_files(self.files_uri).items()}
        wrong = {
            rel: (entry.size, stored.get(rel))
            for rel, entry in self._files.items()
            if stored.get(rel) != entry.size
        }
        if wrong:
            details = ", ".join(
                f"{rel}: expected {exp} bytes, stored {got}" for rel, (exp, got) in sorted(wrong.items())
            )
            raise StorageError(f"artifact {self.uri}: not committing, files missing or wrong size: {details}")
