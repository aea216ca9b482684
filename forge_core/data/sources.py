"""Streaming readers for JSONL, Parquet, CSV and `datasets.save_to_disk` folders on any fsspec URI.

`read_source(uri, format, fields, batch_rows, storage_options)` yields `RawBatch`es of at most `batch_rows`
rows holding only the requested fields as Python lists, so memory stays flat however long the file is.
Rows that cannot be read (invalid UTF-8, a JSONL line that is not a JSON object, a CSV row with the wrong
number of columns) come back as `Reject`s in the batch instead of stopping the read. A source that does not
exist, has an unknown format, or lacks a requested column fails at once with a `DataSourceError` naming the
file and the columns it has.

    for batch in read_source("s3://bucket/train.jsonl", "auto", {"prompt": pa.string()}, 8192, opts):
        batch.columns["prompt"]  # list[str | None]

A `save_to_disk` folder (`state.json` + Arrow IPC stream files) is read with pyarrow alone, so the runtime
does not need the `datasets` package.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
from collections.abc import Iterator
from dataclasses import dataclass, field

import fsspec
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.json as pajson
import pyarrow.parquet as pq

from forge_core.data.rejects import Reject, RejectReason, raw_text

FORMAT_EXTENSIONS = {
    "jsonl": (".jsonl", ".ndjson", ".json"),
    "parquet": (".parquet", ".pq"),
    "csv": (".csv",),
}
HF_STATE_FILE = "state.json"
HF_DICT_FILE = "dataset_dict.json"
_READ_CHUNK_BYTES = 4 << 20
_CSV_BLOCK_BYTES = 1 << 20


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
    rows: list[int]  # 0-based row number of each readable row (JSONL: line number)
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
) -> Iterator[RawBatch]:
    """Stream every file of the source `uri` as RawBatches of the requested `fields` (name -> Arrow type).

    `fields` types matter only for JSONL's fast path (text fields are `pa.string()`); readers return
    whatever Python values the file holds and leave type checks to the layout.
    """
    fs, files = resolve_source(uri, fmt, storage_options)
    readers = {"jsonl": _read_jsonl, "parquet": _read_parquet, "csv": _read_csv, "hf_disk": _read_hf_disk}
    for source_file in files:
        yield from readers[source_file.format](fs, source_file, fields, batch_rows)


def resolve_source(
    uri: str, fmt: str, storage_options: dict | None = None
) -> tuple[fsspec.AbstractFileSystem, list[SourceFile]]:
    """The filesystem and the files (with their formats) that make up the source `uri`."""
    fs, path = fsspec.core.url_to_fs(uri, **(storage_options or {}))
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
    """sha256 over the names (relative to `uri`) and bytes of every file the source reads.

    For content keys: a source rewritten in place gets a new key, a byte-identical copy elsewhere the same.
    """
    fs, files = resolve_source(uri, fmt, storage_options)
    root = fsspec.core.url_to_fs(uri, **(storage_options or {}))[1]
    paths = []
    for source_file in files:
        if source_file.format == "hf_disk":
            paths += [p for p in fs.find(source_file.path) if posixpath.basename(p) != HF_STATE_FILE]
            paths.append(f"{source_file.path.rstrip('/')}/{HF_STATE_FILE}")
        else:
            paths.append(source_file.path)
    digest = hashlib.sha256()
    for path in sorted(paths):
        digest.update(posixpath.relpath(path, root).encode("utf-8") + b"\x00")
        with fs.open(path, "rb") as f:
            while chunk := f.read(_READ_CHUNK_BYTES):
                digest.update(chunk)
        digest.update(b"\x00")
    return digest.hexdigest()


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
    detected = _format_of(uri, list(FORMAT_EXTENSIONS))
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


def _iter_lines(f) -> Iterator[bytes]:
    """Lines without their newline, read in large chunks (fsspec's readline on object stores is slow)."""
    tail = b""
    while chunk := f.read(_READ_CHUNK_BYTES):
        lines = (tail + chunk).split(b"\n")
        tail = lines.pop()
        yield from lines
    if tail:
        yield tail


def _read_jsonl(fs, source_file: SourceFile, fields: dict[str, pa.DataType], batch_rows: int):
    schema = pa.schema([pa.field(name, dtype) for name, dtype in fields.items()])
    for index, (lines, rows) in enumerate(_jsonl_blocks(fs, source_file.path, batch_rows)):
        batch = _parse_jsonl_lines(source_file.uri, lines, rows, schema)
        if index == 0:
            _check_jsonl_fields(source_file.uri, batch, lines, fields)
        yield batch


def _jsonl_blocks(fs, path: str, batch_rows: int) -> Iterator[tuple[list[bytes], list[int]]]:
    """Up to `batch_rows` non-blank lines at a time, with their 0-based line numbers."""
    lines: list[bytes] = []
    rows: list[int] = []
    with fs.open(path, "rb") as f:
        for number, line in enumerate(_iter_lines(f)):
            if not line.strip():
                continue  # blank lines (a trailing newline) are not records
            lines.append(line)
            rows.append(number)
            if len(lines) == batch_rows:
                yield lines, rows
                lines, rows = [], []
    if lines:
        yield lines, rows


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


def _arrow_batch(source: str, batch: pa.RecordBatch, first_row: int, names: list[str]) -> RawBatch:
    """Python columns of an Arrow batch; rows holding invalid UTF-8 become rejects one by one."""
    batch = batch.select(names)
    try:
        batch.validate(full=True)
        return RawBatch(source, list(range(first_row, first_row + batch.num_rows)), batch.to_pydict())
    except pa.ArrowInvalid:
        pass
    result = RawBatch(source, [], {name: [] for name in names})
    for i in range(batch.num_rows):
        row = batch.slice(i, 1)
        try:
            row.validate(full=True)
        except pa.ArrowInvalid as exc:
            detail = f"invalid UTF-8: {exc}"
            result.rejects.append(Reject(source, first_row + i, RejectReason.INVALID_UTF8, detail, _raw_bytes(row)))
            continue
        result.rows.append(first_row + i)
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
        first_row = 0
        for batch in parquet.iter_batches(batch_size=batch_rows, columns=names):
            yield _arrow_batch(source_file.uri, batch, first_row, names)
            first_row += batch.num_rows


def _read_csv(fs, source_file: SourceFile, fields: dict[str, pa.DataType], batch_rows: int):
    names = list(fields)
    with fs.open(source_file.path, "rb") as f:
        header = pacsv.open_csv(
            f,
            read_options=pacsv.ReadOptions(block_size=_CSV_BLOCK_BYTES),
            parse_options=pacsv.ParseOptions(invalid_row_handler=lambda row: "skip"),  # counted below
        ).schema.names
    _check_columns(source_file.uri, header, fields)
    malformed: list[Reject] = []

    def skip_malformed(row) -> str:
        line = row.number if row.number is not None else -1
        detail = f"CSV line {line}: expected {row.expected_columns} columns, got {row.actual_columns}"
        malformed.append(Reject(source_file.uri, line, RejectReason.MALFORMED_ROW, detail, row.text))
        return "skip"

    convert = pacsv.ConvertOptions(
        include_columns=names,
        column_types={name: pa.string() for name in names},
        check_utf8=False,  # checked per row below, so one bad row does not stop the file
        strings_can_be_null=False,
        quoted_strings_can_be_null=False,
    )
    with fs.open(source_file.path, "rb") as f:
        reader = pacsv.open_csv(
            f,
            read_options=pacsv.ReadOptions(block_size=_CSV_BLOCK_BYTES, use_threads=False),
            parse_options=pacsv.ParseOptions(invalid_row_handler=skip_malformed),
            convert_options=convert,
        )
        first_row = 0
        for batch in _rebatch(reader, batch_rows):
            raw = _arrow_batch(source_file.uri, batch, first_row, names)
            raw.rejects.extend(malformed)
            malformed.clear()
            first_row += batch.num_rows
            yield raw
    if malformed:
        yield RawBatch(source_file.uri, [], {name: [] for name in names}, list(malformed))


def _read_hf_disk(fs, source_file: SourceFile, fields: dict[str, pa.DataType], batch_rows: int):
    names = list(fields)
    root = source_file.path.rstrip("/")
    with fs.open(f"{root}/{HF_STATE_FILE}", "rb") as f:
        state = json.load(f)
    data_files = [entry["filename"] for entry in state.get("_data_files", [])]
    if not data_files:
        raise DataSourceError(f"{source_file.uri}: {HF_STATE_FILE} lists no _data_files; re-save the dataset")
    first_row = 0
    for filename in data_files:
        with fs.open(f"{root}/{filename}", "rb") as f:
            reader = pa.ipc.open_stream(f)
            _check_columns(f"{source_file.uri}/{filename}", reader.schema.names, fields)
            for batch in _rebatch(reader, batch_rows):
                yield _arrow_batch(source_file.uri, batch, first_row, names)
                first_row += batch.num_rows
