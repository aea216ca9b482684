"""Rows that used to take the prepare stage down: one huge JSONL line (its memory grew with the line, ~280x)
and one nested 100k levels deep (a RecursionError failed the whole stage unclassified). Each is now one reject
with its line number, and the stage goes on."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.data.test_memory import CHILD, write_rows
from tests.data.test_tokenizer import demo_tokenizer

pytestmark = pytest.mark.integration

def prepare_in_child(tmp_path, source, name: str) -> dict:
    tokenizer_dir = demo_tokenizer().save(str(tmp_path / "tokenizer"))
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(source), tokenizer_dir, f"file://{tmp_path}/store-{name}"],
        capture_output=True, text=True, timeout=900, check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def rejects_of(tmp_path, name: str) -> list[dict]:
    import pyarrow.parquet as pq

    (table,) = (tmp_path / f"store-{name}").rglob("rejects.parquet")
    return pq.read_table(table).to_pylist()


@pytest.mark.fault(
    fault="one 10 MB JSONL line among 1000 normal rows",
    where="prepare stage (forge_core.data.sources, JSONL reader)",
    checked="the line is a line_too_large reject naming its line number, never parsed or tokenised: the stage's "
    "peak RSS stays within 64 MiB of the same file without that line (it grew by gigabytes before)",
)
def test_a_huge_jsonl_line_is_rejected_without_reading_it_whole(tmp_path, fault_row):
    plain, huge = tmp_path / "plain.jsonl", tmp_path / "huge.jsonl"
    write_rows(plain, 1000)
    rows = plain.read_text().splitlines(keepends=True)
    big = json.dumps({"prompt": "7+" * (5 << 20), "completion": "0"}) + "\n"
    huge.write_text("".join(rows[:500]) + big + "".join(rows[500:]))
    baseline = prepare_in_child(tmp_path, plain, "plain")
    report = prepare_in_child(tmp_path, huge, "huge")
    grew_mib = (report["peak_rss_kib"] - baseline["peak_rss_kib"]) / 1024
    assert grew_mib < 64, (baseline["peak_rss_kib"], report["peak_rss_kib"])
    (reject,) = [r for r in rejects_of(tmp_path, "huge") if r["reason"] == "line_too_large"]
    assert reject["source_row"] == 501 and "data.max_line_bytes" in reject["detail"], reject
    fault_row.fact(f"peak RSS {grew_mib:+.0f} MiB against the file without the line")


@pytest.mark.fault(
    fault="one JSONL row nested 100,000 levels deep",
    where="prepare stage (forge_core.data.sources, JSONL reader)",
    checked="the row is an invalid_json reject naming its line number; the other rows are prepared",
)
def test_a_row_nested_too_deep_is_rejected_and_the_rest_prepared(tmp_path, fault_row):
    source = tmp_path / "deep.jsonl"
    write_rows(source, 200)
    rows = source.read_text().splitlines(keepends=True)
    deep = '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + ', "completion": "1"}\n'
    source.write_text("".join(rows[:10]) + deep + "".join(rows[10:]))
    report = prepare_in_child(tmp_path, source, "deep")
    assert report["rows_read"] == 201
    (reject,) = [r for r in rejects_of(tmp_path, "deep") if r["source_row"] == 11]
    assert reject["reason"] == "invalid_json" and "deeper" in reject["detail"], reject
    fault_row.fact("1 reject (line 11), 200 rows prepared")
