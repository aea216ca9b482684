"""Validation-driven SFT (sft.select / select_metric / patience / verifier).

Fast checks in this process: the selection rule, its state round trip, pinned checkpoints surviving retention,
greedy decoding of right-padded prompts, the verifier check and the config errors. One shared real run under
torchrun (2 ranks): on a tiny SFT that overfits 32 rows at a high learning rate, the validation loss falls, then
rises, so its best is mid-way: the run stops early at patience, exports the best step's weights (equal to that
step's checkpoint, which retention kept), and a run SIGKILLed between validations after the best resumes to the
same validations, the same stop and the same weights.
"""

from __future__ import annotations

import json
import math
import subprocess

import pytest
import torch
from sft_helpers import (  # noqa: F401 (fixture)
    VOCAB,
    committed_data_artifact,
    one_intra_op_thread,
    sft_spec,
    sft_test_config,
    tiny_trainer,
)

from forge_core.config import ConfigError, load_config
from forge_core.engine import CheckpointCorrupted, Checkpointer, Engine, committed_checkpoints
from forge_core.engine.checkpoint import ModelState
from forge_core.engine.distributed import DistContext
from forge_core.run.scaffold import run_spec
from forge_core.run.spec import read_spec
from forge_core.storage import ObjectStore
from forge_core.trainers.validation import Selection, greedy_decode
from tests.two_ranks import torchrun_two_ranks

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def _points(losses: list[float], matches: list[float] | None = None, every: int = 10) -> list[dict]:
    matches = matches or [None] * len(losses)
    return [
        {"step": every * (i + 1), "loss": loss, **({"exact_match": m} if m is not None else {})}
        for i, (loss, m) in enumerate(zip(losses, matches))
    ]


# ---- the selection rule ----------------------------------------------------------------------------------------


def test_best_exact_match_mid_way_is_selected_and_ties_go_to_the_lower_loss():
    selection = Selection(select="best", metric="exact_match")
    points = _points([2.0, 1.5, 1.2, 1.4, 1.1], [0.1, 0.5, 0.5, 0.3, 0.5])
    improved = [selection.observe(p) for p in points]
    # 0.5 at step 20, the same 0.5 with a lower loss at step 30, then worse; step 50's 0.5 has a lower loss still.
    assert improved == [True, True, True, False, True]
    assert selection.selected(last_step=50) == (50, "best")
    selection = Selection(select="best", metric="exact_match")
    for p in points[:4]:
        selection.observe(p)
    assert selection.selected(last_step=40) == (30, "best") and selection.since_best == 1


def test_loss_metric_patience_and_last():
    selection = Selection(select="best", metric="loss", patience=2)
    for p in _points([3.0, 2.0, 2.5, 2.1]):
        selection.observe(p)
    assert selection.stop_reason == "patience" and selection.selected(last_step=40) == (20, "early_stop")
    nan_first = Selection(select="best", metric="loss")
    nan_first.observe(_points([math.nan])[0])
    assert nan_first.best_step is None and nan_first.selected(last_step=10) == (10, "last")
    last = Selection(select="last", metric="loss")
    for p in _points([3.0, 2.0, 2.5]):
        last.observe(p)
    assert last.selected(last_step=30) == (30, "last") and last.pinned_step is None and last.best_step == 20


def test_a_target_stops_at_the_first_validation_that_reaches_it():
    selection = Selection(select="best", metric="exact_match", target=0.4)
    for point in _points([2.0, 1.5, 1.2], [0.1, 0.45, 0.6]):
        if not selection.stopped:
            selection.observe(point)
    assert selection.stop_reason == "target" and selection.selected(last_step=20) == (20, "target")
    assert [p["step"] for p in selection.curve] == [10, 20]
    by_loss = Selection(select="best", metric="loss", target=1.0)
    for point in _points([2.0, 1.5, 0.9]):
        by_loss.observe(point)
    assert by_loss.stop_reason == "target" and by_loss.best_step == 30


def test_selection_state_round_trips_through_json_and_continues_identically():
    points = _points([3.0, 2.0, 2.5, 1.9, 2.2, 2.3, 2.4], [0.0, 0.2, 0.2, 0.2, 0.4, 0.3, 0.4])
    straight = Selection(select="best", metric="exact_match", patience=3)
    for p in points:
        straight.observe(p)
    first = Selection(select="best", metric="exact_match", patience=3)
    for p in points[:3]:
        first.observe(p)
    resumed = Selection(select="best", metric="exact_match", patience=3)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    for p in points[3:]:
        resumed.observe(p)
    assert resumed == straight and straight.selected(70) == (50, "best")


# ---- checkpoints: pins outlive retention ---------------------------------------------------------------------


def test_a_pinned_checkpoint_outlives_retention_and_loads_by_step(tmp_path):
    store = ObjectStore(f"file://{tmp_path}/store", keep_checkpoints=1)
    out = store.artifact_uri("sft", "pins")
    world_of_one = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    checkpointer = Checkpointer(store, out, world_of_one, stage="sft", config={}, inputs={})
    model = torch.nn.Linear(4, 3)
    weights = {}
    for step in range(1, 6):
        with torch.no_grad():
            model.weight.add_(1.0)
        weights[step] = model.weight.detach().clone()
        checkpointer.save(step, {"model": ModelState(model)}, {}, pins=[2] if step >= 3 else [])
    assert [c.step for c in committed_checkpoints(store, out)] == [5, 2]
    loaded = torch.nn.Linear(4, 3)
    checkpointer.load_step(2, {"model": ModelState(loaded)})
    assert torch.equal(loaded.weight, weights[2])
    with pytest.raises(CheckpointCorrupted, match=r"step-3 is not committed; delete the stage's output prefix"):
        checkpointer.load_step(3, {"model": ModelState(loaded)})
    checkpointer.save(6, {"model": ModelState(model)}, {})  # pins nothing: step 2 is free to go
    assert [c.step for c in committed_checkpoints(store, out)] == [6]


# ---- greedy decoding and the verifier -----------------------------------------------------------------------


def test_greedy_decode_of_right_padded_prompts_equals_decoding_each_alone(tmp_path):
    trainer = tiny_trainer(sft_test_config(tmp_path))
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, VOCAB, (n,), generator=generator).tolist() for n in (3, 7, 5, 1)]
    eos = 2
    batched = greedy_decode(trainer, prompts, max_new_tokens=6, eos_id=eos, micro_batch_size=3)
    alone = [greedy_decode(trainer, [p], max_new_tokens=6, eos_id=eos, micro_batch_size=1)[0] for p in prompts]
    assert batched == alone
    assert all(len(c) == 6 or c[-1] == eos for c in batched) and trainer.model.training


def test_a_verifier_that_rejects_the_references_fails_before_training(tmp_path):
    cfg = sft_test_config(tmp_path, 'sft.verifier_kwargs={"tag": "result"}')
    spec = read_spec(sft_spec(cfg, committed_data_artifact(cfg), "misfit"))
    with pytest.raises(ValueError, match=r"sft.verifier='exact_answer' with sft.verifier_kwargs=\{'tag': 'result'\} "
                       r"passes only 0% of the reference completions of the 16 validation rows"):
        run_spec(spec)
    assert committed_checkpoints(ObjectStore.from_config(cfg.storage), spec.output_uri) == []


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["sft.select=last", "sft.patience=2"], "sft.patience=2 with sft.select=last"),
        (["sft.eval_rows=0"], "sft.select=best with sft.eval_rows=0: selection needs validation rows"),
        (["sft.verifier=null"], "sft.select_metric=exact_match with sft.verifier=null"),
        (["sft.patience=2", "sft.eval_every=0"], "sft.patience=2 with sft.eval_every=0"),
        (["sft.target=40"], r"sft.target=40.0: an exact-match target is a share in \(0, 1\]"),
    ],
)
def test_selection_settings_that_cannot_work_are_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


# ---- one real run: a peak mid-way, early stop, exact resume after SIGKILL -----------------------------------

PATIENCE, EVAL_EVERY = 3, 2
OVERFIT = [
    # 32 training rows at lr 1e-2: the validation loss bottoms out after ~10 steps and climbs as the model
    # memorises them (measured, world size 1: 2.62, 2.37, 1.69, 1.44, 1.37 at step 10, then 1.58, 1.64, ...).
    "data.demo.num_sft=48",
    "sft.steps=40",
    f"sft.eval_every={EVAL_EVERY}",
    "sft.checkpoint_every=2",
    f"sft.patience={PATIENCE}",
    "sft.select_metric=loss",
    "sft.target=null",  # the demo's default 0.4 would read as a loss target here
    "sft.optimizer.lr=1e-2",
    "sft.optimizer.warmup_steps=0",
    "sft.optimizer.decay=constant",
    "storage.keep_checkpoints=1",
]


def _torchrun(spec_uri: str, env_extra: dict[str, str]) -> subprocess.CompletedProcess:
    return torchrun_two_ranks("-m", "forge_core.run", "sft", "--spec", spec_uri, env=env_extra)


def _engine(cfg, vocab_size: int, init_dir: str | None = None) -> Engine:
    return Engine.Config.from_run_config(cfg, vocab_size, cfg.sft.optimizer, cfg.sft.steps, init_weights_dir=init_dir).build()


@pytest.fixture(scope="module")
def overfit_runs(tmp_path_factory):
    """The uninterrupted run, then a run killed on rank 1 one step after the uninterrupted run's first
    validation past its best (between validations: step best + EVAL_EVERY + 1) and resumed."""
    tmp_path = tmp_path_factory.mktemp("overfit")
    cfg = sft_test_config(tmp_path, *OVERFIT)
    store = ObjectStore.from_config(cfg.storage)
    data_uri = committed_data_artifact(cfg)
    ref = _torchrun(sft_spec(cfg, data_uri, "ref"), {})
    assert ref.returncode == 0, ref.stderr[-3000:]
    ref_uri = store.artifact_uri("sft", "ref")
    best = store.read_manifest(ref_uri).metrics["selected_step"]
    kill_after = best + EVAL_EVERY + 1
    killed_spec = sft_spec(cfg, data_uri, "killed")
    killed = _torchrun(killed_spec, {"FORGE_FAULT": f"kill_rank:1:{kill_after}"})
    assert killed.returncode != 0 and f"kill_rank after step {kill_after}" in killed.stderr, killed.stderr[-3000:]
    killed_uri = store.artifact_uri("sft", "killed")
    checkpoints_after_kill = [c.step for c in committed_checkpoints(store, killed_uri)]
    resumed = _torchrun(killed_spec, {})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return {
        "cfg": cfg,
        "store": store,
        "ref": ref_uri,
        "killed": killed_uri,
        "kill_after": kill_after,
        "checkpoints_after_kill": checkpoints_after_kill,
        "resumed_log": resumed.stderr + resumed.stdout,
    }


@pytest.mark.integration
def test_the_peak_mid_way_is_exported_after_an_early_stop(overfit_runs, tmp_path):
    cfg, store, uri = overfit_runs["cfg"], overfit_runs["store"], overfit_runs["ref"]
    metrics = store.read_manifest(uri).metrics
    curve = metrics["validation"]
    losses = [p["loss"] for p in curve]
    best = curve[losses.index(min(losses))]["step"]
    print(f"validation loss by step: {[(p['step'], round(p['loss'], 3)) for p in curve]}")
    assert metrics["selected_step"] == best and metrics["selected_by"] == "early_stop"
    assert EVAL_EVERY < best < metrics["steps"] < cfg.sft.steps  # a peak mid-way, stopped before the budget
    assert metrics["steps"] == best + PATIENCE * EVAL_EVERY == curve[-1]["step"]
    assert metrics["eval_loss"] == min(losses) and all("exact_match" in p for p in curve)
    assert metrics["verifier_reference_pass"] == 1.0
    # Retention kept the newest checkpoint and, pinned by it, the best; none at the step training ended.
    steps = [c.step for c in committed_checkpoints(store, uri)]
    assert steps == [metrics["steps"] - EVAL_EVERY, best], steps

    policy = store.reader(store.join(uri, "policy")).download_dir("", tmp_path / "policy")
    vocab_size = json.loads((policy / "config.json").read_text())["vocab_size"]
    exported = _engine(cfg, vocab_size, str(policy))
    at_best = _engine(cfg, vocab_size)
    world_of_one = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    Checkpointer(store, uri, world_of_one, stage="sft", config={}, inputs={}).load_step(
        best, {"model": ModelState(at_best.model)}
    )
    expected, got = at_best.full_state_dict(), exported.full_state_dict()
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)
    assert store.read_manifest(store.join(uri, "policy")).metrics["selected_step"] == best


@pytest.mark.integration
def test_a_kill_between_validations_resumes_to_the_same_selection_and_weights(overfit_runs, tmp_path):
    store, ref, killed = overfit_runs["store"], overfit_runs["ref"], overfit_runs["killed"]
    kill_after = overfit_runs["kill_after"]
    # The newest checkpoint before the kill is the validation after the best: its selection state is mid-way.
    assert overfit_runs["checkpoints_after_kill"][0] == kill_after - 1
    assert f"SFT resumes after step {kill_after - 1}" in overfit_runs["resumed_log"]
    ref_metrics, resumed_metrics = store.read_manifest(ref).metrics, store.read_manifest(killed).metrics
    assert resumed_metrics["resumed_from_step"] == kill_after - 1
    for key in ("validation", "selected_step", "selected_by", "steps", "eval_loss", "final_loss"):
        assert resumed_metrics[key] == ref_metrics[key], key
    ref_weights = store.reader(store.join(ref, "policy")).download_dir("", tmp_path / "ref")
    resumed_weights = store.reader(store.join(killed, "policy")).download_dir("", tmp_path / "resumed")
    assert (ref_weights / "model.safetensors").read_bytes() == (resumed_weights / "model.safetensors").read_bytes()
