"""Source readers: every format on file:// and s3://, batching, and fail-fast errors naming file and columns."""

from __future__ import annotations

import pyarrow as pa
import pytest

from forge_core.data.pipeline import storage_options_for
from forge_core.data.sources import DataSourceError, read_source, source_fingerprint
from tests.data.conftest import jsonl_bytes, put, put_source

FIELDS = {"prompt": pa.string(), "completion": pa.string()}
RECORDS = [{"prompt": f"p{i} ü", "completion": f"c{i}", "extra": i} for i in range(25)]
FORMATS = ["jsonl", "parquet", "csv", "hf_disk"]


def read_all(store, uri, fmt="auto", batch_rows=10, fields=FIELDS, **options):
    return list(read_source(uri, fmt, fields, batch_rows, storage_options_for(uri, store), **options))


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_reads_the_same_rows_in_bounded_batches(store, fmt):
    uri = put_source(store, fmt, RECORDS)

    batches = read_all(store, uri, batch_rows=10)

    assert [len(b.rows) for b in batches] == [10, 10, 5]
    prompts = [p for b in batches for p in b.columns["prompt"]]
    completions = [c for b in batches for c in b.columns["completion"]]
    assert prompts == [r["prompt"] for r in RECORDS]
    assert completions == [r["completion"] for r in RECORDS]
    assert [row for b in batches for row in b.rows] == list(range(2 if fmt == "csv" else 1, 27 if fmt == "csv" else 26))
    assert set(batches[0].columns) == set(FIELDS)  # only the requested columns are materialised


@pytest.mark.parametrize("fmt", ["parquet", "csv", "hf_disk"])
def test_wrong_columns_fail_fast_naming_file_and_columns(file_store, fmt):
    uri = put_source(file_store, fmt, [{"question": "q", "completion": "c"}])

    with pytest.raises(DataSourceError) as err:
        read_all(file_store, uri)

    message = str(err.value)
    assert "['prompt']" in message and "question" in message and "completion" in message
    assert uri in message


def test_jsonl_without_the_field_in_its_first_batch_fails_fast(file_store):
    uri = put(file_store, "q.jsonl", jsonl_bytes([{"question": "q", "completion": "c"}] * 3))

    with pytest.raises(DataSourceError, match=r"missing column\(s\) \['prompt'\].*'completion', 'question'"):
        read_all(file_store, uri)


def test_missing_source_names_the_uri(store):
    uri = store.join(store.root, "sources", "nope.jsonl")

    with pytest.raises(DataSourceError, match="nope.jsonl.*no such file"):
        read_all(store, uri)


def test_unknown_extension_asks_for_data_format(file_store):
    uri = put(file_store, "train.txt", b"hello\n")

    with pytest.raises(DataSourceError, match="set data.format"):
        read_all(file_store, uri)
    assert read_all(file_store, put(file_store, "t.txt", jsonl_bytes(RECORDS[:2])), fmt="jsonl")[0].rows == [1, 2]


def test_folder_of_files_is_read_in_name_order(file_store):
    put(file_store, "shards/b.jsonl", jsonl_bytes(RECORDS[5:8]))
    put(file_store, "shards/a.jsonl", jsonl_bytes(RECORDS[:5]))
    put(file_store, "shards/_SUCCESS", b"")

    batches = read_all(file_store, file_store.join(file_store.root, "sources", "shards"))

    assert [b.source.rsplit("/", 1)[1] for b in batches] == ["a.jsonl", "b.jsonl"]
    assert [p for b in batches for p in b.columns["prompt"]] == [r["prompt"] for r in RECORDS[:8]]


def test_dataset_dict_folder_points_at_a_split(file_store):
    put(file_store, "dd/dataset_dict.json", b'{"splits": ["train"]}')
    put(file_store, "dd/train/state.json", b"{}")

    with pytest.raises(DataSourceError, match=r"DatasetDict with splits \['train'\].*dd/train"):
        read_all(file_store, file_store.join(file_store.root, "sources", "dd"))


def test_jsonl_bad_lines_become_rejects_and_good_lines_survive(file_store):
    lines = [b'{"prompt": "a", "completion": "b"}', b'{"prompt": "bad \xff", "completion": "x"}', b"not json",
             b"[1, 2]", b"", b'{"prompt": 7, "completion": "y"}']
    uri = put(file_store, "mixed.jsonl", b"\n".join(lines) + b"\n")

    (batch,) = read_all(file_store, uri)

    assert batch.rows == [1, 6]  # 1-based line numbers; the blank line is not a record
    assert batch.columns["prompt"] == ["a", 7]  # type problems are the layout's to judge
    assert [(r.source_row, r.reason.value) for r in batch.rejects] == [
        (2, "invalid_utf8"), (3, "invalid_json"), (4, "invalid_json")
    ]


def test_csv_invalid_utf8_and_malformed_rows_become_rejects(file_store):
    data = b'prompt,completion\n"ok",c0\n"bad \xff",c1\nonly-one-column\n"fine",c3\n'
    uri = put(file_store, "mixed.csv", data)

    batches = read_all(file_store, uri)

    prompts = [p for b in batches for p in b.columns["prompt"]]
    rejects = sorted((r.reason.value, r.detail.split(":")[0]) for b in batches for r in b.rejects)
    assert prompts == ["ok", "fine"]
    assert [reason for reason, _ in rejects] == ["invalid_utf8", "malformed_row"]
    assert sum(b.rows_read for b in batches) == 4


@pytest.mark.parametrize("fmt", ["jsonl", "hf_disk"])
def test_fingerprint_follows_content_not_location(store, fmt):
    first = put_source(store, fmt, RECORDS, name="one")
    copy = store.join(store.root, "elsewhere", first.rsplit("/", 1)[1])
    for uri in store.list_files(first):  # a byte-identical copy under another prefix
        store.put_bytes(copy + uri[len(first):], store.get_bytes(uri))
    changed = put_source(store, fmt, RECORDS[:-1], name="changed")
    options = storage_options_for(first, store)

    fingerprint = source_fingerprint(first, "auto", options)

    assert source_fingerprint(copy, "auto", options) == fingerprint
    assert source_fingerprint(changed, "auto", options) != fingerprint


# ---- input edge cases: very long lines, huge CSV fields, hostile save_to_disk file names -------------------


def _split_seconds(data: bytes, chunk_bytes: int) -> float:
    """CPU seconds to split `data` into lines (best of 3, so a descheduled moment does not count)."""
    import io
    import time

    from forge_core.data.sources import _iter_lines

    best = float("inf")
    for _ in range(3):
        started = time.process_time()
        for _line in _iter_lines(io.BytesIO(data), chunk_bytes):
            pass
        best = min(best, time.process_time() - started)
    return best


def test_a_line_of_tens_of_mb_is_split_in_linear_time():
    """Growth, not speed: doubling a 24 MiB line must not much more than double the work (joining each chunk
    onto the pending tail, as before, made it grow 4x: 48 MiB in 64 KiB chunks copied ~18 GB)."""
    from forge_core.data.sources import _iter_lines

    def source(line_mib: int) -> bytes:
        return b'{"a": 1}\n' + b"x" * (line_mib << 20) + b'\n{"b": 2}\n'

    lines = list(_iter_lines(__import__("io").BytesIO(source(3)), 1 << 16))
    assert [len(line) for line in lines] == [8, 3 << 20, 8]
    small, large = _split_seconds(source(24), 1 << 16), _split_seconds(source(48), 1 << 16)
    assert large < 3.0 * small + 0.05, f"24 MiB: {small:.3f}s, 48 MiB: {large:.3f}s of CPU"


def test_a_jsonl_record_with_a_20_mb_field_is_read_when_lines_may_be_that_long(file_store):
    big = "y" * (20 << 20)
    uri = put(file_store, "long.jsonl", jsonl_bytes([RECORDS[0], {"prompt": big, "completion": "c"}, RECORDS[1]]))

    batches = read_all(file_store, uri, max_line_bytes=32 << 20)
    assert [len(p) for b in batches for p in b.columns["prompt"]] == [4, len(big), 4]  # "p0 ü", ..., "p1 ü"

    by_default = read_all(file_store, uri)  # data.max_line_bytes' default, 1 MiB
    assert [len(p) for b in by_default for p in b.columns["prompt"]] == [4, 4]
    assert [(r.source_row, r.reason.value) for b in by_default for r in b.rejects] == [(2, "line_too_large")]


def test_csv_fields_over_1_mib_become_rejects_with_their_line_number(file_store):
    from forge_core.data.sources import CSV_MAX_FIELD_BYTES

    huge = "z" * (CSV_MAX_FIELD_BYTES + 1)
    data = (
        "prompt,completion,notes\n"
        "p0,c0,n\n"
        "\n"  # an empty line still counts as a line
        f"{huge},c1,n\n"
        "only-one-column\n"
        f"p3,c3,{huge}\n"  # a large field in a column nobody asked for is not read
        f'p4,"{huge[:CSV_MAX_FIELD_BYTES]}",n\n'  # exactly at the limit: kept
    ).encode()
    uri = put(file_store, "huge.csv", data)

    batches = read_all(file_store, uri, batch_rows=2)

    rejects = {(r.source_row, r.reason.value) for b in batches for r in b.rejects}
    assert rejects == {(4, "field_too_large"), (5, "malformed_row")}
    (too_large,) = [r for b in batches for r in b.rejects if r.reason.value == "field_too_large"]
    assert "CSV line 4" in too_large.detail and "'prompt'" in too_large.detail
    assert len(too_large.raw) < 4096  # a preview, not the megabyte
    assert [p for b in batches for p in b.columns["prompt"]] == ["p0", "p3", "p4"]
    assert [len(c) for b in batches for c in b.columns["completion"]] == [2, 2, CSV_MAX_FIELD_BYTES]
    assert [row for b in batches for row in b.rows] == [2, 6, 7]  # 1-based line numbers, as the rejects
    assert sum(b.rows_read for b in batches) == 5


@pytest.mark.parametrize("name", ["../outside.arrow", "/etc/passwd", "a/../../b.arrow"])
def test_hf_disk_file_names_cannot_leave_the_dataset_folder(file_store, name):
    import json

    uri = put_source(file_store, "hf_disk", RECORDS[:3])
    state_uri = f"{uri}/state.json"
    state = json.loads(file_store.get_bytes(state_uri))
    state["_data_files"] = [{"filename": name}]
    file_store.put_bytes(state_uri, json.dumps(state).encode())

    with pytest.raises(DataSourceError, match=r"not a file inside the dataset folder.*re-save the dataset"):
        read_all(file_store, uri)
