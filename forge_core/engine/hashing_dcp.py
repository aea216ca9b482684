"""Writing DCP checkpoints with every file hashed on its way out, so a commit never reads the shards back.

Every byte DCP writes also goes through sha256, and each finished file is recorded as a `FileEntry` (size,
sha256) under its name relative to the checkpoint folder (`.metadata` under its final name: DCP writes
`.metadata.tmp` and renames it). Each rank records only the files it wrote; rank 0 commits all of them
(`ArtifactWriter.adopt_hashed`).

    writer = HashingFsspecWriter(store.fsspec_path(files_uri), **store.storage_options)
    dcp.save(state, storage_writer=writer)
    writer.written_files        # {"__0_0.distcp": FileEntry(size, sha256), ".metadata": ...} of this rank
"""

from __future__ import annotations

import hashlib
import io
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from torch.distributed.checkpoint._fsspec_filesystem import FileSystem, FsspecWriter

from forge_core.storage import FileEntry


class _HashingStream(io.RawIOBase):
    """A write-only view of a DCP output stream that hashes what passes through; everything else (tell,
    flush, fileno for DCP's fsync) is the wrapped stream's own."""

    def __init__(self, raw) -> None:
        super().__init__()
        self._raw = raw
        self._sha256 = hashlib.sha256()
        self._size = 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        written = self._raw.write(view)
        written = len(view) if written is None else written
        self._sha256.update(view[:written])
        self._size += written
        return written

    def tell(self) -> int:
        return self._raw.tell()

    def flush(self) -> None:
        self._raw.flush()

    def fileno(self) -> int:
        return self._raw.fileno()

    def close(self) -> None:
        # DCP closes its stream itself inside create_stream: that close finishes the wrapped file (on S3, its
        # upload), so a failure there still fails DCP's block. IOBase.close flushes first.
        if self.closed:
            return
        try:
            super().close()
        finally:
            self._raw.close()

    def entry(self) -> FileEntry:
        return FileEntry(size=self._size, sha256=self._sha256.hexdigest())


class _HashingFileSystem(FileSystem):
    """torch's fsspec FileSystem that records a FileEntry for every file written under its checkpoint path."""

    def __init__(self) -> None:
        super().__init__()
        self.root = ""
        self.written: dict[str, FileEntry] = {}
        self._lock = threading.Lock()  # DCP may write files from several threads (thread_count > 1)

    def init_path(self, path, **kwargs):
        path = super().init_path(path, **kwargs)
        self.root = os.fspath(path).rstrip("/")
        return path

    def _rel(self, path) -> str:
        path = os.fspath(path)
        assert path.startswith(self.root + "/"), (path, self.root)
        return path[len(self.root) + 1 :]

    @contextmanager
    def create_stream(self, path, mode: str) -> Iterator[io.IOBase]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as raw:
            stream = _HashingStream(raw)
            yield stream
        # Reached only when DCP's block finished without an error (the file is complete).
        with self._lock:
            self.written[self._rel(path)] = stream.entry()

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)
        with self._lock:
            entry = self.written.pop(self._rel(path), None)
            if entry is not None:
                self.written[self._rel(new_path)] = entry


class HashingFsspecWriter(FsspecWriter):
    """`FsspecWriter` whose files are hashed while written (see the module docstring)."""

    def __init__(self, path: str, **storage_options) -> None:
        super().__init__(path, **storage_options)
        self.fs = _HashingFileSystem()
        self.path = self.fs.init_path(path, **storage_options)

    @property
    def written_files(self) -> dict[str, FileEntry]:
        """This rank's finished files: {name relative to the checkpoint folder: FileEntry}."""
        with self.fs._lock:
            return dict(self.fs.written)
