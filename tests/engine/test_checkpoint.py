"""DCP checkpoints in the object store, in one process (world size 1): exact resume of model, optimizer,
LR schedule, step, data cursor and RNG; commit by manifest; fallback past a corrupt checkpoint."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from forge_core.config import load_config
from forge_core.engine import (
    CheckpointCorrupted,
    Checkpointer,
    Engine,
    checkpoint_uri,
    committed_checkpoints,
    latest_committed_checkpoint,
)
from forge_core.losses import TokenCrossEntropy
from forge_core.storage import ObjectStore
from forge_core.trainers import TitanTrainer, pad_token_rows

VOCAB = 40


def _cfg():
    # Warmup + cosine, so a resumed run is wrong unless the LR schedule resumes too.
    return load_config(
        None,
        ["training.device=cpu", "sft.optimizer.warmup_steps=2", "sft.optimizer.decay=cosine", "seed=5"],
    )


def _batches(n: int):
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        rows = []
        for _ in range(4):
            length = int(rng.integers(6, 12))
            mask = np.zeros(length, np.int8)
            mask[length // 2 :] = 1
            rows.append((rng.integers(1, VOCAB, length), mask))
        out.append(pad_token_rows(rows))
    return out


def _trainer(store: ObjectStore, output_uri: str) -> TitanTrainer:
    cfg = _cfg()
    engine = Engine.Config.from_run_config(cfg, VOCAB, cfg.sft.optimizer, total_steps=6).build()
    checkpointer = Checkpointer(store, output_uri, engine.dist, stage="test", config={}, inputs={})
    return TitanTrainer(engine, checkpointer=checkpointer)


def _step(trainer: TitanTrainer, batch) -> float:
    # Draw from every RNG the checkpoint must restore, and fold the draws into the result.
    noise = random.random() + np.random.rand() + torch.rand(()).item()
    return trainer.train_step(batch.split(2), TokenCrossEntropy())["loss"] + noise


def test_resume_is_exact_and_corrupt_checkpoints_are_skipped(tmp_path, caplog):
    store = ObjectStore(f"file://{tmp_path}/store")
    out = store.artifact_uri("sft", "run")
    batches = _batches(6)

    first = _trainer(store, out)
    reference = [_step(first, b) for b in batches[:2]]
    first.save_checkpoint(2, {"position": 2})
    reference += [_step(first, b) for b in batches[2:4]]
    first.save_checkpoint(4, {"position": 4})
    reference += [_step(first, b) for b in batches[4:]]
    final_weights = first.engine.full_state_dict()
    assert latest_committed_checkpoint(store, out).step == 4

    # A crashed save leaves files but no manifest: invisible.
    store.put_bytes(store.join(checkpoint_uri(store, out, 5), "__0_0.distcp"), b"partial")
    assert latest_committed_checkpoint(store, out).step == 4

    resumed = _trainer(store, out)
    state = resumed.load_checkpoint()
    assert (state.step, state.data_cursor, resumed.step) == (4, {"position": 4}, 4)
    assert [_step(resumed, b) for b in batches[4:]] == reference[4:]
    for key, value in resumed.engine.full_state_dict().items():
        assert torch.equal(value, final_weights[key]), key

    # Corrupt step 4: resume falls back to step 2 and says why.
    shard = tmp_path / "store/sft/run/_checkpoints/step-4/__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # same size, different content
    shard.write_bytes(bytes(data))
    fallback = _trainer(store, out)
    assert fallback.load_checkpoint().step == 2
    assert "step-4 is corrupt" in caplog.text and "__0_0.distcp" in caplog.text
    assert [_step(fallback, b) for b in batches[2:4]] == reference[2:4]

    # Nothing valid left: a clear error naming the file, never a silent restart from step 0.
    shard = tmp_path / "store/sft/run/_checkpoints/step-2/.metadata"
    shard.write_bytes(b"garbage")
    with pytest.raises(CheckpointCorrupted, match=r"step-2: file '.metadata' is corrupted"):
        _trainer(store, out).load_checkpoint()


@pytest.mark.integration
def test_checkpoint_round_trip_through_s3(s3_store):
    """DCP writes through fsspec/s3fs into moto's S3, the manifest commits it, and a new engine resumes."""
    out = s3_store.artifact_uri("sft", "s3run")
    batches = _batches(3)
    first = _trainer(s3_store, out)
    _step(first, batches[0])
    first.save_checkpoint(1, {"position": 1})
    expected = [_step(first, b) for b in batches[1:]]
    assert [c.step for c in committed_checkpoints(s3_store, out)] == [1]
    assert s3_store.read_manifest(checkpoint_uri(s3_store, out, 1)).kind == "checkpoint"
    resumed = _trainer(s3_store, out)
    assert resumed.load_checkpoint().step == 1
    assert [_step(resumed, b) for b in batches[1:]] == expected
