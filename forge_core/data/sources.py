"""Streaming readers for JSONL, Parquet, CSV and `datasets.save_to_disk` folders on any fsspec URI.

Memory stays flat however long the source; unreadable rows come back as `Reject`s, while a missing source,
unknown format or missing column raises `DataSourceError` at once. `save_to_disk` folders need only pyarrow.

    for batch in read_source("s3://bucket/train.jsonl", "auto", {"prompt": pa.string()}, 8192, opts):
        batch.columns["prompt"]  # list[str | None]
"""

from __future__ import annotations

import contextlib
import json
import posixpath
from collections.abc import Iterator
from dataclasses import dataclass, field

import fsspec
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.json as pajson
import pyarrow.parquet as pq

from forge_core.credentials import reveal_url, scrub_text
from forge_core.data.rejects import Reject, RejectReason, raw_text
from forge_core.storage.fingerprints import files_fingerprint
from forge_core.storage.uris import normalize_rel

FORMAT_EXTENSIONS = {
    "jsonl": (".jsonl", ".ndjson", ".json"),
    "parquet": (".parquet", ".pq"),
    "csv": (".csv",),
}
HF_STATE_FILE = "state.json"
HF_DICT_FILE = "dataset_dict.json"
_READ_CHUNK_BYTES = 4 << 20
# A CSV field longer than this is rejected as field_too_large.
CSV_MAX_FIELD_BYTES = 1 << 20
# A JSONL line longer than this is rejected as line_too_large unless data.max_line_bytes says otherwise.
MAX_LINE_BYTES = 1 << 20
_RAW_PREVIEW_CHARS = 1024  # what a reject keeps of an oversized row


class DataSourceError(ValueError):
    """The source cannot be read as configured: missing file, unknown format, missing columns."""


@dataclass(frozen=True)
class SourceFile:
    uri: str  # shown in errors and in the rejects table
    path: str  # the path inside `fs`
    format: str


@dataclass
class RawBatch:
    """Up to `batch_rows` rows of one file: readable rows as columns, unreadable rows as rejects."""

    source: str
    rows: list[int]  # 1-based row of each readable row: JSONL/CSV its line number, Parquet/Arrow its row number
    columns: dict[str, list]
    rejects: list[Reject] = field(default_factory=list)

    @property
    def rows_read(self) -> int:
        return len(self.rows) + len(self.rejects)


def read_source(
    uri: str,
    fmt: str,
    fields: dict[str, pa.DataType],
    batch_rows: int,
    storage_options: dict | None = None,
    max_line_bytes: int = MAX_LINE_BYTES,
) -> Iterator[RawBatch]:
    """Stream every file of the source `uri` as RawBatches of `fields` (name -> Arrow type, used only by the
    JSONL fast path; values come back as the file holds them). Lines over `max_line_bytes` become rejects."""
    fs, files = resolve_source(uri, fmt, storage_options)
    with _credentials_scrubbed():
        for source_file in files:
            if source_file.format == "jsonl":
                yield from _read_jsonl(fs, source_file, fields, batch_rows, max_line_bytes)
            else:
                yield from _ARROW_READERS[source_file.format](fs, source_file, fields, batch_rows)


def resolve_source(
    uri: str, fmt: str, storage_options: dict | None = None
) -> tuple[fsspec.AbstractFileSystem, list[SourceFile]]:
    """The filesystem and the files (with their formats) that make up the source `uri`."""
    fs, path = _open_source(uri, storage_options)
    with _credentials_scrubbed():
        return _resolve_files(uri, fmt, fs, path)


def _resolve_files(uri: str, fmt: str, fs: fsspec.AbstractFileSystem, path: str):
    if not fs.exists(path):
        raise DataSourceError(
            f"data.source={uri!r}: no such file or folder; check the path (and storage.endpoint_url for s3)"
        )
    if not fs.isdir(path):
        return fs, [SourceFile(uri, path, _file_format(uri, fmt))]
    entries = {posixpath.basename(p.rstrip("/")): p for p in fs.ls(path, detail=False)}
    if HF_DICT_FILE in entries:
        splits = sorted(name for name in entries if fs.isdir(entries[name]))
        raise DataSourceError(
            f"data.source={uri!r} is a DatasetDict with splits {splits}; point data.source at one split "
            f"folder, e.g. {uri.rstrip('/')}/{splits[0] if splits else 'train'}"
        )
    if HF_STATE_FILE in entries or fmt == "hf_disk":
        if HF_STATE_FILE not in entries:
            raise DataSourceError(
                f"data.source={uri!r}: data.format=hf_disk needs a datasets.save_to_disk folder with "
                f"{HF_STATE_FILE}; found {sorted(entries)}"
            )
        return fs, [SourceFile(uri, path, "hf_disk")]
    formats = [fmt] if fmt != "auto" else list(FORMAT_EXTENSIONS)
    files = [
        SourceFile(f"{uri.rstrip('/')}/{name}", entries[name], _format_of(name, formats))
        for name in sorted(entries)
        if not name.startswith(("_", ".")) and _format_of(name, formats) and not fs.isdir(entries[name])
    ]
    if not files:
        raise DataSourceError(
            f"data.source={uri!r}: folder has no {'/'.join(formats)} files (found {sorted(entries)}); "
            "set data.format or point data.source at a file"
        )
    return fs, files


def source_fingerprint(uri: str, fmt: str, storage_options: dict | None = None) -> str:
    """Content fingerprint of every file the source reads, named relative to `uri`: changes when a file is
    rewritten in place, equal for a byte-identical copy elsewhere."""
    fs, files = resolve_source(uri, fmt, storage_options)
    root = _open_source(uri, storage_options)[1]
    paths = []
    for source_file in files:
        if source_file.format == "hf_disk":
            paths += fs.find(source_file.path)
        else:
            paths.append(source_file.path)
    with _credentials_scrubbed():
        return files_fingerprint(fs, {posixpath.relpath(path, root): path for path in paths})


def _open_source(uri: str, storage_options: dict | None) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem and path of `uri`, with the credentials the config keeps redacted put back in."""
    with _credentials_scrubbed():
        return fsspec.core.url_to_fs(reveal_url(uri, what="data.source"), **(storage_options or {}))


@contextlib.contextmanager
def _credentials_scrubbed() -> Iterator[None]:
    """Re-raise errors that leak a credentialed URL with it redacted and their chain dropped: a ValueError as
    a fatal DataSourceError, anything else (transport) as a retryable OSError."""
    try:
        yield
    except Exception as exc:
        message = str(exc)
        clean = scrub_text(message)
        if clean == message and not _chain_leaks(exc):
            raise
        if isinstance(exc, ValueError):
            raise DataSourceError(f"{type(exc).__name__}: {clean}") from None
        raise OSError(f"{type(exc).__name__}: {clean}") from None


def _chain_leaks(exc: BaseException) -> bool:
    cause = exc.__cause__ or exc.__context__
    while cause is not None:
        if scrub_text(str(cause)) != str(cause):
            return True
        cause = cause.__cause__ or cause.__context__
    return False


def _format_of(name: str, formats: list[str]) -> str | None:
    lowered = name.lower()
    for fmt in formats:
        if lowered.endswith(FORMAT_EXTENSIONS.get(fmt, ())):
            return fmt
    return None


def _file_format(uri: str, fmt: str) -> str:
    if fmt == "hf_disk":
        raise DataSourceError(f"data.source={uri!r}: data.format=hf_disk needs a folder, not a file")
    if fmt != "auto":
        return fmt
    # A URL's query string (a presigned https source) is not part of its file name.
    detected = _format_of(uri.split("?", 1)[0] if "://" in uri else uri, list(FORMAT_EXTENSIONS))
    if detected is None:
        raise DataSourceError(
            f"data.source={uri!r}: cannot tell the format from the file name; set data.format to one of "
            f"{sorted(FORMAT_EXTENSIONS)} or rename the file"
        )
    return detected


def _missing_columns_error(source: str, missing: list[str], present: list[str]) -> DataSourceError:
    return DataSourceError(
        f"{source}: missing column(s) {missing}; the file has {present}. Map your columns with "
        "data.prompt_field / data.completion_field / data.ground_truth_field (or question_field / "
        "answer_field / messages_field for the gsm8k and chat layouts)"
    )


def _check_columns(source: str, present: list[str], fields: dict[str, pa.DataType]) -> None:
    missing = [name for name in fields if name not in present]
    if missing:
        raise _missing_columns_error(source, missing, present)


# --- JSONL ----------------------------------------------------------------------------------------------


class LineTooLarge(bytes):
    """A line longer than the cap: its first bytes (a preview), with its full size in `size`."""

    size: int


def _iter_lines(f, chunk_bytes: int = _READ_CHUNK_BYTES, max_line_bytes: int | None = None) -> Iterator[bytes]:
    """Lines without their newline, read in large chunks (fsspec's readline is slow on object stores), in
    linear time; a line over `max_line_bytes` is never held whole but comes as a `LineTooLarge`."""
    pending: list[bytes] = []  # the start of a line that an earlier chunk did not end
    pending_bytes = 0
    while chunk := f.read(chunk_bytes):
        pieces = chunk.split(b"\n")
        tail = pieces.pop()  # not ended by this chunk
        for piece in pieces:
            if pending:
                if pending_bytes <= (max_line_bytes or pending_bytes + len(piece)):
                    pending.append(piece)
                yield _line(pending, pending_bytes + len(piece), max_line_bytes)
                pending, pending_bytes = [], 0
            elif max_line_bytes is None or len(piece) <= max_line_bytes:
                yield piece  # the common case, one per row: no list to join
            else:
                yield _line([piece], len(piece), max_line_bytes)
        if pending_bytes <= (max_line_bytes or pending_bytes + len(tail)):
            pending.append(tail)
        pending_bytes += len(tail)
    if pending_bytes:
        yield _line(pending, pending_bytes, max_line_bytes)


def _line(pieces: list[bytes], size: int, max_line_bytes: int | None) -> bytes:
    if max_line_bytes is None or size <= max_line_bytes:
        return b"".join(pieces)
    line = LineTooLarge(b"".join(pieces)[:_RAW_PREVIEW_CHARS])
    line.size = size
    return line


def _read_jsonl(fs, source_file: SourceFile, fields: dict[str, pa.DataType], batch_rows: int, max_line_bytes: int):
    schema = pa.schema([pa.field(name, dtype) for name, dtype in fields.items()])
    for index, (lines, rows, too_large) in enumerate(_jsonl_blocks(fs, source_file.path, batch_rows, max_line_bytes)):
        batch = _parse_jsonl_lines(source_file.uri, lines, rows, schema)
        batch.rejects.extend(
            Reject(source_file.uri, row, RejectReason.LINE_TOO_LARGE,
                   f"the line is {line.size} bytes, over data.max_line_bytes={max_line_bytes}",
                   line.decode("utf-8", errors="replace"))
            for line, row in too_large
        )  # fmt: skip
        if index == 0:
            _check_jsonl_fields(source_file.uri, batch, lines, fields)
        yield batch


def _jsonl_blocks(
    fs, path: str, batch_rows: int, max_line_bytes: int
) -> Iterator[tuple[list[bytes], list[int], list[tuple[LineTooLarge, int]]]]:
    """Up to `batch_rows` lines at a time: non-blank lines with their 1-based numbers, and the oversized ones."""
    lines: list[bytes] = []
    rows: list[int] = []
    too_large: list[tuple[LineTooLarge, int]] = []
    with fs.open(path, "rb") as f:
        for number, line in enumerate(_iter_lines(f, max_line_bytes=max_line_bytes), start=1):
            if isinstance(line, LineTooLarge):
                too_large.append((line, number))
            elif line.strip():  # blank lines (a trailing newline) are not records
                lines.append(line)
                rows.append(number)
            if len(lines) + len(too_large) == batch_rows:
                yield lines, rows, too_large
                lines, rows, too_large = [], [], []
    if lines or too_large:
        yield lines, rows, too_large


def _parse_jsonl_lines(source: str, lines: list[bytes], rows: list[int], schema: pa.Schema) -> RawBatch:
    """Arrow's JSON parser for the whole block; line by line only when the block has a bad row in it."""
    block = b"\n".join(lines)
    try:
        table = pajson.read_json(
            pa.BufferReader(block),
            read_options=pajson.ReadOptions(block_size=len(block) + 1),
            parse_options=pajson.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore"),
        )
        table.validate(full=True)  # Arrow's JSON parser does not check UTF-8
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return _parse_jsonl_line_by_line(source, lines, rows, list(schema.names))
    if table.num_rows != len(lines):
        return _parse_jsonl_line_by_line(source, lines, rows, list(schema.names))
    return RawBatch(source, rows, table.to_pydict())


def _parse_jsonl_line_by_line(source: str, lines: list[bytes], rows: list[int], names: list[str]) -> RawBatch:
    batch = RawBatch(source, [], {name: [] for name in names})
    for line, row in zip(lines, rows):
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as exc:
            raw = line.decode("utf-8", errors="replace")
            batch.rejects.append(Reject(source, row, RejectReason.INVALID_UTF8, str(exc), raw))
            continue
        try:
            record = json.loads(text)
        except ValueError as exc:
            batch.rejects.append(Reject(source, row, RejectReason.INVALID_JSON, str(exc), text))
            continue
        except RecursionError:
            detail = "the JSON nests deeper than Python can parse"
            batch.rejects.append(Reject(source, row, RejectReason.INVALID_JSON, detail, text[:_RAW_PREVIEW_CHARS]))
            continue
        if not isinstance(record, dict):
            detail = f"a JSONL line must be an object, got {type(record).__name__}"
            batch.rejects.append(Reject(source, row, RejectReason.INVALID_JSON, detail, text))
            continue
        batch.rows.append(row)
        for name in names:
            batch.columns[name].append(record.get(name))
    return batch


def _check_jsonl_fields(source: str, batch: RawBatch, lines: list[bytes], fields: dict) -> None:
    """Fail fast when no record of the file's first batch has a requested field (a wrong mapping)."""
    missing = [name for name in fields if all(v is None for v in batch.columns[name])]
    if not missing or not batch.rows:
        return
    present: set[str] = set()
    for line in lines[:100]:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            present.update(k for k, v in record.items() if v is not None)
    raise _missing_columns_error(f"{source} (first {len(lines)} records)", missing, sorted(present))


# --- Arrow-backed formats (Parquet, CSV, save_to_disk) ----------------------------------------------------


def _rebatch(batches, batch_rows: int) -> Iterator[pa.RecordBatch]:
    """Batches of exactly `batch_rows` rows (the last may be shorter) from batches of any size."""
    pending: list[pa.RecordBatch] = []
    pending_rows = 0
    for batch in batches:
        pending.append(batch)
        pending_rows += batch.num_rows
        while pending_rows >= batch_rows:
            merged = pa.Table.from_batches(pending).combine_chunks().to_batches()[0]
            yield merged.slice(0, batch_rows)
            rest = merged.slice(batch_rows)
            pending, pending_rows = ([rest] if rest.num_rows else []), rest.num_rows
    if pending_rows:
        yield pa.Table.from_batches(pending).combine_chunks().to_batches()[0]


def _arrow_batch(
    source: str, batch: pa.RecordBatch, first_row: int, names: list[str], row_numbers: list[int] | None = None
) -> RawBatch:
    """Python columns of an Arrow batch, row i numbered `row_numbers[i]` or `first_row + i`; rows holding
    invalid UTF-8 become rejects."""
    batch = batch.select(names)
    numbers = row_numbers if row_numbers is not None else list(range(first_row, first_row + batch.num_rows))
    try:
        batch.validate(full=True)
        return RawBatch(source, list(numbers), batch.to_pydict())
    except pa.ArrowInvalid:
        pass
    result = RawBatch(source, [], {name: [] for name in names})
    for i in range(batch.num_rows):
        row = batch.slice(i, 1)
        try:
            row.validate(full=True)
        except pa.ArrowInvalid as exc:
            detail = f"invalid UTF-8: {exc}"
            result.rejects.append(Reject(source, numbers[i], RejectReason.INVALID_UTF8, detail, _raw_bytes(row)))
            continue
        result.rows.append(numbers[i])
        for name, values in row.to_pydict().items():
            result.columns[name].append(values[0])
    return result


def _raw_bytes(row: pa.RecordBatch) -> str:
    values = {}
    for name, column in zip(row.schema.names, row.columns):
        if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
            values[name] = column.cast(pa.binary()).to_pylist()[0]
        else:
            values[name] = "<unreadable: holds invalid UTF-8>"
    return raw_text(values)


def _read_parquet(fs, source_file: SourceFile, fields: dict[str, pa.DataType], batch_rows: int):
    names = list(fields)
    with fs.open(source_file.path, "rb") as f:
        parquet = pq.ParquetFile(f)
        _check_columns(source_file.uri, parquet.schema_arrow.names, fields)
        first_row = 1  # rows are numbered from 1, as every reject and source_row is
        for batch in parquet.iter_batches(batch_size=batch_rows, columns=names):
            yield _arrow_batch(source_file.uri, batch, first_row, names)
            first_row += batch.num_rows


def _read_csv(fs, source_file: SourceFile, fields: dict[str, pa.DataType], batch_rows: int):
    """CSV in blocks of `batch_rows` lines, each parsed by Arrow with the header line in front.

    A record is one physical line, so every reject carries its line number, and Arrow's streaming block limit
    never fails the whole file: a field over `CSV_MAX_FIELD_BYTES` is rejected instead.
    """


    names = list(fields)
    with fs.open(source_file.path, "rb") as f:
        lines = _csv_lines(f)
        header = next(lines, None)
        present = _csv_header(header[1]) if header else []
        _check_columns(source_file.uri, present, fields)
        first_row = 0
        for block in _line_blocks(lines, batch_rows):
            raw = _parse_csv_block(source_file.uri, header[1], block, names, first_row)
            first_row += len(raw.rows) + sum(r.reason != RejectReason.MALFORMED_ROW for r in raw.rejects)
            yield raw


def _csv_lines(f) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, line) of every non-empty line; Arrow skips empty lines the same way."""
    for index, line in enumerate(_iter_lines(f)):
        if line not in (b"", b"\r"):
            yield index + 1, line


def _line_blocks(lines: Iterator[tuple[int, bytes]], size: int) -> Iterator[list[tuple[int, bytes]]]:
    block: list[tuple[int, bytes]] = []
    for numbered in lines:
        block.append(numbered)
        if len(block) == size:
            yield block
            block = []
    if block:
        yield block


def _csv_header(line: bytes) -> list[str]:
    return pacsv.read_csv(pa.BufferReader(line + b"\n"), read_options=pacsv.ReadOptions(use_threads=False)).schema.names


def _parse_csv_block(
    source: str, header: bytes, block: list[tuple[int, bytes]], names: list[str], first_row: int
) -> RawBatch:
    numbers = [number for number, _ in block]
    text = b"\n".join([header, *(line for _, line in block)]) + b"\n"
    malformed: list[Reject] = []
    malformed_at: set[int] = set()

    def skip_malformed(row) -> str:
        index = (row.number or 0) - 2  # the header is line 1 of the block
        line = numbers[index] if 0 <= index < len(numbers) else -1
        detail = f"CSV line {line}: expected {row.expected_columns} columns, got {row.actual_columns}"
        malformed.append(Reject(source, line, RejectReason.MALFORMED_ROW, detail, row.text[:_RAW_PREVIEW_CHARS]))
        malformed_at.add(index)
        return "skip"

    table = pacsv.read_csv(
        pa.BufferReader(text),
        read_options=pacsv.ReadOptions(block_size=len(text) + 1, use_threads=False),
        parse_options=pacsv.ParseOptions(invalid_row_handler=skip_malformed),
        convert_options=pacsv.ConvertOptions(
            include_columns=names,
            column_types={name: pa.string() for name in names},
            check_utf8=False,  # checked per row by _arrow_batch, so one bad row does not stop the file
            strings_can_be_null=False,
            quoted_strings_can_be_null=False,
        ),
    )
    lines = [number for index, number in enumerate(numbers) if index not in malformed_at]
    if len(lines) != table.num_rows:  # a file with bare \r line ends: records and lines do not pair up
        lines = [-1] * table.num_rows
    batch = table.combine_chunks().to_batches()[0] if table.num_rows else None
    if batch is None:
        return RawBatch(source, [], {name: [] for name in names}, malformed)
    raw = _without_large_fields(source, batch, first_row, names, lines)
    raw.rejects.extend(malformed)
    return raw


def _without_large_fields(
    source: str, batch: pa.RecordBatch, first_row: int, names: list[str], lines: list[int]
) -> RawBatch:
    """Rows with a field over CSV_MAX_FIELD_BYTES become field_too_large rejects; the rest go on as usual."""
    sizes = [pc.binary_length(batch.column(name)) for name in names]
    largest = sizes[0] if len(sizes) == 1 else pc.max_element_wise(*sizes)
    too_large = pc.greater(largest, CSV_MAX_FIELD_BYTES).to_pylist()
    if not any(too_large):
        return _arrow_batch(source, batch, first_row, names, row_numbers=lines)
    result = RawBatch(source, [], {name: [] for name in names})
    for i, large in enumerate(too_large):
        if large:
            field_sizes = {name: size[i].as_py() for name, size in zip(names, sizes)}
            name = max(field_sizes, key=field_sizes.get)
            detail = (
                f"CSV line {lines[i]}: field {name!r} is {field_sizes[name]} bytes, over the "
                f"{CSV_MAX_FIELD_BYTES}-byte limit"
            )
            preview = {n: _text_preview(batch.column(n).slice(i, 1)) for n in names}
            result.rejects.append(Reject(source, lines[i], RejectReason.FIELD_TOO_LARGE, detail, raw_text(preview)))
            continue
        row = _arrow_batch(source, batch.slice(i, 1), first_row + i, names, row_numbers=[lines[i]])
        result.rows += row.rows
        result.rejects += row.rejects
        for name in names:
            result.columns[name] += row.columns[name]
    return result


def _text_preview(value: pa.Array) -> str:
    """The start of a one-value string array, readable even when it holds invalid UTF-8."""
    return value.cast(pa.binary()).to_pylist()[0][:_RAW_PREVIEW_CHARS].decode("utf-8", errors="replace")


def _read_hf_disk(fs, source_file: SourceFile, fields: dict[str, pa.DataType], batch_rows: int):
    names = list(fields)
    root = source_file.path.rstrip("/")
    with fs.open(f"{root}/{HF_STATE_FILE}", "rb") as f:
        state = json.load(f)
    data_files = [_hf_data_file(source_file.uri, entry) for entry in state.get("_data_files", [])]
    if not data_files:
        raise DataSourceError(f"{source_file.uri}: {HF_STATE_FILE} lists no _data_files; re-save the dataset")
    first_row = 1  # rows are numbered from 1 across the data files, as every reject and source_row is
    for filename in data_files:
        with fs.open(f"{root}/{filename}", "rb") as f:
            reader = pa.ipc.open_stream(f)
            _check_columns(f"{source_file.uri}/{filename}", reader.schema.names, fields)
            for batch in _rebatch(reader, batch_rows):
                yield _arrow_batch(source_file.uri, batch, first_row, names)
                first_row += batch.num_rows


def _hf_data_file(uri: str, entry) -> str:
    """A `_data_files` name from state.json: a plain file name inside the folder, never a way out of it."""
    filename = entry.get("filename") if isinstance(entry, dict) else None
    if not isinstance(filename, str) or not filename:
        raise DataSourceError(f"{uri}/{HF_STATE_FILE}: _data_files entry {entry!r} has no filename; re-save the dataset")
    try:
        return normalize_rel(filename)
    except (ValueError, TypeError) as exc:
        raise DataSourceError(
            f"{uri}/{HF_STATE_FILE}: _data_files names {filename!r}, which is not a file inside the dataset "
            f"folder ({exc}); re-save the dataset with datasets.save_to_disk, or fix the name in {HF_STATE_FILE}"
        ) from exc


_ARROW_READERS = {"parquet": _read_parquet, "csv": _read_csv, "hf_disk": _read_hf_disk}
