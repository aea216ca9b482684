"""GRPOTrainer in one process (world size 1, the real torchtitan engine): the first step on a
rollout batch is on-policy (ratio exactly 1) and its gradient is the REINFORCE-with-baseline gradient computed
independently from the unpadded rollout rows; rollout rows become correctly aligned batches."""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa
import pytest
import torch
from grpo_helpers import (
    MAX_NEW,
    demo_tokenizer,
    grpo_test_config,
    intra_op_threads,
    plain_policy,
    rollout_table,
)
from torch.distributed.tensor import DTensor

from forge_core.batch import RLBatch, pad_token_rows
from forge_core.engine import Engine, destroy_distributed
from forge_core.losses.grpo import build_policy_loss
from forge_core.models import model_logprobs
from forge_core.trainers.grpo import GRPOTrainer, rollouts_to_rl_batch, summarize_steps

ADV_EPS = 1e-6


@pytest.fixture
def distributed_cleanup():
    with intra_op_threads(1):
        yield
    destroy_distributed()


def _group_advantages(table: pa.Table) -> dict[int, float]:
    """GRPO advantages by hand: (r - group mean) / (sample std + eps); zero-variance groups are dropped."""
    rewards = table.column("reward").to_pylist()
    groups = table.column("group_id").to_pylist()
    advantages = {}
    for g in set(groups):
        idx = [i for i, gi in enumerate(groups) if gi == g]
        r = torch.tensor([rewards[i] for i in idx], dtype=torch.float64)
        if r.max() == r.min():
            continue
        adv = (r - r.mean()) / (r.std(correction=1) + ADV_EPS)
        advantages.update({i: float(a) for i, a in zip(idx, adv)})
    return advantages


def _reinforce_gradient(model: torch.nn.Module, table: pa.Table) -> dict[str, torch.Tensor]:
    """Gradient of -sum_i A_i sum_t log pi(y_it) / (response tokens of kept rows), one unpadded row at a time."""
    advantages = _group_advantages(table)
    prompts, responses = table.column("prompt_ids").to_pylist(), table.column("response_ids").to_pylist()
    tokens_total = sum(len(responses[i]) for i in advantages)
    model.zero_grad()
    for i, adv in advantages.items():
        tokens = torch.tensor([prompts[i] + responses[i]])
        logprobs = model_logprobs(model, tokens[:, :-1], tokens[:, 1:])[0, len(prompts[i]) - 1 :]
        (-adv * logprobs.sum() / tokens_total).backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: gathered from an FSDP unit's shards, as is from the plain model of one fp32 rank."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _capture_gradients(engine: Engine) -> list[dict[str, torch.Tensor]]:
    """Full gradients as the optimizer sees them, once per step (a hook before AdamW's update)."""
    captured: list[dict[str, torch.Tensor]] = []

    def hook(optimizer, args, kwargs):
        # Looked up at step time: FSDP swaps the registered parameter objects around a no-grad forward.
        names = {id(p): name for name, p in engine.model.named_parameters()}
        captured.append({
            names[id(p)]: _whole(p.grad).detach().clone()
            for group in optimizer.param_groups for p in group["params"] if p.grad is not None
        })

    engine.optimizers.optimizers[0].register_step_pre_hook(hook)
    return captured


def _as_trainer_logprobs(trainer: GRPOTrainer, batch: RLBatch, seed: int) -> RLBatch:
    """The batch whose generator logprobs are the trainer's own on the first step's micro-batches, so trainer
    and generator agree bit for bit."""
    generator = batch.generator_logprobs_BL.clone()
    step = trainer.plan(batch.batch_size, seed)[0]
    for rows, micro in zip(trainer.micro_batch_rows(batch, step), trainer.micro_batches(batch, step)):
        width = micro.seq_len
        trainer_BL = trainer.compute_logprobs(micro).cpu()
        generator[rows, :width] = torch.where(micro.response_mask_BL, trainer_BL, generator[rows, :width])
    return dataclasses.replace(batch, generator_logprobs_BL=generator)


def test_first_step_is_on_policy_reinforce_with_baseline(tmp_path, distributed_cleanup):
    cfg = grpo_test_config(
        tmp_path, "grpo.epochs=1", "grpo.mini_batch_size=32", "grpo.micro_batch_size=8", "grpo.optimizer.grad_clip=0"
    )
    tokenizer = demo_tokenizer(tmp_path)
    vocab = tokenizer.vocab_size
    policy = plain_policy(cfg, vocab, seed=3)
    table = rollout_table(policy, tokenizer, "file:///policy")
    rollouts = rollouts_to_rl_batch(table, cfg.grpo.advantage)

    engine = Engine.Config.from_run_config(cfg, vocab, cfg.grpo.optimizer, total_steps=1).build()
    engine.load_full_state_dict(policy.state_dict())
    trainer = GRPOTrainer(engine, cfg.grpo, build_policy_loss(cfg.grpo.loss, MAX_NEW))
    batch = _as_trainer_logprobs(trainer, rollouts.batch, seed=11)
    gradients = _capture_gradients(engine)
    history = trainer.fit(batch, seed=11)

    first = history[0]
    assert len(history) == 1 and trainer.step == 1
    assert first["policy/ratio_mean"] == 1.0 and first["policy/ratio_max"] == 1.0
    assert first["policy/clip_low_frac"] == 0.0 and first["policy/clip_high_frac"] == 0.0
    assert first["policy/logprob_gap_max"] == 0.0
    assert summarize_steps(history)["generator_gap/max"] == 0.0

    expected = _reinforce_gradient(policy, table)
    got = gradients[0]
    assert set(got) == set(expected)
    total = torch.sqrt(sum(g.square().sum() for g in expected.values()))
    assert total > 1e-3, "the test batch must carry a real policy gradient"
    for name, grad in expected.items():
        # fp32 with different batching (padded micro-batches vs one row at a time): measured max |diff|
        # 2.2e-8 for gradients up to 7e-2; the tolerance leaves ~20x slack.
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=5e-7, msg=name)


def test_rollout_rows_align_with_targets(tmp_path):
    cfg = grpo_test_config(tmp_path, "grpo.advantage.mask_truncated=true")
    table = pa.table({
        "prompt_ids": [[5, 6, 7], [5, 6]],
        "response_ids": [[8, 9], [10, 11, 12]],
        "response_logprobs": [[-0.5, -0.25], [-1.0, -2.0, -3.0]],
        "group_id": ["g", "g"],
        "reward": [1.0, 0.0],
        "finish_reason": ["stop", "length"],
    })
    rollouts = rollouts_to_rl_batch(table, cfg.grpo.advantage, pad_id=0)
    b = rollouts.batch
    assert b.input_ids_BL.tolist() == [[5, 6, 7, 8], [5, 6, 10, 11]]
    assert b.target_ids_BL.tolist() == [[6, 7, 8, 9], [6, 10, 11, 12]]
    # Row 1 hit max_new_tokens: masked out of the loss (mask_truncated) but still in its group's baseline.
    assert b.response_mask_BL.tolist() == [[False, False, True, True], [False, False, False, False]]
    assert b.generator_logprobs_BL[0, 2:].tolist() == [-0.5, -0.25]
    assert b.generator_logprobs_BL[1, 1:].tolist() == [-1.0, -2.0, -3.0]
    assert b.advantages_B[0] > 0 and b.advantages_B[1] == 0
    assert rollouts.stats["advantage/truncated_frac"] == 0.5


@pytest.mark.parametrize("multi_turn", [False, True], ids=["single-turn", "multi-turn"])
def test_a_rollout_batch_is_its_rows_padded_one_by_one(tmp_path, multi_turn):
    """The batch built from the table's columns at once equals, bitwise, its rows padded one by one
    (pad_token_rows, the SFT path): ragged prompts and responses over several Arrow chunks, an episode's mask."""
    cfg = grpo_test_config(tmp_path, "grpo.advantage.drop_zero_variance_groups=false")
    rng = np.random.default_rng(5)
    rows = []
    for k in range(13):
        prompt, response = rng.integers(1, 50, rng.integers(1, 9)), rng.integers(1, 50, rng.integers(1, 7))
        rows.append({
            "prompt_ids": prompt.tolist(), "response_ids": response.tolist(),
            "response_logprobs": (-rng.random(len(response))).tolist(), "group_id": f"g{k % 4}",
            "reward": float(rng.random()), "finish_reason": "stop",
            **({"response_mask": (rng.random(len(response)) < 0.6).tolist()} if multi_turn else {}),
        })
    table = pa.concat_tables([pa.Table.from_pylist(rows[:6]), pa.Table.from_pylist(rows[6:])])
    assert table.column("prompt_ids").num_chunks == 2
    batch = rollouts_to_rl_batch(table, cfg.grpo.advantage, pad_id=0).batch

    padded = pad_token_rows([
        (np.array(r["prompt_ids"] + r["response_ids"]),
         np.array([False] * len(r["prompt_ids"]) + (r["response_mask"] if multi_turn else [True] * len(r["response_ids"]))))
        for r in rows
    ], pad_id=0)  # fmt: skip
    generator_BL = torch.zeros(padded.input_ids_BL.shape)
    for i, r in enumerate(rows):
        start = len(r["prompt_ids"]) - 1
        generator_BL[i, start : start + len(r["response_ids"])] = torch.tensor(r["response_logprobs"])
    for name in ("input_ids_BL", "target_ids_BL", "loss_mask_BL", "lengths_B"):
        assert torch.equal(getattr(batch, name), getattr(padded, name)), name
    assert torch.equal(batch.generator_logprobs_BL, generator_BL)
    if multi_turn:  # the episode's mask left some response tokens out of the loss
        assert 0 < batch.loss_mask_BL.sum() < sum(len(r["response_ids"]) for r in rows)


@pytest.mark.parametrize(
    ("column", "values", "message"),
    [
        ("response_logprobs", [[-0.5]], "1 logprobs"),
        ("response_ids", [[]], "empty prompt or response"),
    ],
)
def test_bad_rollout_rows_name_the_problem(tmp_path, column, values, message):
    cfg = grpo_test_config(tmp_path)
    columns = {
        "prompt_ids": [[5, 6]], "response_ids": [[8, 9]], "response_logprobs": [[-0.5, -0.5]],
        "group_id": [0], "reward": [1.0], "finish_reason": ["stop"],
    }
    columns[column] = values
    with pytest.raises(ValueError, match=message):
        rollouts_to_rl_batch(pa.table(columns), cfg.grpo.advantage, source="s3://b/rollouts/x/rollouts.parquet")
    with pytest.raises(ValueError, match="missing columns \\['reward'\\]"):
        rollouts_to_rl_batch(pa.table({k: v for k, v in columns.items() if k != "reward"}), cfg.grpo.advantage)


def test_grpo_trains_on_the_rows_dynamic_sampling_kept(tmp_path):
    cfg = grpo_test_config(tmp_path)
    table = pa.table({
        "prompt_ids": [[5, 6], [5, 6], [7, 8], [7, 8]],
        "response_ids": [[8, 9], [10], [11, 12, 13], [9]],
        "response_logprobs": [[-0.5, -0.25], [-1.0], [-1.0, -2.0, -3.0], [-0.1]],
        "group_id": [0, 0, 1, 1],
        "reward": [1.0, 0.0, 0.0, 0.0],
        "finish_reason": ["stop"] * 4,
        "kept": [True, True, False, False],
    })
    rollouts = rollouts_to_rl_batch(table, cfg.grpo.advantage, pad_id=0)
    assert rollouts.batch.input_ids_BL.tolist() == [[5, 6, 8], [5, 6, 0]]
    assert (rollouts.stats["rollout/samples"], rollouts.stats["rollout/generated_samples"]) == (2.0, 4.0)
    with pytest.raises(ValueError, match="no row is flagged kept"):
        rollouts_to_rl_batch(table.set_column(6, "kept", pa.array([False] * 4)), cfg.grpo.advantage)
