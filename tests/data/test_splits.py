"""External data gets disjoint SFT / RL / eval splits (data.eval_fraction, data.rl_fraction, seeded, recorded in the
manifest); data.rl_reuses_sft says deliberately that RL prompts are the SFT rows."""

from __future__ import annotations

import pytest

from forge_core.config import ConfigError, load_config
from forge_core.data.pipeline import SplitAssigner, prepare_data
from tests.data.conftest import data_config, jsonl_bytes, put

RECORDS = [{"question": f"How much is {i} plus {i}?", "answer": f"{i} + {i}\n#### {2 * i}"} for i in range(600)]


def _prepare(store, uri, key, **data):
    cfg = data_config(store, source=uri, layout="gsm8k", tokenizer={"vocab_size": 300}, **data)
    out = store.artifact_uri("data", key)
    manifest = prepare_data(cfg, out, store)
    reader = store.reader(out)
    sft_ids = set(reader.read_table("sft.parquet")["prompt_id"].to_pylist())
    rl_ids = set(reader.read_table("rl_prompts.parquet")["prompt_id"].to_pylist())
    eval_ids = set(reader.read_table("eval.parquet")["prompt_id"].to_pylist())
    return manifest, sft_ids, rl_ids, eval_ids


def test_splits_are_disjoint_seeded_and_recorded(file_store):
    uri = put(file_store, "gsm8k.jsonl", jsonl_bytes(RECORDS))

    manifest, sft, rl, held_out = _prepare(file_store, uri, "a")

    assert not sft & rl and not sft & held_out and not rl & held_out
    assert len(sft) + len(rl) + len(held_out) == 600
    assert 0.5 < len(sft) / 600 < 0.7 and 0.2 < len(rl) / 600 < 0.4 and 0.05 < len(held_out) / 600 < 0.15
    assert manifest.metrics["splits"] == {
        "method": "crc32 of the prompt salted by the seed (forge_core.data.pipeline.SplitAssigner)",
        "seed": 0,
        "eval_fraction": 0.1,
        "rl_fraction": 0.3,
        "rl_reuses_sft": False,
    }
    # Determinism: the same seed splits the same way, another seed another way.
    _, sft_again, rl_again, eval_again = _prepare(file_store, uri, "b", batch_rows=37)
    assert (sft_again, rl_again, eval_again) == (sft, rl, held_out)
    assert (sft, rl) != _prepare_with_seed(file_store, uri, seed=1)


def _prepare_with_seed(store, uri, seed):
    cfg = load_config(None, [f"storage.root={store.root}", f"seed={seed}", f"data.source={uri}", "data.layout=gsm8k",
                             "data.tokenizer.vocab_size=300"])
    out = store.artifact_uri("data", f"seed-{seed}")
    prepare_data(cfg, out, store)
    reader = store.reader(out)
    return (set(reader.read_table("sft.parquet")["prompt_id"].to_pylist()),
            set(reader.read_table("rl_prompts.parquet")["prompt_id"].to_pylist()))


def test_rl_can_reuse_the_sft_rows_when_asked(file_store):
    uri = put(file_store, "gsm8k.jsonl", jsonl_bytes(RECORDS[:200]))

    manifest, sft, rl, held_out = _prepare(file_store, uri, "reuse", rl_reuses_sft=True)

    assert sft == rl and not sft & held_out and len(sft) + len(held_out) == 200
    assert manifest.metrics["splits"]["rl_reuses_sft"] is True and manifest.metrics["splits"]["rl_fraction"] is None


def test_split_assigner_is_a_function_of_prompt_and_seed():
    prompts = [f"prompt {i}" for i in range(2000)]
    first = [SplitAssigner(7, 0.1, 0.3, False)(p) for p in prompts]
    assert first == [SplitAssigner(7, 0.1, 0.3, False)(p) for p in prompts]
    assert {d for d in first} == {("sft",), ("rl_prompts",), ("eval",)}
    # The eval split does not depend on rl_fraction (eval sets stay put when the RL share changes).
    other = [SplitAssigner(7, 0.1, 0.5, False)(p) for p in prompts]
    assert [d == ("eval",) for d in first] == [d == ("eval",) for d in other]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data.rl_fraction=0.95"], r"data.rl_fraction=0.95: must be in \(0, 1\) with data.eval_fraction \+ data.rl_fraction < 1"),
        (["data.rl_reuses_sft=true", "data.rl_fraction=0.2"], r"data.rl_fraction=0.2 with data.rl_reuses_sft=true"),
    ],
)
def test_split_settings_that_cannot_work_are_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)
