"""The prepare stage as a library call: source -> tokenizer -> validated, tokenized splits -> one artifact.

    from forge_core.data import prepare_data
    manifest = prepare_data(cfg, output_uri, store)   # cfg.data says what to read; returns the committed manifest

The artifact's tables are those of forge_core.data.schemas plus `tokenizer/`. The source streams in batches
of data.batch_rows rows, so memory stays flat. Identical inputs and config give byte-identical files.
"""

from __future__ import annotations

import json
import logging
import time
import zlib
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass

from forge_core.config import RunConfig, config_to_dict
from forge_core.data import demo, generated
from forge_core.data.layouts import ExampleBatch, Layout, layout_from_config
from forge_core.data.rejects import Reject, RejectCounter, RejectReason, check_reject_share
from forge_core.data.schemas import TABLES, TOKENIZER_DIR, prompt_id, prompts_batch, rejects_batch, sft_batch
from forge_core.data.sources import read_source
from forge_core.data.tokenizer import (
    TRAINED_SPECIAL_TOKENS,
    HFTokenizer,
    load_tokenizer,
    train_demo_tokenizer,
    train_text_tokenizer,
)
from forge_core.data.traces import encode_trace, is_trace
from forge_core.stages import stage_named
from forge_core.storage import Manifest, ObjectStore
from forge_core.storage.uris import split_scheme

log = logging.getLogger(__name__)

DEMO_SOURCE = "demo"
TRAIN_DESTINATIONS = ("sft", "rl_prompts")  # data.rl_reuses_sft: the same rows for SFT and RL
SFT_DESTINATIONS = ("sft",)
RL_DESTINATIONS = ("rl_prompts",)
EVAL_DESTINATIONS = ("eval",)
DEMO_DESTINATIONS = {"sft": ("sft",), "rl": ("rl_prompts",), "eval": ("eval",)}


@dataclass
class Route:
    """Rows of a chunk (distinct indices into its examples, ascending) and the tables they go to."""

    destinations: tuple[str, ...]
    rows: list[int]


@dataclass
class Chunk:
    """Examples tokenized together, the routes of their rows to the tables (in the order they are written),
    plus the rejects and the row count read to produce them. Routes cover every example once; there is at
    least one, which carries `rejects` (see _write_splits)."""

    examples: ExampleBatch
    routes: list[Route]
    rejects: list[Reject]
    rows_read: int


@dataclass
class TokenizedExamples:
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]  # each ends with EOS
    # Per row: the loss mask of a multi-turn trace's completion (forge_core.data.traces); None = all ones.
    completion_masks: list[list[int] | None] | None = None

    def take(self, indices: list[int]) -> TokenizedExamples:
        masks = self.completion_masks
        return TokenizedExamples(
            [self.prompt_ids[i] for i in indices],
            [self.completion_ids[i] for i in indices],
            None if masks is None else [masks[i] for i in indices],
        )


def prepare_data(cfg: RunConfig, output_uri: str, store: ObjectStore) -> Manifest:
    """Run the prepare stage in this process and commit its artifact at `output_uri`.

    Raises DataSourceError / TokenizerError for unusable input and RejectThresholdExceeded when more than
    data.max_reject_fraction of the rows were rejected; nothing is committed then.
    """
    started = time.perf_counter()
    data = cfg.data
    tokenizer, adds_special_tokens, chunks = _open_source(cfg, store)
    writer = store.writer(output_uri, kind="data", stage="prepare")
    for name, content in sorted(tokenizer.files.items()):
        writer.write_bytes(f"{TOKENIZER_DIR}/{name}", content)
    rows, counter = _write_splits(writer, chunks, tokenizer, adds_special_tokens, data.max_seq_len)
    seconds = time.perf_counter() - started
    log.info("prepare %s: wrote rows %s in %.1fs", data.source, rows, seconds)
    if counter.rejected:
        log.warning("prepare %s: %s (see rejects.parquet)", data.source, counter.summary())
    check_reject_share(counter, data.max_reject_fraction, data.source)
    metrics = {
        "rows": rows,
        "rows_read": counter.rows_read,
        "rejects_by_reason": dict(sorted(counter.by_reason.items())),
        "reject_fraction": counter.share(),
        "vocab_size": tokenizer.vocab_size,
        "eos_id": tokenizer.eos_id,
        "bos_id": tokenizer.bos_id,
        "pad_id": tokenizer.pad_id,
        "seconds": seconds,
        "wall_s": seconds,  # the stage body's wall time under the name every stage uses
        "rows_per_s": counter.rows_read / seconds if seconds > 0 else 0.0,
        "splits": split_record(cfg),
    }
    return writer.commit(config=stage_config(cfg), inputs={}, metrics=metrics)


def _open_source(cfg: RunConfig, store: ObjectStore) -> tuple[HFTokenizer, bool, Iterator[Chunk]]:
    """The tokenizer, whether prompts get its special tokens, and the (lazy) chunks of examples."""
    data = cfg.data
    if data.source == DEMO_SOURCE:
        splits = demo.generate_splits(
            data.demo.num_digits, data.demo.num_sft, data.demo.num_rl, data.demo.num_eval, cfg.seed
        )
        tokenizer = _tokenizer(cfg, store, lambda: _demo_texts(splits["sft"]))
        return tokenizer, True, _demo_chunks(splits, data.batch_rows)
    if generated.is_generated(data.source):
        tokenizer = _tokenizer(cfg, store, lambda: generated.generated_texts(cfg))
        return tokenizer, True, _generated_chunks(cfg, data.batch_rows)
    options = storage_options_for(data.source, store)
    tokenizer = _tokenizer(cfg, store, lambda: _source_texts(cfg, options))
    layout = layout_from_config(data, tokenizer.chat_template, tokenizer.special_tokens)
    return tokenizer, layout.adds_special_tokens, _source_chunks(cfg, layout, options)


def _write_splits(writer, chunks: Iterable[Chunk], tokenizer: HFTokenizer, adds_special_tokens: bool,
                  max_seq_len: int) -> tuple[dict[str, int], RejectCounter]:
    """Tokenize every chunk and stream it into the four tables; returns rows per table and reject counts."""
    counter = RejectCounter()
    rows = {split: 0 for split in TABLES}
    with ExitStack() as stack:
        tables = {
            split: stack.enter_context(writer.table_writer(rel, schema)) for split, (rel, schema) in TABLES.items()
        }
        for chunk in chunks:
            counter.rows_read += chunk.rows_read
            # One encode call per column for the whole chunk, then routing: the tokenizer's per-call cost is paid
            # once per chunk, not once per route.
            tokenized = tokenize_examples(chunk.examples, tokenizer, adds_special_tokens)
            too_long = set(_too_long_rows(tokenized, max_seq_len))
            for index, route in enumerate(chunk.routes):
                # Each route writes its rows' rejects before its rows, the chunk's own rejects with the first.
                rejects = chunk.rejects if index == 0 else []
                kept = route.rows
                if too_long:
                    rejects = rejects + [
                        _too_long_reject(chunk.examples, tokenized, i, max_seq_len) for i in kept if i in too_long
                    ]
                    kept = [i for i in kept if i not in too_long]
                counter.add(rejects)
                examples, tokens = _select(chunk.examples, tokenized, kept)
                _write_chunk(tables, rows, examples, tokens, route.destinations, rejects)
    return rows, counter


def stage_config(cfg: RunConfig) -> dict:
    """The config slice recorded in a data artifact's manifest."""
    full = config_to_dict(cfg)
    # The slice of config a data artifact's key is made of.

    return {section: full[section] for section in stage_named("prepare").key_sections}


def storage_options_for(uri: str, store: ObjectStore) -> dict:
    """The store's fsspec options (S3 endpoint) for URIs on the store's own scheme; none for others."""
    return dict(store.storage_options) if split_scheme(uri)[0] == store.scheme else {}


def config_storage_options(uri: str, cfg: RunConfig) -> dict:
    """`storage_options_for` without a store at hand (preflight): the options cfg.storage gives `uri`."""
    if "://" not in uri or uri.startswith("file://"):
        return {}
    return storage_options_for(uri, ObjectStore.from_config(cfg.storage))


# --- tokenizer ---------------------------------------------------------------------------------------------


def _tokenizer(cfg: RunConfig, store: ObjectStore, training_texts: Callable[[], Iterable[str]]) -> HFTokenizer:
    """data.tokenizer.path if set, else a BPE trained on `training_texts()`; plus the configured chat template."""
    settings = cfg.data.tokenizer
    if settings.path is not None:
        tokenizer = load_tokenizer(settings.path, storage_options_for(settings.path, store))
    elif cfg.data.source == DEMO_SOURCE:
        tokenizer = train_demo_tokenizer(training_texts(), settings.vocab_size, cfg.data.max_seq_len, demo.ALPHABET)
    elif cfg.data.source == generated.TOOLS_DEMO_SOURCE:
        tokenizer = train_demo_tokenizer(
            training_texts(), settings.vocab_size, cfg.data.max_seq_len, generated.TOOLS_ALPHABET
        )
    else:
        tokenizer = train_text_tokenizer(training_texts(), settings.vocab_size, cfg.data.max_seq_len)
    if settings.chat_template is not None:
        log.info("saving data.tokenizer.chat_template with the tokenizer (replaces its own template)")
        tokenizer = tokenizer.with_chat_template(settings.chat_template)
    return tokenizer


def _demo_texts(examples: list[demo.AdditionExample]) -> Iterator[str]:
    for example in examples:
        yield example.prompt
        yield example.completion


def _source_texts(cfg: RunConfig, options: dict) -> Iterator[str]:
    """Prompts and completions of the non-eval rows, to train a BPE on (rejects are counted in the main pass)."""
    layout = layout_from_config(cfg.data, cfg.data.tokenizer.chat_template, TRAINED_SPECIAL_TOKENS)
    for chunk in _source_chunks(cfg, layout, options):
        for route in chunk.routes:
            if route.destinations != EVAL_DESTINATIONS:
                for i in route.rows:
                    yield chunk.examples.prompts[i]
                    yield chunk.examples.completions[i]


# --- chunks of examples ------------------------------------------------------------------------------------


def _demo_chunks(splits: dict[str, list[demo.AdditionExample]], batch_rows: int) -> Iterator[Chunk]:
    for split, destinations in DEMO_DESTINATIONS.items():
        examples = splits[split]
        for start in range(0, len(examples), batch_rows):
            batch = ExampleBatch(f"{demo.SOURCE_NAME}/{split}")
            for row, example in enumerate(examples[start:start + batch_rows], start=start):
                metadata = f'{{"a": {example.a}, "b": {example.b}, "num_digits": {example.num_digits}}}'
                batch.append(row, example.prompt, example.completion, example.ground_truth, metadata)
            yield _single_route_chunk(batch, destinations)


def _generated_chunks(cfg: RunConfig, batch_rows: int) -> Iterator[Chunk]:
    for split, batch in generated.generated_batches(cfg, batch_rows):
        yield _single_route_chunk(batch, DEMO_DESTINATIONS[split])


def _single_route_chunk(examples: ExampleBatch, destinations: tuple[str, ...]) -> Chunk:
    return Chunk(examples, [Route(destinations, list(range(len(examples))))], [], len(examples))


def _source_chunks(cfg: RunConfig, layout: Layout, options: dict) -> Iterator[Chunk]:
    data = cfg.data
    assign = SplitAssigner.from_config(cfg)
    for raw in read_source(data.source, data.format, layout.fields, data.batch_rows, options, data.max_line_bytes):
        examples, rejects = layout.to_examples(raw)
        yield Chunk(examples, _split_routes(examples.prompts, assign), raw.rejects + rejects, raw.rows_read)


def _split_routes(prompts: list[str], assign: SplitAssigner) -> list[Route]:
    """Rows grouped by their tables, groups in the order of their first row (which fixes the order of rows and
    row groups in the tables). At least one route, to carry the batch's rejects."""
    by_split: dict[tuple[str, ...], list[int]] = {}
    for i, prompt in enumerate(prompts):
        by_split.setdefault(assign(prompt), []).append(i)
    return [Route(destinations, rows) for destinations, rows in by_split.items()] or [Route(SFT_DESTINATIONS, [])]


def reference_examples(cfg: RunConfig, limit: int = 16) -> ExampleBatch | None:
    """The first `limit` valid examples of data.source as the prepare stage reads them; None for generated
    sources."""
    data = cfg.data
    if data.source == DEMO_SOURCE:
        splits = demo.generate_splits(data.demo.num_digits, limit, 1, 1, cfg.seed)
        return next(_demo_chunks({"sft": splits["sft"], "rl": [], "eval": []}, limit)).examples
    if generated.is_generated(data.source):
        return None
    if data.tokenizer.path is not None:
        tokenizer = load_tokenizer(data.tokenizer.path, config_storage_options(data.tokenizer.path, cfg))
        template, special = data.tokenizer.chat_template or tokenizer.chat_template, tokenizer.special_tokens
    else:
        template, special = data.tokenizer.chat_template, TRAINED_SPECIAL_TOKENS
    layout = layout_from_config(data, template, special)
    for raw in read_source(
        data.source, data.format, layout.fields, limit, config_storage_options(data.source, cfg), data.max_line_bytes
    ):
        examples, _ = layout.to_examples(raw)
        if len(examples):
            return examples
    return ExampleBatch(data.source)


class SplitAssigner:
    """Called with a prompt, returns the tables its row goes to by crc32 of the prompt salted by the seed:
    disjoint, the same for the same seed; with `rl_reuses_sft` every non-eval row goes to sft and rl_prompts."""

    def __init__(self, seed: int, eval_fraction: float, rl_fraction: float, rl_reuses_sft: bool) -> None:
        self._salt = zlib.crc32(f"forgeflow-eval-split:{seed}".encode())
        self._eval_cut = int(eval_fraction * 2**32)
        self._rl_cut = int((eval_fraction + (0.0 if rl_reuses_sft else rl_fraction)) * 2**32)
        self._rl_reuses_sft = rl_reuses_sft

    @classmethod
    def from_config(cls, cfg: RunConfig) -> SplitAssigner:
        return cls(cfg.seed, cfg.data.eval_fraction, cfg.data.rl_fraction, cfg.data.rl_reuses_sft)

    def __call__(self, prompt: str) -> tuple[str, ...]:
        u = zlib.crc32(prompt.encode("utf-8"), self._salt)
        if u < self._eval_cut:
            return EVAL_DESTINATIONS
        if self._rl_reuses_sft:
            return TRAIN_DESTINATIONS
        return RL_DESTINATIONS if u < self._rl_cut else SFT_DESTINATIONS


def split_record(cfg: RunConfig) -> dict:
    """How the rows were split, for the data artifact's manifest."""
    data = cfg.data
    if data.source == DEMO_SOURCE:
        return {"method": "demo task: disjoint operand pairs (data.demo)", "seed": cfg.seed}
    return {
        "method": "crc32 of the prompt salted by the seed (forge_core.data.pipeline.SplitAssigner)",
        "seed": cfg.seed,
        "eval_fraction": data.eval_fraction,
        "rl_fraction": None if data.rl_reuses_sft else data.rl_fraction,
        "rl_reuses_sft": data.rl_reuses_sft,
    }


# --- tokenizing and writing --------------------------------------------------------------------------------


def _encoder(backend) -> Callable:
    # encode_batch_fast (tokenizers >= 0.21) skips computing offsets, which we do not use.
    return getattr(backend, "encode_batch_fast", backend.encode_batch)


def end_with_eos(ids: list[int], eos_id: int) -> list[int]:
    """Completion ids ending in exactly one final EOS: cut after the last EOS already there (generation
    stops there, so a template's trailing text must not be trained on), else append one."""

    if eos_id in ids:
        last = len(ids) - 1 - ids[::-1].index(eos_id)
        return ids[: last + 1]
    ids.append(eos_id)
    return ids


def _encode_completions(
    completions: list[str], encode: Callable, eos_id: int
) -> tuple[list[list[int]], list[list[int] | None]]:
    """Completion ids ending in EOS, and per row the loss mask of a multi-turn trace (None for a plain one)."""
    plain = [end_with_eos(e.ids, eos_id) for e in encode(completions, add_special_tokens=False)]
    masks: list[list[int] | None] = [None] * len(completions)
    for row, completion in enumerate(completions):
        if is_trace(completion):
            plain[row], masks[row] = encode_trace(
                completion,
                lambda segments: [e.ids for e in encode(segments, add_special_tokens=False)],
                lambda ids: end_with_eos(ids, eos_id),
            )
    return plain, masks


def tokenize_examples(examples: ExampleBatch, tokenizer: HFTokenizer, add_special_tokens: bool) -> TokenizedExamples:
    """Tokenize prompts and completions separately (as generation sees them), each column in one encode call."""
    if not len(examples):
        return TokenizedExamples([], [])
    encode = _encoder(tokenizer.backend)
    prompt_ids = [e.ids for e in encode(examples.prompts, add_special_tokens=add_special_tokens)]
    completion_ids, completion_masks = _encode_completions(examples.completions, encode, tokenizer.eos_id)
    return TokenizedExamples(prompt_ids, completion_ids, completion_masks)


def _too_long_rows(tokenized: TokenizedExamples, max_seq_len: int) -> list[int]:
    """Indices of the rows whose prompt and completion together exceed max_seq_len tokens."""
    pairs = zip(tokenized.prompt_ids, tokenized.completion_ids)
    return [i for i, (p, c) in enumerate(pairs) if len(p) + len(c) > max_seq_len]


def _too_long_reject(examples: ExampleBatch, tokenized: TokenizedExamples, i: int, max_seq_len: int) -> Reject:
    length = len(tokenized.prompt_ids[i]) + len(tokenized.completion_ids[i])
    return Reject(
        examples.source,
        examples.rows[i],
        RejectReason.TOO_LONG,
        f"{length} tokens (prompt + completion + EOS) > data.max_seq_len={max_seq_len}",
        json.dumps({"prompt": examples.prompts[i], "completion": examples.completions[i]}, ensure_ascii=False),
    )


def _select(
    examples: ExampleBatch, tokenized: TokenizedExamples, indices: list[int]
) -> tuple[ExampleBatch, TokenizedExamples]:
    """The rows at `indices` (distinct, ascending) of both; the inputs themselves when that is every row."""
    if len(indices) == len(examples):
        return examples, tokenized
    return examples.take(indices), tokenized.take(indices)


def _write_chunk(tables, rows: dict[str, int], examples: ExampleBatch, tokenized: TokenizedExamples,
                 destinations: tuple[str, ...], rejects: list[Reject]) -> None:
    if rejects:
        tables["rejects"].write_batch(rejects_batch(rejects))
        rows["rejects"] += len(rejects)
    if not len(examples):
        return
    ids = [prompt_id(p, g) for p, g in zip(examples.prompts, examples.ground_truths)]
    for split in destinations:
        if split == "sft":
            batch = sft_batch(
                tokenized.prompt_ids, tokenized.completion_ids, ids, examples.ground_truths, tokenized.completion_masks
            )
        else:
            batch = prompts_batch(examples, tokenized.prompt_ids, ids)
        tables[split].write_batch(batch)
        rows[split] += batch.num_rows
