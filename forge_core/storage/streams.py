"""Streaming file objects: a writer that hashes while it uploads in parts, a reader that verifies at EOF.

Memory stays bounded by one part/chunk (PART_BYTES), whatever the file size: checkpoints and model
shards never sit whole in RAM.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
from collections.abc import Callable, Iterator

from forge_core.storage.manifest import FileEntry
from forge_core.storage.retry import Retrier

log = logging.getLogger(__name__)

# S3 needs parts of >= 5 MiB except the last; 8 MiB keeps memory small and requests few.
PART_BYTES = 8 * 2**20


class PartSink:
    """Where a HashingWriter's bytes go, in order: zero or more full parts, then the final tail."""

    def upload_part(self, data: bytes) -> None:
        raise AssertionError("subclasses implement upload_part")

    def finish(self, tail: bytes) -> None:
        raise AssertionError("subclasses implement finish")

    def abort(self) -> None:
        raise AssertionError("subclasses implement abort")


class FsFileSink(PartSink):
    """Writes through an fsspec file opened for writing (local disk, memory://)."""

    def __init__(self, fs, path: str) -> None:
        self._fs = fs
        self._path = path
        self._file = fs.open(path, "wb")

    def upload_part(self, data: bytes) -> None:
        with _naming_the_file(self._path):
            self._file.write(data)

    def finish(self, tail: bytes) -> None:
        with _naming_the_file(self._path):
            self._file.write(tail)
            self._file.close()

    def abort(self) -> None:
        self._file.close()
        if self._fs.exists(self._path):
            self._fs.rm_file(self._path)


@contextlib.contextmanager
def _naming_the_file(path: str) -> Iterator[None]:
    """A failed write names its file (a full disk's error from write() does not), so that the fix the
    failure classification gives (forge_core.launch.errors) can say which disk is full."""
    try:
        yield
    except OSError as exc:
        if exc.filename is not None or exc.errno is None:
            raise
        raise OSError(exc.errno, exc.strerror, path) from exc


class S3MultipartSink(PartSink):
    """S3 multipart upload whose every request is retried on its own (a part's bytes are still in hand); a
    file smaller than one part becomes a single PutObject."""

    def __init__(self, fs, path: str, retrier: Retrier, what: str) -> None:
        self._fs = fs
        self._bucket, self._key, _ = fs.split_path(path)
        self._retrier = retrier
        self._what = what
        self._upload_id: str | None = None
        self._parts: list[dict] = []

    def _call(self, method: str, **kwargs):
        return self._retrier.call(
            f"{method} {self._what}", self._fs.call_s3, method, Bucket=self._bucket, Key=self._key, **kwargs
        )

    def upload_part(self, data: bytes) -> None:
        if self._upload_id is None:
            self._upload_id = self._call("create_multipart_upload")["UploadId"]
        number = len(self._parts) + 1
        response = self._call("upload_part", UploadId=self._upload_id, PartNumber=number, Body=data)
        self._parts.append({"PartNumber": number, "ETag": response["ETag"]})

    def finish(self, tail: bytes) -> None:
        if self._upload_id is None:
            self._call("put_object", Body=tail)
        else:
            if tail:
                self.upload_part(tail)
            self._call(
                "complete_multipart_upload", UploadId=self._upload_id, MultipartUpload={"Parts": self._parts}
            )
        self._fs.invalidate_cache(f"{self._bucket}/{self._key}")

    def abort(self) -> None:
        if self._upload_id is not None:
            try:
                self._fs.call_s3(
                    "abort_multipart_upload", Bucket=self._bucket, Key=self._key, UploadId=self._upload_id
                )
            except Exception as exc:  # noqa: BLE001 - best effort; the original error is the one to report
                log.debug("abort_multipart_upload of %s failed: %s", self._what, exc)


class HashingWriter(io.IOBase):
    """A write-only binary file that hashes bytes as they pass and hands full parts to a PartSink. A clean
    close calls `on_commit(FileEntry(size, sha256))`; when the `with` block raises (or the upload fails) it
    aborts the upload, calls `on_abort()` and records nothing."""

    def __init__(
        self,
        sink: PartSink,
        on_commit: Callable[[FileEntry], None],
        on_abort: Callable[[], None] = lambda: None,
        part_bytes: int = PART_BYTES,
    ) -> None:
        super().__init__()
        self._sink = sink
        self._on_commit = on_commit
        self._on_abort = on_abort
        self._part_bytes = part_bytes
        self._buffer = bytearray()
        self._sha256 = hashlib.sha256()
        self._size = 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        if self.closed:
            raise ValueError("write to a closed artifact file")
        view = memoryview(data).cast("B")
        self._sha256.update(view)
        self._size += len(view)
        start = 0
        if self._buffer:  # top up the part begun by earlier writes
            start = min(self._part_bytes - len(self._buffer), len(view))
            self._buffer += view[:start]
            if len(self._buffer) == self._part_bytes:
                self._sink.upload_part(bytes(self._buffer))
                self._buffer = bytearray()
        # Whole parts go straight from the caller's bytes: one copy each, none through the staging buffer.
        while len(view) - start >= self._part_bytes:
            self._sink.upload_part(view[start : start + self._part_bytes].tobytes())
            start += self._part_bytes
        self._buffer += view[start:]
        return len(view)

    def tell(self) -> int:
        return self._size

    def close(self) -> None:
        if self.closed:
            return
        try:
            self._sink.finish(bytes(self._buffer))
        except BaseException:
            self.abort()
            raise
        self._buffer = bytearray()
        super().close()
        self._on_commit(FileEntry(size=self._size, sha256=self._sha256.hexdigest()))

    def abort(self) -> None:
        """Drop what was written; the file is not recorded. Safe to call more than once."""
        if self.closed:
            return
        self._buffer = bytearray()
        super().close()
        try:
            self._sink.abort()
        finally:
            self._on_abort()

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def __del__(self) -> None:
        # IOBase.__del__ would close() = finish and record a file its writer abandoned half-written.
        try:
            self.abort()
        except Exception as exc:  # noqa: BLE001 - never raise from a finalizer
            log.debug("aborting an abandoned artifact file failed: %s", exc)


class VerifyingReader(io.RawIOBase):
    """A read-only stream over `read_range(start, end)` that checks size and sha256 when it reaches EOF;
    `on_mismatch(reason)` must raise. No seeking: verification needs every byte in order."""

    def __init__(
        self,
        read_range: Callable[[int, int], bytes],
        expected: FileEntry,
        on_mismatch: Callable[[str], None],
        chunk_bytes: int = PART_BYTES,
    ) -> None:
        super().__init__()
        self._read_range = read_range
        self._expected = expected
        self._on_mismatch = on_mismatch
        self._chunk_bytes = chunk_bytes
        self._sha256 = hashlib.sha256()
        self._chunk = b""
        self._chunk_pos = 0
        self._offset = 0  # bytes fetched so far
        self._verified = False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        if self._chunk_pos >= len(self._chunk):
            self._fetch_next_chunk()
        n = min(len(buffer), len(self._chunk) - self._chunk_pos)
        buffer[:n] = self._chunk[self._chunk_pos : self._chunk_pos + n]
        self._chunk_pos += n
        return n

    def _fetch_next_chunk(self) -> None:
        remaining = self._expected.size - self._offset
        if remaining <= 0:
            self._verify_once()
            self._chunk, self._chunk_pos = b"", 0
            return
        want = min(remaining, self._chunk_bytes)
        chunk = self._read_range(self._offset, self._offset + want)
        if len(chunk) != want:
            self._on_mismatch(
                f"truncated: manifest size {self._expected.size} bytes, got only {self._offset + len(chunk)}"
            )
        self._sha256.update(chunk)
        self._offset += len(chunk)
        self._chunk, self._chunk_pos = chunk, 0

    def _verify_once(self) -> None:
        if self._verified:
            return
        digest = self._sha256.hexdigest()
        if digest != self._expected.sha256:
            self._on_mismatch(f"sha256 {digest} does not match the manifest's {self._expected.sha256}")
        self._verified = True
