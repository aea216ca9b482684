"""Tokenizers: the demo BPE (deterministic, single-digit tokens, HF-loadable), loading folders, chat templates."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from forge_core.data import demo
from forge_core.data.chat import ChatTemplate
from forge_core.data.pipeline import storage_options_for
from forge_core.data.tokenizer import (
    CHAT_TEMPLATE_FILE,
    CONFIG_FILE,
    TokenizerError,
    load_tokenizer,
    train_demo_tokenizer,
    train_text_tokenizer,
)
from tests.data.conftest import put

# A ChatML-style template like those of common instruct models.
CHATML = (
    "{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def demo_tokenizer(seed=0, vocab_size=64):
    splits = demo.generate_splits(3, num_sft=300, num_rl=0, num_eval=0, seed=seed)
    texts = [t for e in splits["sft"] for t in (e.prompt, e.completion)]
    return train_demo_tokenizer(texts, vocab_size, 64, demo.ALPHABET)


def test_demo_tokenizer_keeps_digits_single_and_round_trips():
    tok = demo_tokenizer()
    example = demo.AdditionExample(907, 5, 3)

    prompt = tok.backend.encode(example.prompt)
    completion = tok.backend.encode(example.completion, add_special_tokens=False)

    assert prompt.ids[0] == tok.bos_id
    digit_tokens = [t for t in prompt.tokens + completion.tokens if any(ch.isdigit() for ch in t)]
    assert digit_tokens == list("907005") + list("0912")
    assert len(prompt.ids) + len(completion.ids) + 1 <= 20  # short sequences for a tiny model
    assert tok.backend.decode(prompt.ids + completion.ids + [tok.eos_id]) == example.prompt + example.completion
    assert tok.vocab_size <= 64


def test_demo_tokenizer_knows_the_whole_alphabet_even_if_unseen():
    tok = train_demo_tokenizer(["Q: 1+1=? A: "], 64, 64, demo.ALPHABET)

    text = demo.AdditionExample(987, 654, 3).prompt + demo.AdditionExample(987, 654, 3).completion
    assert tok.backend.decode(tok.backend.encode(text, add_special_tokens=False).ids) == text


def test_demo_tokenizer_is_byte_identical_in_another_process(tmp_path):
    code = (
        "import sys; from tests.data.test_tokenizer import demo_tokenizer; "
        "demo_tokenizer(seed=3).save(sys.argv[1])"
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "other")], check=True)

    demo_tokenizer(seed=3).save(str(tmp_path / "here"))

    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tmp_path / "here" / name).read_bytes() == (tmp_path / "other" / name).read_bytes()


def test_saved_folder_loads_in_transformers_with_the_same_ids(tmp_path):
    from transformers import AutoTokenizer

    tok = demo_tokenizer()
    tok.save(str(tmp_path))
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    example = demo.AdditionExample(123, 45, 3)

    assert hf(example.prompt)["input_ids"] == tok.backend.encode(example.prompt).ids
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (tok.bos_id, tok.eos_id, tok.pad_id)
    ids = hf(example.prompt + example.completion)["input_ids"] + [hf.eos_token_id]
    assert hf.decode(ids, skip_special_tokens=True) == example.prompt + example.completion


def test_chat_rendering_matches_transformers_apply_chat_template(tmp_path):
    from transformers import AutoTokenizer

    tok = demo_tokenizer().with_chat_template(CHATML)
    tok.save(str(tmp_path))
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    messages = [{"role": "system", "content": "add"}, {"role": "user", "content": "1+2?"},
                {"role": "assistant", "content": "3"}]

    prompt, completion = ChatTemplate(tok.chat_template, tok.bos_token, tok.eos_token, tok.pad_token).split_last_turn(messages)

    assert prompt == hf.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
    assert prompt + completion == hf.apply_chat_template(messages, tokenize=False)
    assert completion == "3<|im_end|>\n"


def test_load_tokenizer_from_the_store(store):
    tok = demo_tokenizer().with_chat_template(CHATML)
    for name, content in tok.files.items():
        put(store, f"tok/{name}", content)
    put(store, "tok/model.safetensors", b"weights are not tokenizer files")
    uri = store.join(store.root, "sources", "tok")

    loaded = load_tokenizer(uri, storage_options_for(uri, store))

    assert loaded.backend.encode("Q: 12+34=? A: ").ids == tok.backend.encode("Q: 12+34=? A: ").ids
    assert (loaded.eos_id, loaded.bos_id, loaded.pad_id) == (tok.eos_id, tok.bos_id, tok.pad_id)
    assert loaded.chat_template == CHATML
    assert set(loaded.files) == set(tok.files)


def test_load_tokenizer_reads_added_token_dicts_and_config_templates(file_store):
    tok = demo_tokenizer()
    config = json.loads(tok.files[CONFIG_FILE])
    config["eos_token"] = {"content": "</s>", "lstrip": False}
    config["chat_template"] = CHATML
    put(file_store, "tok/tokenizer.json", tok.files["tokenizer.json"])
    put(file_store, f"tok/{CONFIG_FILE}", json.dumps(config).encode())

    loaded = load_tokenizer(file_store.join(file_store.root, "sources", "tok"))

    assert loaded.eos_id == tok.eos_id and loaded.chat_template == CHATML
    replaced = loaded.with_chat_template("{{ messages[0]['content'] }}")
    assert "chat_template" not in json.loads(replaced.files[CONFIG_FILE])
    assert replaced.files[CHAT_TEMPLATE_FILE] == b"{{ messages[0]['content'] }}"


def test_load_tokenizer_errors_name_the_folder_and_the_fix(file_store):
    missing = file_store.join(file_store.root, "sources", "none")
    with pytest.raises(TokenizerError, match="none.*folder not found"):
        load_tokenizer(missing)

    put(file_store, "sp/tokenizer.model", b"sentencepiece")
    with pytest.raises(TokenizerError, match=r"no tokenizer.json \(found \['tokenizer.model'\]\).*save_pretrained"):
        load_tokenizer(file_store.join(file_store.root, "sources", "sp"))

    put(file_store, "noeos/tokenizer.json", demo_tokenizer().files["tokenizer.json"])
    put(file_store, f"noeos/{CONFIG_FILE}", b'{"bos_token": "<s>"}')
    with pytest.raises(TokenizerError, match="no eos_token.*add \"eos_token\""):
        load_tokenizer(file_store.join(file_store.root, "sources", "noeos"))


def test_text_tokenizer_covers_every_byte_and_needs_room_for_them():
    with pytest.raises(TokenizerError, match="vocab_size=100.*>= 260"):
        train_text_tokenizer(["hello"], 100, 64)

    tok = train_text_tokenizer(["Natalia sold 48 clips in April."] * 50, 300, 64)
    text = "Ünïcode ✓ 1234 never seen"
    ids = tok.backend.encode(text, add_special_tokens=False).ids
    assert tok.backend.decode(ids) == text
    assert [t for t in tok.backend.encode("1234", add_special_tokens=False).tokens] == ["1", "2", "3", "4"]
