"""Fixtures of the data tests: a store per backend and writers that put source files of every format on it."""

from __future__ import annotations

import io
import json
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from forge_core.config import config_from_dict


@pytest.fixture(params=["file", "s3"])
def store(request, tmp_path):
    """An ObjectStore on a local folder, then on the moto S3 server (the same test runs on both)."""
    if request.param == "file":
        return request.getfixturevalue("file_store")
    return request.getfixturevalue("s3_store")


def put(store, name: str, data: bytes) -> str:
    """Upload `data` as `<store root>/sources/<name>`; returns its URI."""
    uri = store.join(store.root, "sources", name)
    store.put_bytes(uri, data)
    return uri


def jsonl_bytes(records: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode("utf-8")


def parquet_bytes(records: list[dict]) -> bytes:
    sink = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(records), sink)
    return sink.getvalue()


def csv_bytes(records: list[dict]) -> bytes:
    sink = io.BytesIO()
    pacsv.write_csv(pa.Table.from_pylist(records), sink)
    return sink.getvalue()


def put_source(store, fmt: str, records: list[dict], name: str = "train") -> str:
    """Write `records` in format `fmt` (jsonl, parquet, csv, hf_disk) to the store; returns the source URI."""
    if fmt == "hf_disk":
        return put_hf_disk(store, records, name)
    writers = {"jsonl": jsonl_bytes, "parquet": parquet_bytes, "csv": csv_bytes}
    return put(store, f"{name}.{fmt}", writers[fmt](records))


def put_hf_disk(store, records: list[dict], name: str) -> str:
    """A real `datasets.Dataset.save_to_disk` folder, uploaded file by file."""
    import datasets

    with tempfile.TemporaryDirectory() as tmp:
        datasets.Dataset.from_list(records).save_to_disk(tmp)
        for path in sorted(Path(tmp).iterdir()):
            put(store, f"{name}/{path.name}", path.read_bytes())
    return store.join(store.root, "sources", name)


def data_config(store, **data):
    """A RunConfig whose data section is `data` (nested dicts allowed), storage on `store`."""
    return config_from_dict(
        {
            "storage": {"root": store.root, "endpoint_url": store.endpoint_url},
            "data": data,
        }
    )
