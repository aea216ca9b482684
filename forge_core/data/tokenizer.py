"""Tokenizers in Hugging Face format: train a small BPE for the demo or your data, or load an existing one.

An `HFTokenizer` is the `tokenizers` backend plus an HF tokenizer folder's files, which transformers and vLLM load.


    tok = train_demo_tokenizer(texts, vocab_size=64, model_max_length=256, alphabet="0123456789+=")
    tok = load_tokenizer("s3://bucket/tokenizers/mine")     # any folder with tokenizer.json
    tok.save(local_dir)

Training is deterministic: the same texts give a byte-identical `tokenizer.json` in every process.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field

import fsspec
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from forge_core.config.schema import MIN_TEXT_TOKENIZER_VOCAB

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)
# A BPE trained on arbitrary text keeps all 256 byte symbols so nothing is ever untokenizable.
MIN_TEXT_VOCAB = MIN_TEXT_TOKENIZER_VOCAB

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_MAP_FILE = "special_tokens_map.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
# Files of an HF tokenizer folder that we copy; weights and model configs next to them are not ours.
TOKENIZER_FOLDER_FILES = (
    TOKENIZER_FILE,
    CONFIG_FILE,
    SPECIAL_MAP_FILE,
    CHAT_TEMPLATE_FILE,
    "added_tokens.json",
    "generation_config.json",
)


class TokenizerError(ValueError):
    """A tokenizer folder that cannot be used: missing files, no EOS token, unreadable JSON."""


@dataclass(frozen=True)
class SpecialTokens:
    eos: str
    bos: str | None
    pad: str | None


# The special tokens of every BPE that forgeflow trains.
TRAINED_SPECIAL_TOKENS = SpecialTokens(eos=EOS_TOKEN, bos=BOS_TOKEN, pad=PAD_TOKEN)


@dataclass
class HFTokenizer:
    """A `tokenizers.Tokenizer` with its HF folder files; `eos_id` ends every SFT completion."""

    backend: Tokenizer
    eos_token: str
    bos_token: str | None
    pad_token: str | None
    chat_template: str | None
    # File name -> bytes of the HF folder, written verbatim by `save` (byte-identical for the same input).
    files: dict[str, bytes] = field(repr=False)

    @property
    def special_tokens(self) -> SpecialTokens:
        return SpecialTokens(eos=self.eos_token, bos=self.bos_token, pad=self.pad_token)

    @property
    def eos_id(self) -> int:
        return self._token_id(self.eos_token)

    @property
    def bos_id(self) -> int | None:
        return None if self.bos_token is None else self._token_id(self.bos_token)

    @property
    def pad_id(self) -> int | None:
        return None if self.pad_token is None else self._token_id(self.pad_token)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def _token_id(self, token: str) -> int:
        token_id = self.backend.token_to_id(token)
        if token_id is None:
            raise TokenizerError(f"special token {token!r} is not in the tokenizer's vocabulary")
        return token_id

    def save(self, directory: str) -> str:
        """Write the HF tokenizer folder into the local `directory` (created if needed); returns it."""
        os.makedirs(directory, exist_ok=True)
        for name, content in sorted(self.files.items()):
            with open(os.path.join(directory, name), "wb") as f:
                f.write(content)
        return directory

    def with_chat_template(self, template: str) -> HFTokenizer:
        """A copy whose saved folder carries `template` (as `chat_template.jinja`, the only template kept)."""
        files = dict(self.files)
        config = json.loads(files.get(CONFIG_FILE, b"{}"))
        config.pop("chat_template", None)
        files[CONFIG_FILE] = _json_bytes(config)
        files[CHAT_TEMPLATE_FILE] = template.encode("utf-8")
        return HFTokenizer(
            self.backend, self.eos_token, self.bos_token, self.pad_token, template, files
        )


def train_demo_tokenizer(
    texts: Iterable[str], vocab_size: int, model_max_length: int, alphabet: str
) -> HFTokenizer:
    """A small BPE over the characters of `alphabet` (kept even if unseen), with every digit a single token
    (merged digit pairs make arithmetic much harder to learn)."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    symbols = sorted({char for piece, _ in byte_level.pre_tokenize_str(alphabet) for char in piece})
    return _train_bpe(texts, vocab_size, model_max_length, pre_tokenizer, initial_alphabet=symbols)


def train_text_tokenizer(texts: Iterable[str], vocab_size: int, model_max_length: int) -> HFTokenizer:
    """A byte-level BPE (GPT-2 style words, single-digit numbers); TokenizerError below MIN_TEXT_VOCAB."""
    if vocab_size < MIN_TEXT_VOCAB:
        raise TokenizerError(
            f"data.tokenizer.vocab_size={vocab_size}: a byte-level BPE needs >= {MIN_TEXT_VOCAB} "
            "(256 bytes + special tokens); raise it (e.g. 8000) or set data.tokenizer.path"
        )
    pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    return _train_bpe(
        texts, vocab_size, model_max_length, pre_tokenizer, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )


def _train_bpe(
    texts: Iterable[str],
    vocab_size: int,
    model_max_length: int,
    pre_tokenizer: pre_tokenizers.PreTokenizer,
    initial_alphabet: list[str],
) -> HFTokenizer:
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=initial_alphabet,
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer)
    bos_id = backend.token_to_id(BOS_TOKEN)
    # Encoding with special tokens prepends BOS, as transformers and vLLM do for a prompt string.
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A $B", special_tokens=[(BOS_TOKEN, bos_id)]
    )
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
    }
    special_map = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}
    files = {
        TOKENIZER_FILE: backend.to_str(pretty=True).encode("utf-8"),
        CONFIG_FILE: _json_bytes(config),
        SPECIAL_MAP_FILE: _json_bytes(special_map),
    }
    return HFTokenizer(backend, EOS_TOKEN, BOS_TOKEN, PAD_TOKEN, None, files)


def load_tokenizer(uri: str, storage_options: dict | None = None) -> HFTokenizer:
    """Load an HF tokenizer folder from a local path or a storage URI; TokenizerError without a folder,
    a `tokenizer.json` (a fast tokenizer) or an EOS token."""

    fs, root = fsspec.core.url_to_fs(uri, **(storage_options or {}))
    if not fs.isdir(root):
        raise TokenizerError(f"data.tokenizer.path={uri!r}: folder not found; give a folder with tokenizer.json")
    present = {os.path.basename(p.rstrip("/")) for p in fs.ls(root, detail=False)}
    if TOKENIZER_FILE not in present:
        raise TokenizerError(
            f"data.tokenizer.path={uri!r}: no {TOKENIZER_FILE} (found {sorted(present)}); save it as a fast "
            "tokenizer with AutoTokenizer.from_pretrained(path).save_pretrained(path)"
        )
    files = {}
    for name in TOKENIZER_FOLDER_FILES:
        if name in present:
            with fs.open(f"{root.rstrip('/')}/{name}", "rb") as f:
                files[name] = f.read()
    return tokenizer_from_files(files, where=uri)


def tokenizer_from_files(files: dict[str, bytes], where: str) -> HFTokenizer:
    """Build an `HFTokenizer` from the bytes of an HF folder's files; `where` names it in errors."""
    backend = Tokenizer.from_str(files[TOKENIZER_FILE].decode("utf-8"))
    # Raw ids for every text: a saved truncation or padding setting would corrupt lengths and masks.
    backend.no_truncation()
    backend.no_padding()
    config = _read_json(files, CONFIG_FILE, where)
    special_map = _read_json(files, SPECIAL_MAP_FILE, where)
    eos = _special_token(config, special_map, "eos_token")
    if eos is None:
        raise TokenizerError(
            f"tokenizer at {where!r} has no eos_token in {CONFIG_FILE} or {SPECIAL_MAP_FILE}; SFT completions "
            "must end with EOS so generation stops: add \"eos_token\" to tokenizer_config.json"
        )
    template = files[CHAT_TEMPLATE_FILE].decode("utf-8") if CHAT_TEMPLATE_FILE in files else None
    if template is None and isinstance(config.get("chat_template"), str):
        template = config["chat_template"]
    tokenizer = HFTokenizer(
        backend,
        eos,
        _special_token(config, special_map, "bos_token"),
        _special_token(config, special_map, "pad_token"),
        template,
        dict(files),
    )
    for token in filter(None, (tokenizer.eos_token, tokenizer.bos_token, tokenizer.pad_token)):
        if backend.token_to_id(token) is None:
            raise TokenizerError(f"tokenizer at {where!r}: special token {token!r} is not in its vocabulary")
    return tokenizer


def _special_token(config: dict, special_map: dict, name: str) -> str | None:
    value = config.get(name, special_map.get(name))
    if isinstance(value, dict):  # transformers serialises AddedToken as {"content": ..., ...}
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _read_json(files: dict[str, bytes], name: str, where: str) -> dict:
    if name not in files:
        return {}
    try:
        value = json.loads(files[name])
    except ValueError as exc:
        raise TokenizerError(f"tokenizer at {where!r}: {name} is not valid JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise TokenizerError(f"tokenizer at {where!r}: {name} must hold a JSON object")
    return value


def _json_bytes(obj: dict) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")
