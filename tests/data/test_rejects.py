"""Bad input: every class of bad row lands in rejects.parquet with its reason, counted; too many fail the stage."""

from __future__ import annotations

import json
import logging

import pytest

from forge_core.config import replace
from forge_core.data.pipeline import prepare_data
from forge_core.data.rejects import RejectThresholdExceeded
from tests.data.conftest import data_config, put

GOOD = [json.dumps({"prompt": f"what is {i}?", "completion": f"it is {i}"}).encode() for i in range(20)]


def rejected(store, uri):
    table = store.reader(uri).read_table("rejects.parquet")
    return sorted(zip(table["source_row"].to_pylist(), table["reason"].to_pylist()))


def run(store, source_uri, key="k", **data):
    settings = {
        "tokenizer": {"vocab_size": 300}, "max_reject_fraction": 0.5, "eval_fraction": 0.0, "rl_reuses_sft": True, **data
    }
    cfg = data_config(store, source=source_uri, **settings)
    out = store.artifact_uri("data", key)
    return out, prepare_data(cfg, out, store)


def test_prompt_completion_rejects_each_bad_class_with_its_reason(file_store, caplog):
    bad = [
        b'{"prompt": "no completion key"}',  # line 21 (rows are 1-based line numbers)
        b'{"prompt": null, "completion": "x"}',
        b'{"prompt": "   ", "completion": "x"}',
        b'{"prompt": ["a list"], "completion": "x"}',
        b'{"prompt": "caf\xe9 latin-1", "completion": "x"}',
        b'{"prompt": "unterminated',
        json.dumps({"prompt": "long " * 200, "completion": "x"}).encode(),
    ]
    uri = put(file_store, "bad.jsonl", b"\n".join(GOOD + bad) + b"\n")

    with caplog.at_level(logging.INFO, logger="forge_core.data"):
        out, manifest = run(file_store, uri, max_seq_len=64)

    assert rejected(file_store, out) == [
        (21, "missing_field"), (22, "missing_field"), (23, "empty_field"), (24, "wrong_type"),
        (25, "invalid_utf8"), (26, "invalid_json"), (27, "too_long"),
    ]
    assert manifest.metrics["rejects_by_reason"] == {
        "empty_field": 1, "invalid_json": 1, "invalid_utf8": 1, "missing_field": 2, "too_long": 1, "wrong_type": 1
    }
    assert manifest.metrics["rows"]["sft"] == 20 and manifest.metrics["rows_read"] == 27
    assert "7 of 27 rows rejected" in caplog.text and "missing_field=2" in caplog.text
    table = file_store.reader(out).read_table("rejects.parquet").to_pylist()
    too_long = next(r for r in table if r["reason"] == "too_long")
    assert "> data.max_seq_len=64" in too_long["detail"] and "long long" in too_long["raw"]
    assert "caf\ufffd latin-1" in next(r for r in table if r["reason"] == "invalid_utf8")["raw"]


def test_gsm8k_answers_without_a_final_number_are_unparsable(file_store):
    records = [{"question": f"q{i}", "answer": f"so {i}\n#### {i}"} for i in range(10)]
    records += [{"question": "q", "answer": "no marker 5"}, {"question": "q", "answer": "#### five"}]
    uri = put(file_store, "g.jsonl", "".join(json.dumps(r) + "\n" for r in records).encode())

    out, manifest = run(file_store, uri, layout="gsm8k")

    assert rejected(file_store, out) == [(11, "unparsable_ground_truth"), (12, "unparsable_ground_truth")]  # lines
    assert manifest.metrics["rows"]["rl_prompts"] == 10


def test_chat_records_that_do_not_end_with_the_assistant_are_invalid(file_store):
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    bad = [
        {"messages": [{"role": "user", "content": "hi"}]},
        {"messages": [{"role": "assistant", "content": "x"}, {"role": "user", "content": "hi"}]},
        {"messages": "not a list"},
        {"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]},
    ]
    uri = put(file_store, "c.jsonl", "".join(json.dumps(r) + "\n" for r in [good] * 8 + bad).encode())

    out, _ = run(file_store, uri, layout="chat",
                 tokenizer={"vocab_size": 300, "chat_template": "{% for m in messages %}{{ m.content }}|{% endfor %}"})

    assert rejected(file_store, out) == [(9, "invalid_messages"), (10, "invalid_messages"), (11, "invalid_messages"),
                                         (12, "invalid_messages")]


def test_csv_malformed_and_invalid_utf8_rows(file_store):
    rows = [f'"what is {i}?","it is {i}"'.encode() for i in range(10)]
    data = b"prompt,completion\n" + b"\n".join(rows + [b"one-column-only", b'"bad \xff",x', b'"",x']) + b"\n"
    uri = put(file_store, "bad.csv", data)

    out, manifest = run(file_store, uri)

    assert manifest.metrics["rejects_by_reason"] == {"empty_field": 1, "invalid_utf8": 1, "malformed_row": 1}
    assert sorted(reason for _, reason in rejected(file_store, out)) == ["empty_field", "invalid_utf8", "malformed_row"]
    assert manifest.metrics["rows_read"] == 13


def test_too_many_rejects_fail_with_counts_examples_and_fix_and_commit_nothing(store):
    lines = GOOD[:7] + [b'{"prompt": ""}', b"{broken", b'{"completion": "x"}']
    uri = put(store, "mostly_bad.jsonl", b"\n".join(lines))
    cfg = data_config(store, source=uri, tokenizer={"vocab_size": 300}, max_reject_fraction=0.2)
    out = store.artifact_uri("data", "fails")

    with pytest.raises(RejectThresholdExceeded) as err:
        prepare_data(cfg, out, store)

    message = str(err.value)
    assert "3 of 10 rows rejected (30.0%)" in message and "max_reject_fraction=0.2" in message
    assert "empty_field=1, invalid_json=1, missing_field=1" in message
    assert "mostly_bad.jsonl row 8: empty_field" in message  # the 1-based line number
    assert not store.is_committed(out)

    cfg = replace(cfg, data=replace(cfg.data, max_reject_fraction=0.3))  # at the threshold: accepted
    assert prepare_data(cfg, out, store).metrics["reject_fraction"] == pytest.approx(0.3)
