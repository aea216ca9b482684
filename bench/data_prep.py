"""Benchmark: rows/s of the prepare stage vs raw `tokenizers` batch encoding of the same texts.

    python -m bench.data_prep            # writes bench/results/data_prep.json, prints it last

Ours: `prepare_data` end to end on a JSONL file (read, validate, split, tokenize, write four Parquet tables
through the artifact writer, commit). Baseline: `encode_batch_fast` of the same prompts (with special
tokens) and completions, in the same batches, plus taking `.ids` from each encoding (what any consumer must
do). Target: the stage's validation and Arrow writing cost at most 20% (ratio >= 0.8).

Workloads: `gsm8k_like` (the headline: question/answer rows of ~50/~100 tokens, a byte-level BPE of 8k)
and, in details, `demo_short` (the demo task's ~17-token rows, where fixed per-row costs weigh most).
"""

from __future__ import annotations

import json
import random
import tempfile
import uuid
from pathlib import Path

from bench.harness import alternate, median, summarize, write_result
from forge_core.config import config_from_dict
from forge_core.data import demo
from forge_core.data.pipeline import prepare_data
from forge_core.data.tokenizer import load_tokenizer, train_demo_tokenizer, train_text_tokenizer
from forge_core.storage import ObjectStore

WORDS = ["apples", "boxes", "dollars", "hours", "miles", "pages", "marbles", "cookies", "tickets", "students", "books", "friends", "each", "more", "less", "than", "twice", "half", "total", "left", "spent", "bought", "sold", "gave", "found", "has", "had", "will", "would", "how", "many", "much", "does", "did", "the", "a", "of", "to", "and", "in", "for", "with", "per", "day", "week", "after", "before", "every", "remaining", "costs", "earns", "reads", "walks"]


def gsm8k_like_rows(num_rows: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)

    def sentence(length: int) -> str:
        return " ".join(rng.choice(WORDS) if rng.random() < 0.8 else str(rng.randrange(1000)) for _ in range(length))

    rows = []
    for _ in range(num_rows):
        answer = rng.randrange(10000)
        rows.append({
            "prompt": sentence(rng.randrange(30, 60)).capitalize() + "?",
            "completion": ". ".join(sentence(rng.randrange(8, 20)) for _ in range(5)) + f". #### {answer}",
        })
    return rows


def demo_short_rows(num_rows: int) -> list[dict]:
    examples = demo.generate_splits(3, num_sft=num_rows, num_rl=0, num_eval=0, seed=0)["sft"]
    return [{"prompt": e.prompt, "completion": e.completion} for e in examples]


class Workload:
    """A JSONL source on disk, its tokenizer folder, and the two timed sides."""

    def __init__(self, name: str, rows: list[dict], tokenizer, workdir: Path, batch_rows: int) -> None:
        self.name = name
        self.rows = len(rows)
        self.source = workdir / f"{name}.jsonl"
        self.source.write_text("".join(json.dumps(r) + "\n" for r in rows))
        self.tokenizer_dir = tokenizer.save(str(workdir / f"{name}-tokenizer"))
        self.store = ObjectStore(f"file://{workdir}/store-{name}")
        self.cfg = config_from_dict({
            "storage": {"root": self.store.root},
            "model": {"max_seq_len": 512},
            "data": {"source": str(self.source), "tokenizer": {"path": self.tokenizer_dir}, "batch_rows": batch_rows,
                     "max_seq_len": 512, "max_reject_fraction": 0.0},
        })
        self.backend = load_tokenizer(self.tokenizer_dir).backend
        self.batches = [
            ([r["prompt"] for r in rows[i:i + batch_rows]], [r["completion"] for r in rows[i:i + batch_rows]])
            for i in range(0, len(rows), batch_rows)
        ]
        self.tokens = 0

    def run_stage(self) -> None:
        manifest = prepare_data(self.cfg, self.store.artifact_uri("data", uuid.uuid4().hex), self.store)
        assert manifest.metrics["rows_read"] == self.rows and manifest.metrics["rows"]["rejects"] == 0

    def run_encode(self) -> None:
        tokens = 0
        for prompts, completions in self.batches:
            for encodings in (self.backend.encode_batch_fast(prompts),
                              self.backend.encode_batch_fast(completions, add_special_tokens=False)):
                tokens += sum(len(e.ids) for e in encodings)
        self.tokens = tokens

    def run_encode_without_ids(self) -> None:
        for prompts, completions in self.batches:
            self.backend.encode_batch_fast(prompts)
            self.backend.encode_batch_fast(completions, add_special_tokens=False)

    def measure(self, repeats: int) -> dict:
        stage_s, encode_s = alternate(self.run_stage, self.run_encode, warmup=1, repeats=repeats)
        _, encode_only_s = alternate(self.run_stage, self.run_encode_without_ids, warmup=0, repeats=1)
        return {
            "rows": self.rows,
            "tokens_per_row": self.tokens / self.rows,
            "stage_rows_per_s": self.rows / median(stage_s),
            "encode_rows_per_s": self.rows / median(encode_s),
            "ratio": median(encode_s) / median(stage_s),
            "encode_without_ids_rows_per_s": self.rows / median(encode_only_s),
            "stage_s": summarize(stage_s),
            "encode_s": summarize(encode_s),
        }


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        gsm_rows = gsm8k_like_rows(4_000)
        gsm_tokenizer = train_text_tokenizer(
            (t for r in gsm_rows[:2000] for t in (r["prompt"], r["completion"])), 8000, 256
        )
        gsm = Workload("gsm8k_like", gsm_rows, gsm_tokenizer, workdir, batch_rows=1024)
        short_rows = demo_short_rows(30_000)
        short_tokenizer = train_demo_tokenizer(
            (t for r in short_rows[:1000] for t in (r["prompt"], r["completion"])), 64, 64, demo.ALPHABET
        )
        short = Workload("demo_short", short_rows, short_tokenizer, workdir, batch_rows=8192)

        headline = gsm.measure(repeats=5)
        details = {"gsm8k_like": headline, "demo_short": short.measure(repeats=3),
                   "baseline": "encode_batch_fast of prompts + completions and .ids, same batches, same process"}
    write_result(
        "data_prep",
        value=headline["stage_rows_per_s"],
        baseline=headline["encode_rows_per_s"],
        target=">=0.8",
        unit="rows/s",
        details=details,
    )


if __name__ == "__main__":
    main()
