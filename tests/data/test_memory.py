"""Large inputs stream in batches: peak memory of the stage does not grow with the row count.

Each size runs in a fresh subprocess that reports its peak RSS; 1M rows must peak no higher than a 100k-row
run plus the store's bounded upload buffers and 5% allocator noise, which a stage keeping anything per row
would exceed.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from forge_core.data import demo
from forge_core.data.schemas import TABLES
from forge_core.storage.streams import PART_BYTES
from tests.data.test_tokenizer import demo_tokenizer

CHILD = """
import json, resource, sys
from forge_core.config import config_from_dict
from forge_core.data.pipeline import prepare_data
from forge_core.storage import ObjectStore

source, tokenizer, root = sys.argv[1:4]
cfg = config_from_dict({"storage": {"root": root},
                        "data": {"source": source, "tokenizer": {"path": tokenizer}, "batch_rows": 8192}})
store = ObjectStore.from_config(cfg.storage)
manifest = prepare_data(cfg, store.artifact_uri("data", "big"), store)
print(json.dumps({"rows_read": manifest.metrics["rows_read"],
                  "sizes": {rel: entry.size for rel, entry in manifest.files.items()},
                  "peak_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""


def write_rows(path, num_rows: int) -> None:
    examples = demo.generate_splits(3, num_sft=1000, num_rl=0, num_eval=0, seed=0)["sft"]
    lines = [json.dumps({"prompt": e.prompt, "completion": e.completion}) + "\n" for e in examples]
    with open(path, "w") as f:
        for start in range(0, num_rows, len(lines)):
            f.writelines(lines[: min(len(lines), num_rows - start)])


def peak_rss(tmp_path, num_rows: int, tokenizer_dir: str) -> int:
    source = tmp_path / f"rows-{num_rows}.jsonl"
    write_rows(source, num_rows)
    result = subprocess.run(
        [sys.executable, "-c", CHILD, str(source), tokenizer_dir, f"file://{tmp_path}/store-{num_rows}"],
        capture_output=True, text=True, check=True, timeout=900,
    )
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["rows_read"] == num_rows
    return report["peak_rss_kib"]


@pytest.mark.integration
def test_peak_memory_does_not_grow_with_row_count(tmp_path):
    tokenizer_dir = demo_tokenizer().save(str(tmp_path / "tokenizer"))

    small = peak_rss(tmp_path, 100_000, tokenizer_dir)
    large = peak_rss(tmp_path, 1_000_000, tokenizer_dir)

    # The store's upload buffers (up to two 8 MiB parts per table being written) fill only on the large run:
    # they are bounded, so they are allowed for. Keeping ~80 bytes per row would add more than all of this.
    upload_buffers_kib = len(TABLES) * 2 * PART_BYTES // 1024
    assert large <= small * 1.05 + upload_buffers_kib, (small, large)
