"""The hashing writer under every artifact file: parts of exactly `part_bytes` in order (S3 multipart needs
equal parts but the last), whatever sizes the caller writes, and the size and sha256 of the bytes it was given."""

from __future__ import annotations

import hashlib
import os

from forge_core.storage.streams import HashingWriter, PartSink


class _Parts(PartSink):
    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.tail: bytes | None = None

    def upload_part(self, data: bytes) -> None:
        self.parts.append(bytes(data))

    def finish(self, tail: bytes) -> None:
        self.tail = bytes(tail)


def test_parts_are_whole_and_in_order_whatever_the_write_sizes():
    data = os.urandom(200)
    # Writes smaller than a part, straddling parts, several parts at once, empty, and one ending on a boundary.
    sizes = [3, 4, 25, 1, 0, 12, 7, 48, 10, 90]
    assert sum(sizes) == len(data)
    sink, recorded = _Parts(), []
    writer = HashingWriter(sink, recorded.append, part_bytes=10)
    offset = 0
    for size in sizes:
        assert writer.write(data[offset : offset + size]) == size
        offset += size
    writer.close()
    assert [len(part) for part in sink.parts] == [10] * 20 and sink.tail == b""
    assert b"".join(sink.parts) == data
    assert [(entry.size, entry.sha256) for entry in recorded] == [(200, hashlib.sha256(data).hexdigest())]


def test_the_tail_holds_what_is_left_of_the_last_part():
    data = os.urandom(37)
    sink, recorded = _Parts(), []
    with HashingWriter(sink, recorded.append, part_bytes=16) as writer:
        writer.write(memoryview(data)[:5])
        writer.write(bytearray(data[5:]))
    assert [len(part) for part in sink.parts] == [16, 16] and sink.tail == data[32:]
    assert b"".join(sink.parts) + sink.tail == data and recorded[0].size == 37
