"""TitanTrainer in one process (world size 1, CPU): learning, split-invariance of a step, no-grad passes,
the cross-entropy loss, batches, the sampler, and export to an HF folder that transformers loads."""

from __future__ import annotations

import hashlib
import threading

import numpy as np
import pytest
import torch
from sft_helpers import VOCAB, one_intra_op_thread, sft_test_config, tiny_trainer, token_rows  # noqa: F401 (fixture)

from forge_core.losses import ModelOutputs, TokenCrossEntropy
from forge_core.models import forward_logits, token_entropy, token_logprobs, write_hf_folder
from forge_core.storage import ObjectStore
from forge_core.trainers import ArtifactContext, pad_token_rows
from forge_core.trainers.sampler import GlobalBatchSampler

LOSS = TokenCrossEntropy()


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def test_a_step_changes_parameters_and_the_loss_goes_down(tmp_path):
    trainer = tiny_trainer(sft_test_config(tmp_path))
    batch = pad_token_rows(token_rows(8))
    before = trainer.engine.full_state_dict()
    losses = [trainer.train_step(batch.split(4), LOSS)["loss"]]
    after = trainer.engine.full_state_dict()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(changed) == len(before), sorted(set(before) - set(changed))
    losses += [trainer.train_step(batch.split(4), LOSS)["loss"] for _ in range(7)]
    assert losses[-1] < 0.6 * losses[0], losses
    assert trainer.step == 8


def test_gradient_accumulation_1x8_equals_8x1(tmp_path):
    """One micro-batch of 8 rows and 8 micro-batches of 1 row give the same steps (fp32 CPU; tolerance 1e-5
    relative on losses and gradient norms, 1e-5 absolute on the weights after 3 steps)."""
    cfg = sft_test_config(tmp_path)
    rows = token_rows(24, seed=1)
    batches = [pad_token_rows(rows[i : i + 8]) for i in range(0, 24, 8)]
    results = {}
    for micro in (8, 1):
        trainer = tiny_trainer(cfg)
        steps = [trainer.train_step(b.split(micro), LOSS) for b in batches]
        results[micro] = ([(m["loss"], m["grad_norm"]) for m in steps], trainer.engine.full_state_dict())
    (one, w_one), (eight, w_eight) = results[8], results[1]
    rel = max(abs(a - b) / abs(a) for x, y in zip(one, eight) for a, b in zip(x, y))
    weights = max((w_one[k] - w_eight[k]).abs().max().item() for k in w_one)
    print(f"1x8 vs 8x1: max relative diff of loss/grad_norm {rel:.2e}, max weight diff {weights:.2e}")
    assert rel < 1e-5 and weights < 1e-5


def test_one_rank_accumulates_unsharded_and_steps_bitwise_as_reducing_every_micro_batch(tmp_path, monkeypatch):
    """On one rank that casts (one FSDP unit; an fp32 rank trains the plain model) the gradients of a step's
    micro-batches stay in the unsharded model until the last one; the steps equal, bit for bit, those of reducing
    into the sharded gradients after every micro-batch (the sums are added in the same order)."""
    from forge_core.engine import engine as engine_module

    cfg = sft_test_config(tmp_path, "training.mixed_precision=bf16")
    batches = [pad_token_rows(token_rows(12, seed=3 + i)) for i in range(3)]

    def train(trainer) -> tuple[list, dict]:
        steps = [trainer.train_step(b.split(4), LOSS) for b in batches]  # 3 micro-batches a step
        return [(m["loss"], m["grad_norm"]) for m in steps], trainer.engine.full_state_dict()

    deferring = tiny_trainer(cfg)
    assert deferring.engine.accumulates_unsharded
    deferred = train(deferring)
    syncs: list[bool] = []
    original = engine_module.defer_gradient_sync
    monkeypatch.setattr(
        engine_module, "defer_gradient_sync", lambda model, defer: (syncs.append(defer), original(model, defer))
    )
    train(tiny_trainer(cfg))  # the calls of one run: 3 steps of 3 micro-batches, each step ends undeferred
    assert syncs == [True, True, False, False] * 3, syncs
    reducing_trainer = tiny_trainer(cfg)
    reducing_trainer.engine.accumulates_unsharded = False
    reducing = train(reducing_trainer)
    assert deferred[0] == reducing[0]
    assert all(torch.equal(deferred[1][k], reducing[1][k]) for k in reducing[1])


@pytest.mark.parametrize("precision", ["fp32", "bf16"])  # bf16: the model is one FSDP unit that casts
def test_the_output_layer_runs_at_the_loss_positions_alone(tmp_path, precision):
    """The trainer's log-probabilities, entropies and gradients are those of the full logits at the loss positions
    (0 elsewhere), while the output layer takes the N loss positions' hidden states alone."""
    trainer = tiny_trainer(sft_test_config(tmp_path, f"training.mixed_precision={precision}"))
    batch = pad_token_rows(token_rows(6, seed=4))
    mask_BL = batch.loss_mask_BL
    assert 0 < int(mask_BL.sum()) < mask_BL.numel()  # prompt and padding positions too
    rows_in: list[int] = []
    output_layer = trainer.model.lm_head
    handle = output_layer.register_forward_hook(lambda _m, args, _out: rows_in.append(args[0].shape[0]))
    try:
        selected = trainer._model_outputs(batch, with_entropy=True)
    finally:
        handle.remove()
    assert rows_in == [int(mask_BL.sum())]
    (-selected.target_logprobs_BL.sum()).backward()
    def whole(grad: torch.Tensor) -> torch.Tensor:  # an FSDP unit's gradients are DTensors
        return grad.full_tensor() if hasattr(grad, "full_tensor") else grad

    grads = {name: whole(p.grad).detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.model.zero_grad(set_to_none=True)

    full_BLV = trainer.logits(batch.input_ids_BL)
    full_BL = torch.where(mask_BL, token_logprobs(full_BLV, batch.target_ids_BL), 0.0)
    (-full_BL.sum()).backward()
    tolerance = 1e-6 if precision == "fp32" else 1e-2
    assert torch.equal(selected.target_logprobs_BL[~mask_BL], torch.zeros(int((~mask_BL).sum())))
    assert torch.allclose(selected.target_logprobs_BL, full_BL.detach(), atol=tolerance, rtol=0)
    entropy_BL = torch.where(mask_BL, token_entropy(full_BLV.detach()), 0.0)
    assert torch.allclose(selected.entropy_BL, entropy_BL, atol=tolerance, rtol=0)
    for name, p in trainer.model.named_parameters():
        assert torch.allclose(grads[name], whole(p.grad), atol=tolerance, rtol=tolerance), name
    assert torch.equal(trainer.compute_logprobs(batch)[~mask_BL], torch.zeros(int((~mask_BL).sum())))


def test_forward_logits_at_positions_of_padded_rows(tmp_path):
    """Given `pad_to` (a compiled model's length bucket) and `at_BL`, the logits are the unpadded forward's at
    those positions."""
    trainer = tiny_trainer(sft_test_config(tmp_path))
    batch = pad_token_rows(token_rows(5, seed=6))
    model, ids_BL, mask_BL = trainer.model, batch.input_ids_BL, batch.loss_mask_BL
    with torch.no_grad():
        full_BLV = forward_logits(model, ids_BL)
        at_NV = forward_logits(model, ids_BL, pad_to=ids_BL.shape[1] + 7, at_BL=mask_BL)
    assert at_NV.shape == (int(mask_BL.sum()), full_BLV.shape[-1])
    assert torch.allclose(at_NV, full_BLV[mask_BL], atol=1e-5, rtol=0)


def test_evaluate_and_compute_logprobs_leave_the_model_alone(tmp_path):
    trainer = tiny_trainer(sft_test_config(tmp_path))
    batch = pad_token_rows(token_rows(6, seed=2))
    before = trainer.engine.full_state_dict()
    first = trainer.evaluate(batch.split(4), LOSS)
    again = trainer.evaluate(batch.split(2), LOSS)
    logp_BL = trainer.compute_logprobs(batch)
    assert all(torch.equal(v, trainer.engine.full_state_dict()[k]) for k, v in before.items())
    assert first["loss"] == pytest.approx(again["loss"], rel=1e-6)
    expected = -(logp_BL * batch.loss_mask_BL).sum() / batch.loss_mask_BL.sum()
    assert first["loss"] == pytest.approx(expected.item(), rel=1e-6)
    assert first["nll"] == pytest.approx(first["loss"], rel=1e-6)
    assert logp_BL.dtype == torch.float32 and logp_BL.shape == batch.input_ids_BL.shape


def test_cross_entropy_counts_only_completion_tokens():
    batch = pad_token_rows(
        [(np.array([5, 6, 7, 8]), np.array([0, 0, 1, 1])), (np.array([1, 2]), np.array([0, 1]))]
    )
    # Targets: row 0 -> [6, 7, 8] with mask [0, 1, 1]; row 1 -> [2, pad, pad] with mask [1, 0, 0].
    assert batch.loss_mask_BL.tolist() == [[False, True, True], [True, False, False]]
    assert batch.lengths_B.tolist() == [3, 1] and batch.num_tokens() == 4
    logp = torch.tensor([[-9.0, -1.0, -2.0], [-3.0, -9.0, -9.0]])
    out = LOSS(ModelOutputs(logp), batch, global_normalizer=6.0)
    assert LOSS.normalizer(batch) == 3.0
    assert out.loss.item() == pytest.approx(6.0 / 6.0)
    assert LOSS.summarize({k: float(v) for k, v in out.metrics.items()}) == {"nll": 2.0, "loss_tokens": 3.0}
    with pytest.raises(ValueError, match="no completion tokens"):
        LOSS(ModelOutputs(logp), batch, global_normalizer=0.0)


def test_split_keeps_every_per_row_field():
    batch = pad_token_rows(token_rows(5), pad_to_multiple=8)
    assert batch.seq_len % 8 == 0
    parts = batch.split(2)
    assert [p.batch_size for p in parts] == [2, 2, 1]
    assert torch.equal(torch.cat([p.lengths_B for p in parts]), batch.lengths_B)
    assert torch.equal(torch.cat([p.input_ids_BL for p in parts]), batch.input_ids_BL)


def test_sampler_is_rank_independent_and_resumes_from_its_cursor():
    whole = GlobalBatchSampler(num_rows=10, global_batch_size=4, dp_degree=1, dp_rank=0, seed=7)
    ranks = [GlobalBatchSampler(10, 4, dp_degree=2, dp_rank=r, seed=7) for r in (0, 1)]
    for _ in range(6):  # crosses two epoch boundaries
        expected = whole.next_global_rows()
        assert np.array_equal(np.concatenate([s.next_local_rows() for s in ranks]), expected)
    seen = np.concatenate([GlobalBatchSampler(10, 5, 1, 0, seed=1).next_global_rows() for _ in range(1)])
    assert len(set(seen.tolist())) == 5
    cursor = whole.cursor()
    ahead = [whole.next_global_rows() for _ in range(3)]
    restored = GlobalBatchSampler(10, 4, 1, 0, seed=7)
    restored.restore(cursor)
    assert all(np.array_equal(a, restored.next_global_rows()) for a in ahead)
    with pytest.raises(ValueError, match="another dataset/seed"):
        GlobalBatchSampler(11, 4, 1, 0, seed=7).restore(cursor)
    with pytest.raises(ValueError, match="sft.batch_size=5: must be divisible"):
        GlobalBatchSampler(10, 5, dp_degree=2, dp_rank=0, seed=0)


def test_exported_policy_loads_in_transformers_with_the_same_logits(tmp_path):
    import transformers

    cfg = sft_test_config(tmp_path)
    store = ObjectStore.from_config(cfg.storage)
    trainer = tiny_trainer(cfg, artifacts=ArtifactContext(store, "sft", {"x": 1}, {}))
    batch = pad_token_rows(token_rows(4, seed=3))
    trainer.train_step(batch.split(4), LOSS)  # export trained weights, not the init
    uri = store.join(store.artifact_uri("sft", "export"), "policy")
    export = trainer.export_weights(uri, tokenizer_dir=None, metrics={"note": "test"})
    assert export.uri == uri and export.commit_s > 0  # rank 0 wrote and committed it
    reader = store.reader(uri)
    assert reader.manifest.kind == "policy" and reader.manifest.metrics["step"] == 1
    local = reader.download_dir("", tmp_path / "policy")
    # Streamed into the store, the folder is byte for byte the one write_hf_folder writes from the same weights.
    folder = write_hf_folder(
        trainer.engine.full_state_dict(dtype=trainer.engine.export_dtype), cfg.model, VOCAB, tmp_path / "local"
    )
    written = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()}
    assert {rel: entry.sha256 for rel, entry in reader.manifest.files.items()} == written
    assert {"model.safetensors", "config.json"} <= written.keys()
    hf = transformers.AutoModelForCausalLM.from_pretrained(local, dtype=torch.float32).eval()
    ids_BL = torch.randint(0, VOCAB, (3, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = forward_logits(trainer.model, ids_BL).float()
        theirs = hf(ids_BL).logits
    diff = (ours - theirs).abs().max().item()
    print(f"exported policy vs trainer logits: max abs diff {diff:.2e}")
    assert diff < 1e-4


def test_work_alongside_the_export_runs_while_it_writes_and_its_error_waits_for_the_writer(tmp_path):
    """`alongside` (a stage's final checkpoint) runs on the caller's thread while rank 0 writes the export on
    another; its error is the caller's, raised only once the writer has ended, which commits the policy all the
    same (a retried stage finds it committed and writes only its state)."""
    cfg = sft_test_config(tmp_path)
    store = ObjectStore.from_config(cfg.storage)
    trainer = tiny_trainer(cfg, artifacts=ArtifactContext(store, "sft", {"x": 1}, {}))
    seen = []

    def checkpoint_fails(full) -> None:
        seen.append(threading.current_thread() is threading.main_thread())
        assert set(full) == set(trainer.engine.model.state_dict())  # one rank: the weights written
        raise ValueError("the state could not be written")

    uri = store.join(store.artifact_uri("sft", "alongside"), "policy")
    with pytest.raises(ValueError, match="the state could not be written"):
        trainer.export_weights(uri, tokenizer_dir=None, alongside=checkpoint_fails)
    assert seen == [True]
    assert not [t for t in threading.enumerate() if t.name.startswith("forge-export")]  # the writer has ended
    assert store.is_committed(uri)

