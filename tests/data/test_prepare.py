"""The prepare stage end to end: demo artifact contents, determinism, file sources, the worker entry point."""

from __future__ import annotations

import math
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from forge_core.config import config_to_dict, replace
from forge_core.data import demo
from forge_core.data.pipeline import prepare_data, stage_config
from forge_core.data.schemas import PROMPTS_SCHEMA, SFT_SCHEMA, TABLES
from forge_core.data.tokenizer import load_tokenizer, train_text_tokenizer
from forge_core.run.spec import StageSpec, write_spec
from forge_core.storage import code_version, content_key
from tests.data.conftest import data_config, jsonl_bytes, put, put_source

SMALL_DEMO = {"demo": {"num_sft": 200, "num_rl": 300, "num_eval": 100}, "batch_rows": 128}


def prepare(store, key="k", **data):
    cfg = data_config(store, **data)
    uri = store.artifact_uri("data", key)
    return cfg, uri, prepare_data(cfg, uri, store)


def test_demo_artifact_holds_verifiable_splits(store):
    cfg, uri, manifest = prepare(store, **SMALL_DEMO)
    reader = store.reader(uri)
    tok = load_tokenizer(store.join(reader.files_uri, "tokenizer"), store.storage_options)
    sft = reader.read_table("sft.parquet")
    rl = reader.read_table("rl_prompts.parquet")
    held_out = reader.read_table("eval.parquet")

    assert manifest.metrics["rows"] == {"sft": 200, "rl_prompts": 300, "eval": 100, "rejects": 0}
    assert manifest.metrics["vocab_size"] == tok.vocab_size <= 64
    assert set(manifest.schema) == {rel for rel, _ in TABLES.values()}
    assert sft.schema == SFT_SCHEMA and rl.schema == PROMPTS_SCHEMA and held_out.schema == PROMPTS_SCHEMA
    sft_file = pq.ParquetFile(pa.BufferReader(reader.read_bytes("sft.parquet")))
    assert sft_file.num_row_groups == math.ceil(200 / 128)  # one row group per batch

    width = cfg.data.demo.num_digits + 1  # the answer is zero-padded to one digit more than the operands
    for row in sft.to_pylist():
        mask, ids = row["loss_mask"], row["input_ids"]
        assert len(ids) == len(mask) == row["length"] <= cfg.data.max_seq_len
        assert mask == [0] * row["prompt_length"] + [1] * (row["length"] - row["prompt_length"])
        assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id and tok.eos_id not in ids[:-1]
        prompt = tok.backend.decode(ids[: row["prompt_length"]])
        completion = tok.backend.decode(ids[row["prompt_length"]:])
        a, b = prompt.removeprefix("Q: ").removesuffix("=? A: ").split("+")
        assert demo.check_answer(completion, f"{int(a) + int(b):0{width}d}"), (prompt, completion)

    for row in rl.to_pylist() + held_out.to_pylist():
        assert row["prompt_ids"] == tok.backend.encode(row["prompt"]).ids
        a, b = row["prompt"].removeprefix("Q: ").removesuffix("=? A: ").split("+")
        assert row["ground_truth"] == f"{int(a) + int(b):0{width}d}"

    sft_prompts = {tok.backend.decode(ids[:n]) for ids, n in zip(sft["input_ids"].to_pylist(), sft["prompt_length"].to_pylist())}
    eval_prompts = set(held_out["prompt"].to_pylist())
    assert len(eval_prompts) == 100
    assert not eval_prompts & sft_prompts and not eval_prompts & set(rl["prompt"].to_pylist())


def test_same_inputs_and_config_give_identical_bytes_and_key(file_store):
    cfg, _, first = prepare(file_store, key="a", **SMALL_DEMO)
    cfg_again, _, second = prepare(file_store, key="b", **SMALL_DEMO)
    changed = replace(data_config(file_store, **SMALL_DEMO), seed=1)
    reseeded = prepare_data(changed, file_store.artifact_uri("data", "d"), file_store)

    assert {rel: (e.size, e.sha256) for rel, e in first.files.items()} == {
        rel: (e.size, e.sha256) for rel, e in second.files.items()
    }
    assert content_key("prepare", stage_config(cfg), {}, code_version()) == content_key(
        "prepare", stage_config(cfg_again), {}, code_version()
    )
    assert content_key("prepare", stage_config(changed), {}, code_version()) != content_key(
        "prepare", stage_config(cfg), {}, code_version()
    )
    assert reseeded.files["eval.parquet"].sha256 != first.files["eval.parquet"].sha256


GSM8K = [
    {"question": f"Tom has {i} apples and buys {i + 2} more. How many?",
     "answer": f"He has {i} + {i + 2} = {2 * i + 2} apples.\n#### {2 * i + 2:,}"}
    for i in range(400)
]


def test_gsm8k_file_through_the_worker_entry_point(s3_store, tmp_path):
    uri = put_source(s3_store, "jsonl", GSM8K, name="gsm8k")
    cfg = data_config(s3_store, source=uri, layout="gsm8k", eval_fraction=0.25, tokenizer={"vocab_size": 400})
    output_uri = s3_store.artifact_uri("data", "gsm8k")
    spec_uri = write_spec(s3_store, StageSpec("prepare", config_to_dict(cfg), {}, output_uri, {}))

    subprocess.run(
        [sys.executable, "-m", "forge_core.run", "prepare", "--spec", spec_uri, "--endpoint-url", s3_store.endpoint_url],
        check=True, capture_output=True, timeout=300,
    )

    reader = s3_store.reader(output_uri)
    rows = reader.manifest.metrics["rows"]
    assert rows["sft"] + rows["rl_prompts"] + rows["eval"] == 400 and rows["rejects"] == 0
    assert 0.15 < rows["eval"] / 400 < 0.35 and 0.2 < rows["rl_prompts"] / 400 < 0.4  # data.rl_fraction 0.3
    rl = reader.read_table("rl_prompts.parquet").to_pylist()
    by_question = {r["question"]: r for r in GSM8K}
    for row in rl:
        assert row["ground_truth"] == str(2 * int(row["prompt"].split()[2]) + 2)  # "1,000" -> "1000"
        assert by_question[row["prompt"]]["answer"].endswith(row["ground_truth"][-3:])
    assert not {r["prompt"] for r in rl} & set(reader.read_table("eval.parquet")["prompt"].to_pylist())


def test_prompt_completion_parquet_with_ground_truth_column_and_eval_split(file_store):
    # Repeated prompts must land on one side of the split only.
    records = [{"q": f"question {i % 150}", "a": f"answer {i}", "gt": i} for i in range(600)]
    uri = put_source(file_store, "parquet", records)

    _, out, manifest = prepare(
        file_store, source=uri, prompt_field="q", completion_field="a", ground_truth_field="gt",
        eval_fraction=0.3, tokenizer={"vocab_size": 300}, batch_rows=100,
    )

    reader = file_store.reader(out)
    rl = reader.read_table("rl_prompts.parquet").to_pylist()
    held_out = reader.read_table("eval.parquet").to_pylist()
    assert len(rl) + len(held_out) + manifest.metrics["rows"]["sft"] == 600
    assert not {r["prompt"] for r in rl} & {r["prompt"] for r in held_out}
    assert all(r["ground_truth"] == str(r["source_row"] - 1) for r in rl + held_out)  # ints as text; rows 1-based
    assert all(r["source"] == uri for r in rl)


CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.mark.parametrize("template_from", ["config", "tokenizer_folder"])
def test_chat_records_are_masked_on_the_assistant_turn(file_store, tmp_path, template_from):
    records = [
        {"messages": [{"role": "user", "content": f"say {i}"}, {"role": "assistant", "content": f"{i}!"}]}
        for i in range(50)
    ]
    uri = put(file_store, "chat.jsonl", jsonl_bytes(records))
    if template_from == "config":
        tokenizer = {"vocab_size": 300, "chat_template": CHAT_TEMPLATE}
    else:
        texts = [m["content"] for r in records for m in r["messages"]]
        folder = train_text_tokenizer(texts, 300, 64).with_chat_template(CHAT_TEMPLATE).save(str(tmp_path / "tok"))
        tokenizer = {"path": folder}

    _, out, _ = prepare(
        file_store, source=uri, layout="chat", eval_fraction=0.0, rl_reuses_sft=True, tokenizer=tokenizer
    )

    reader = file_store.reader(out)
    tok = load_tokenizer(file_store.join(reader.files_uri, "tokenizer"))
    assert tok.chat_template == CHAT_TEMPLATE
    sft = reader.read_table("sft.parquet").to_pylist()
    for row, record in zip(sft, records):
        ids, n = row["input_ids"], row["prompt_length"]
        # The template writes BOS and EOS itself; the completion stops at its EOS (the newline after it is cut).
        assert tok.backend.decode(ids[:n], skip_special_tokens=False).startswith("<s><|user|>")
        assert tok.backend.decode(ids[n:], skip_special_tokens=False) == record["messages"][1]["content"] + "</s>"
        assert ids.count(tok.bos_id) == 1 and ids[-1] == tok.eos_id
    assert reader.read_table("rl_prompts.parquet")["ground_truth"].to_pylist() == [f"{i}!" for i in range(50)]


def test_chat_layout_without_any_template_says_where_to_set_one(file_store):
    uri = put(file_store, "chat.jsonl", jsonl_bytes([{"messages": []}]))
    cfg = data_config(file_store, source=uri, layout="chat", tokenizer={"vocab_size": 300})

    with pytest.raises(ValueError, match="data.layout=chat needs a chat template: set data.tokenizer.chat_template"):
        prepare_data(cfg, file_store.artifact_uri("data", "x"), file_store)
