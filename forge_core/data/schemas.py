"""Arrow schemas of the tables in a `data` artifact, and builders that fill them column-wise.

| file | one row per | columns |
| --- | --- | --- |
| `sft.parquet` | SFT example | prompt_id, input_ids (prompt + completion + EOS), loss_mask (1 on completion tokens incl. EOS), length, prompt_length, ground_truth (what a verifier checks; SFT validation) |
| `rl_prompts.parquet`, `eval.parquet` | prompt | prompt_id, prompt, prompt_ids, prompt_length, ground_truth, source, source_row, metadata (JSON text) |
| `rejects.parquet` | rejected source row | source, source_row, reason, detail, raw |

Readers (trainer, rollout) pad or pack `input_ids` themselves; `prompt_id` is a content hash of prompt and
ground truth, stable across runs, so rollouts and evaluations can be joined back to their prompts.
"""

from __future__ import annotations

import hashlib
from itertools import chain

import numpy as np
import pyarrow as pa

from forge_core.data.layouts import ExampleBatch
from forge_core.data.rejects import Reject

TOKEN_IDS = pa.list_(pa.int32())

SFT_SCHEMA = pa.schema(
    [
        pa.field("prompt_id", pa.string(), nullable=False),
        pa.field("input_ids", TOKEN_IDS, nullable=False),
        pa.field("loss_mask", pa.list_(pa.int8()), nullable=False),
        pa.field("length", pa.int32(), nullable=False),
        pa.field("prompt_length", pa.int32(), nullable=False),
        pa.field("ground_truth", pa.string(), nullable=False),
    ]
)

PROMPTS_SCHEMA = pa.schema(
    [
        pa.field("prompt_id", pa.string(), nullable=False),
        pa.field("prompt", pa.string(), nullable=False),
        pa.field("prompt_ids", TOKEN_IDS, nullable=False),
        pa.field("prompt_length", pa.int32(), nullable=False),
        pa.field("ground_truth", pa.string(), nullable=False),
        pa.field("source", pa.string(), nullable=False),
        pa.field("source_row", pa.int64(), nullable=False),
        pa.field("metadata", pa.string(), nullable=False),
    ]
)

REJECTS_SCHEMA = pa.schema(
    [
        pa.field("source", pa.string(), nullable=False),
        pa.field("source_row", pa.int64(), nullable=False),
        pa.field("reason", pa.string(), nullable=False),
        pa.field("detail", pa.string(), nullable=False),
        pa.field("raw", pa.string(), nullable=False),
    ]
)

# Split name -> (file in the artifact, schema).
TABLES = {
    "sft": ("sft.parquet", SFT_SCHEMA),
    "rl_prompts": ("rl_prompts.parquet", PROMPTS_SCHEMA),
    "eval": ("eval.parquet", PROMPTS_SCHEMA),
    "rejects": ("rejects.parquet", REJECTS_SCHEMA),
}
TOKENIZER_DIR = "tokenizer"


def prompt_id(prompt: str, ground_truth: str) -> str:
    """16 hex chars of blake2b over prompt and ground truth: the same example gets the same id in every run."""
    return hashlib.blake2b(f"{prompt}\x00{ground_truth}".encode(), digest_size=8).hexdigest()


def _lengths(sequences: list[list[int]]) -> np.ndarray:
    return np.fromiter(map(len, sequences), dtype=np.int32, count=len(sequences))


def _token_lists(sequences: list[list[int]], lengths: np.ndarray) -> pa.ListArray:
    """A list<int32> array built from flat numpy buffers (much faster than pa.array on nested lists)."""
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = np.fromiter(chain.from_iterable(sequences), dtype=np.int32, count=int(offsets[-1]))
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values), type=TOKEN_IDS)


def sft_batch(
    prompt_ids: list[list[int]],
    completion_ids: list[list[int]],
    ids: list[str],
    ground_truths: list[str],
    completion_masks: list[list[int] | None] | None = None,
) -> pa.RecordBatch:
    """SFT rows: input_ids = prompt + completion (already ending with EOS), loss on the completion, or on the
    model's tokens per `completion_masks` (per row, None = all ones) for multi-turn traces."""

    prompt_lengths = _lengths(prompt_ids)
    completion_lengths = _lengths(completion_ids)
    lengths = prompt_lengths + completion_lengths
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    pieces = chain.from_iterable(zip(prompt_ids, completion_ids))
    values = np.fromiter(chain.from_iterable(pieces), dtype=np.int32, count=int(offsets[-1]))
    # Each row's mask is prompt_length zeros then completion_length ones: repeat [0, 1] by those counts.
    counts = np.column_stack([prompt_lengths, completion_lengths]).ravel()
    mask = np.repeat(np.tile(np.array([0, 1], dtype=np.int8), len(lengths)), counts)
    if completion_masks is not None and any(m is not None for m in completion_masks):
        # Multi-turn traces (forge_core.data.traces): loss on the model's turns only, not on observations.
        for row, completion_mask in enumerate(completion_masks):
            if completion_mask is not None:
                start = offsets[row] + prompt_lengths[row]
                mask[start : offsets[row + 1]] = completion_mask
    offsets_array = pa.array(offsets)
    columns = [
        pa.array(ids, type=pa.string()),
        pa.ListArray.from_arrays(offsets_array, pa.array(values), type=TOKEN_IDS),
        pa.ListArray.from_arrays(offsets_array, pa.array(mask), type=pa.list_(pa.int8())),
        pa.array(lengths),
        pa.array(prompt_lengths),
        pa.array(ground_truths, type=pa.string()),
    ]
    return pa.RecordBatch.from_arrays(columns, schema=SFT_SCHEMA)


def prompts_batch(examples: ExampleBatch, prompt_ids: list[list[int]], ids: list[str]) -> pa.RecordBatch:
    lengths = _lengths(prompt_ids)
    columns = [
        pa.array(ids, type=pa.string()),
        pa.array(examples.prompts, type=pa.string()),
        _token_lists(prompt_ids, lengths),
        pa.array(lengths),
        pa.array(examples.ground_truths, type=pa.string()),
        pa.array([examples.source] * len(examples), type=pa.string()),
        pa.array(examples.rows, type=pa.int64()),
        pa.array(examples.metadata, type=pa.string()),
    ]
    return pa.RecordBatch.from_arrays(columns, schema=PROMPTS_SCHEMA)


def rejects_batch(rejects: list[Reject]) -> pa.RecordBatch:
    columns = [
        pa.array([r.source for r in rejects], type=pa.string()),
        pa.array([r.source_row for r in rejects], type=pa.int64()),
        pa.array([r.reason.value for r in rejects], type=pa.string()),
        pa.array([r.detail for r in rejects], type=pa.string()),
        pa.array([r.raw for r in rejects], type=pa.string()),
    ]
    return pa.RecordBatch.from_arrays(columns, schema=REJECTS_SCHEMA)
