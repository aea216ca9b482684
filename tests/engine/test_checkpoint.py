"""DCP checkpoints in the object store, in one process (world size 1): exact resume of model, optimizer,
LR schedule, step, data cursor and RNG; commit by manifest; fallback past a corrupt checkpoint."""

from __future__ import annotations

import os
import random
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from forge_core.config import load_config
from forge_core.engine import (
    CheckpointCorrupted,
    Checkpointer,
    Engine,
    checkpoint_uri,
    committed_checkpoints,
    latest_committed_checkpoint,
    load_components,
    new_gloo_group,
)
from forge_core.engine.checkpoint import BEHIND_NICENESS, ModelState
from forge_core.engine.distributed import DistContext
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


def _stored_path(store: ObjectStore, checkpoint: str, rel: str) -> Path:
    """The local file behind `rel` of a committed checkpoint (under its attempt's prefix)."""
    return Path(store.local_path(store.reader(checkpoint).file_uri(rel)))


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
    shard = _stored_path(store, checkpoint_uri(store, out, 4), "__0_0.distcp")
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # same size, different content
    shard.write_bytes(bytes(data))
    fallback = _trainer(store, out)
    assert fallback.load_checkpoint().step == 2
    assert "step-4 is corrupt" in caplog.text and "__0_0.distcp" in caplog.text
    assert [_step(fallback, b) for b in batches[2:4]] == reference[2:4]

    # Nothing valid left: a clear error naming the file, never a silent restart from step 0.
    shard = _stored_path(store, checkpoint_uri(store, out, 2), ".metadata")
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


def test_only_the_newest_checkpoints_stay_and_resume_uses_the_newest(tmp_path):
    """Retention (storage.keep_checkpoints=2): every save deletes the committed checkpoints beyond the newest
    two, manifest and shards; resume from the newest is still exact."""
    store = ObjectStore(f"file://{tmp_path}/store", keep_checkpoints=2)
    out = store.artifact_uri("sft", "kept")
    batches = _batches(5)
    first = _trainer(store, out)
    for step, batch in enumerate(batches[:3], start=1):
        _step(first, batch)
        first.save_checkpoint(step, {"position": step})
        assert [c.step for c in committed_checkpoints(store, out)] == list(range(step, max(step - 2, 0), -1))
    reference = [_step(first, b) for b in batches[3:]]
    assert store.list_files(checkpoint_uri(store, out, 1)) == {}  # un-committed and gone, shards too
    assert not Path(store.local_path(checkpoint_uri(store, out, 1))).exists()

    resumed = _trainer(store, out)
    assert resumed.load_checkpoint().step == 3
    assert [_step(resumed, b) for b in batches[3:]] == reference


class _AnotherSaveFirst(Stateful):
    """A component whose state is asked for in the middle of a save (while DCP writes the shards): it runs
    another checkpointer's save of the same step to the end first, as a zombie attempt of the stage would."""

    def __init__(self, other_save) -> None:
        self.other_save = other_save

    def state_dict(self) -> dict:
        self.other_save()
        return {"x": torch.zeros(1)}

    def load_state_dict(self, state_dict: dict) -> None:
        pass


def test_a_checkpoint_committed_by_another_attempt_meanwhile_is_kept_and_ours_is_dropped(tmp_path):
    store = ObjectStore(f"file://{tmp_path}/store")
    out = store.artifact_uri("sft", "zombie")
    world_of_one = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    zombie = Checkpointer(store, out, world_of_one, stage="sft", config={}, inputs={})
    ours = Checkpointer(store, out, world_of_one, stage="sft", config={}, inputs={})
    zombie_model = torch.nn.Linear(4, 3)
    interleaved = _AnotherSaveFirst(
        lambda: zombie.save(1, {"model": ModelState(zombie_model)}, {"who": "zombie"})
    )

    ref = ours.save(1, {"model": ModelState(torch.nn.Linear(4, 3)), "zombie": interleaved}, {"who": "us"})

    # The zombie's commit came first: step 1 is its checkpoint (its cursor, below), whole; our shards were
    # removed, not theirs.
    manifest = store.read_manifest(ref.uri)
    assert sorted(store.list_files(ref.uri)) == sorted(
        [store.manifest_uri(ref.uri), *(store.reader(ref.uri).file_uri(rel) for rel in manifest.files)]
    )
    loaded = torch.nn.Linear(4, 3)
    resume = ours.load_latest({"model": ModelState(loaded)})
    assert resume.data_cursor == {"who": "zombie"} and torch.equal(loaded.weight, zombie_model.weight)


def test_an_engine_that_goes_on_trains_as_a_new_one_that_loads_its_optimizer_state(tmp_path):
    """A trainer group's kept engine (`Engine.go_on`) and any other stage's new engine (build, the policy's
    weights, `load_components` of the committed optimizer, `carry_optimizer`) carry AdamW on identically: step
    counts and moments kept, hyperparameters and a new LR schedule from the next stage's config."""
    store = ObjectStore(f"file://{tmp_path}/store")
    batches = _batches(4)
    first = _trainer(store, store.artifact_uri("grpo", "parent"))
    for batch in batches[:3]:
        first.train_step(batch.split(2), TokenCrossEntropy())
    ref = first.save_checkpoint(3, {})
    weights = first.engine.full_state_dict()
    cfg = _cfg()
    next_config = Engine.Config.from_run_config(
        cfg, VOCAB, cfg.sft.optimizer.model_copy(update={"lr": 5e-3}), total_steps=4
    )

    loaded = next_config.build()
    loaded.load_full_state_dict(weights)
    load_components(store, ref, {"optimizer": loaded.optimizers}, loaded.dist)
    loaded.carry_optimizer()
    kept = first.engine.go_on(next_config)
    fresh = next_config.build()  # the same config, a new AdamW
    fresh.load_full_state_dict(weights)

    assert kept.optimizer_steps() == loaded.optimizer_steps() == 3 and fresh.optimizer_steps() == 0
    for engine in (kept, loaded):
        group = engine.optimizers.optimizers[0].param_groups[0]
        assert group["initial_lr"] == 5e-3 and engine.lr == fresh.lr < 5e-3  # the new schedule's first warmup step
    for engine in (kept, loaded, fresh):
        TitanTrainer(engine).train_step(batches[3].split(2), TokenCrossEntropy())
    after_kept, after_loaded, after_fresh = (e.full_state_dict() for e in (kept, loaded, fresh))
    assert all(torch.equal(after_kept[k], after_loaded[k]) for k in after_kept)
    assert any(not torch.equal(after_kept[k], after_fresh[k]) for k in after_kept)  # the carried moments counted


def test_an_optimizer_state_saved_behind_is_the_live_state_written_at_low_priority_and_goes_on_as_one_in_line(
    tmp_path, monkeypatch
):
    """`save_optimizer_state_behind` takes the state when called and writes it on a thread of its own, on a process
    group of its own, at BEHIND_NICENESS lower priority: the AdamW moments are the live tensors (no copy), the RNG
    streams, step and cursor are values of the call, so draws made while it is written do not reach it, and the
    weights are not written (the stage's export holds them). Reading the weights meanwhile (as the weight push
    does) is allowed. A next engine built from the weights goes on with it exactly as with the same state saved in
    line; it resumes no stage."""
    store = ObjectStore(f"file://{tmp_path}/store")
    batches = _batches(4)
    behind, inline = (_trainer(store, store.artifact_uri("grpo", name)) for name in ("behind", "inline"))
    for trainer in (behind, inline):
        for batch in batches[:2]:
            _step(trainer, batch)
    inline_ref = inline.save_checkpoint(2, {"at": 2})
    start_writing = threading.Event()
    write = Checkpointer._write
    writes = []

    def held_write(self, ref, attempt, state, group):
        writes.append((_thread_niceness(), state))
        start_writing.wait()
        return write(self, ref, attempt, state, group)

    monkeypatch.setattr(Checkpointer, "_write", held_write)
    caller_niceness = _thread_niceness()
    pending = behind.save_optimizer_state_behind(2, {"at": 2}, new_gloo_group())
    pending.start()
    random.random(), np.random.rand(), torch.rand(())  # every RNG moves on before the write starts
    weights = behind.engine.full_state_dict()
    start_writing.set()
    ref = pending.wait()
    assert ref.step == 2 and store.read_manifest(ref.uri).metrics["write_s"] > 0
    [(write_niceness, written)] = writes
    # The write yields the CPU to what runs beside it; the caller's thread keeps its priority.
    assert write_niceness == min(19, caller_niceness + BEHIND_NICENESS)
    assert _thread_niceness() == caller_niceness
    assert "model" not in written and {"optimizer", "lr_scheduler", "train_state", "rng"} <= written.keys()
    live = {
        _storage(value)
        for state in behind.engine.optimizers.optimizers[0].state.values()
        for value in state.values()
        if torch.is_tensor(value) and value.numel() > 1
    }
    moments = [value for value in _tensors(written["optimizer"]) if value.numel() > 1]
    assert moments and all(_storage(value) in live for value in moments)  # the moments, not a copy

    went_on = []
    for saved in (ref, inline_ref):
        trainer = _trainer(store, store.artifact_uri("grpo", "next"))
        trainer.engine.load_full_state_dict(weights)
        load_components(store, saved, {"optimizer": trainer.engine.optimizers}, trainer.engine.dist)
        trainer.engine.carry_optimizer()
        loss = trainer.train_step(batches[3].split(2), TokenCrossEntropy())["loss"]
        went_on.append((loss, trainer.engine.full_state_dict()))
    (loss_behind, weights_behind), (loss_inline, weights_inline) = went_on
    assert loss_behind == loss_inline
    assert all(torch.equal(weights_behind[k], weights_inline[k]) for k in weights_inline)
    with pytest.raises(ValueError, match=r"holds no model state .*resumes no stage"):
        _trainer(store, store.artifact_uri("grpo", "behind")).load_checkpoint()
    assert _trainer(store, store.artifact_uri("grpo", "inline")).load_checkpoint().step == 2


def _tensors(value) -> list[torch.Tensor]:
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors(item)]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


def _storage(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.untyped_storage().data_ptr()


def _thread_niceness() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def _layout_cfg(*overrides: str):
    return load_config(None, ["training.device=cpu", "seed=5", *overrides])


def _master_state(engine: Engine) -> dict[str, torch.Tensor]:
    """Every fp32 master weight and AdamW moment, whole, by parameter name."""
    optimizer = engine.optimizers.optimizers[0]
    out = dict(engine.full_state_dict())
    for name, param in engine.model.named_parameters():
        for moment in ("exp_avg", "exp_avg_sq"):
            value = optimizer.state[param][moment]
            out[f"{name}.{moment}"] = value.full_tensor() if isinstance(value, DTensor) else value
    return out


def test_one_fp32_rank_trains_the_plain_model_and_resumes_from_and_into_an_fsdp_unit_bitwise(tmp_path):
    """A single fp32 rank trains the plain module (nothing to shard or cast); one that casts (bf16) wraps it in
    one FSDP unit. A checkpoint of either resumes the other with every master weight and AdamW moment as saved."""
    from torch.distributed.fsdp import FSDPModule

    store = ObjectStore(f"file://{tmp_path}/store")
    batches = _batches(2)

    def trainer(output: str, *overrides: str) -> TitanTrainer:
        cfg = _layout_cfg(*overrides)
        engine = Engine.Config.from_run_config(cfg, VOCAB, cfg.sft.optimizer, total_steps=6).build()
        uri = store.artifact_uri("sft", output)
        return TitanTrainer(engine, checkpointer=Checkpointer(store, uri, engine.dist, stage="test", config={}, inputs={}))

    plain, unit = trainer("plain"), trainer("unit", "training.mixed_precision=bf16")
    assert not any(isinstance(m, FSDPModule) for m in plain.engine.model.modules())
    assert not any(isinstance(p, DTensor) for p in plain.engine.model.parameters())
    assert isinstance(unit.engine.model, FSDPModule) and unit.engine.accumulates_unsharded
    assert all(isinstance(p, DTensor) for p in unit.engine.model.parameters())
    for source, target_overrides in ((plain, ["training.mixed_precision=bf16"]), (unit, [])):
        source.train_step(batches[0].split(2), TokenCrossEntropy())
        source.save_checkpoint(1, {})
        saved = _master_state(source.engine)
        target = trainer("plain" if source is plain else "unit", *target_overrides)
        assert target.load_checkpoint().step == 1
        resumed = _master_state(target.engine)
        assert saved.keys() == resumed.keys()
        assert [k for k in saved if not torch.equal(saved[k], resumed[k])] == []
