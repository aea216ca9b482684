"""Splitting one rollout batch into optimizer steps, ranks and micro-batches; RLBatch row operations."""

from __future__ import annotations

import pytest
import torch
from grpo_batches import make_rl_batch

from forge_core.batch import plan_minibatches
from forge_core.config.schema import GRPOConfig


def _all_rows(steps) -> list[int]:
    return [int(i) for step in steps for rows in step.micro_rows for i in rows]


def test_plan_shape_epochs_and_determinism():
    steps = plan_minibatches(24, mini_batch_size=8, micro_batch_size=2, epochs=3, seed=11)
    assert [(s.epoch, s.index) for s in steps] == [(e, i) for e in range(3) for i in range(3)]
    assert all([len(r) for r in s.micro_rows] == [2, 2, 2, 2] for s in steps)
    again = plan_minibatches(24, mini_batch_size=8, micro_batch_size=2, epochs=3, seed=11)
    assert _all_rows(again) == _all_rows(steps)
    other_seed = plan_minibatches(24, mini_batch_size=8, micro_batch_size=2, epochs=3, seed=12)
    assert _all_rows(other_seed) != _all_rows(steps)

    epochs = [_all_rows([s for s in steps if s.epoch == e]) for e in range(3)]
    for rows in epochs:
        assert sorted(rows) == list(range(24))  # every sample exactly once per epoch
    assert epochs[0] != epochs[1] != epochs[2]  # reshuffled each epoch


def test_ranks_take_disjoint_shards_of_the_same_mini_batches():
    ranks = [
        plan_minibatches(16, mini_batch_size=8, micro_batch_size=2, epochs=2, seed=0, dp_rank=r, dp_size=2)
        for r in range(2)
    ]
    single = plan_minibatches(16, mini_batch_size=8, micro_batch_size=2, epochs=2, seed=0)
    assert len(ranks[0]) == len(ranks[1]) == len(single) == 4
    for step, step0, step1 in zip(single, *ranks, strict=True):
        assert len(step0.micro_rows) == len(step1.micro_rows) == 2  # same number of forwards on each rank
        shard0, shard1 = _all_rows([step0]), _all_rows([step1])
        assert not set(shard0) & set(shard1)
        assert sorted(shard0 + shard1) == sorted(_all_rows([step]))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((10, 4, 2, 1, 0, 1), "grpo.mini_batch_size=4: must divide the 10 samples"),
        ((16, 8, 3, 1, 0, 1), "grpo.micro_batch_size=3"),
        ((16, 8, 4, 1, 0, 4), r"grpo.micro_batch_size=4 \* 4 data-parallel ranks"),
        ((16, 8, 2, 0, 0, 1), "grpo.epochs=0"),
    ],
)
def test_impossible_splits_are_value_errors_naming_the_field(args, message):
    num, mini, micro, epochs, rank, size = args
    with pytest.raises(ValueError, match=message):
        plan_minibatches(num, mini, micro, epochs, seed=0, dp_rank=rank, dp_size=size)


def test_grpo_config_checks():
    errors = "\n".join(GRPOConfig(epochs=0, mini_batch_size=100, micro_batch_size=64).check())
    assert "grpo.epochs=0" in errors and "grpo.mini_batch_size=100" in errors
    assert "grpo.micro_batch_size=0" in "\n".join(GRPOConfig(micro_batch_size=0).check())
    assert GRPOConfig().check() == []


def test_rl_batch_select_and_keep_rows():
    mask = torch.tensor([[True, True], [True, False], [False, True]])
    batch = make_rl_batch(
        advantages=torch.tensor([1.0, -1.0, 0.5]),
        generator_logprobs=torch.tensor([[-1.0, -2.0], [-3.0, -4.0], [-5.0, -6.0]]),
        response_mask=mask,
        ref_logprobs=torch.tensor([[-1.5, -2.5], [-3.5, -4.5], [-5.5, -6.5]]),
        input_ids=torch.tensor([[1, 2], [3, 4], [5, 6]]),
    )
    picked = batch.select(torch.tensor([2, 0]))
    assert picked.batch_size == 2
    assert picked.advantages_B.tolist() == [0.5, 1.0]
    assert picked.generator_logprobs_BL.tolist() == [[-5.0, -6.0], [-1.0, -2.0]]
    assert picked.ref_logprobs_BL.tolist() == [[-5.5, -6.5], [-1.5, -2.5]]
    assert picked.input_ids_BL.tolist() == [[5, 6], [1, 2]]
    assert picked.response_mask_BL.tolist() == [[False, True], [True, True]]

    kept = batch.keep_rows(torch.tensor([True, False, True]))
    assert kept.response_mask_BL.tolist() == [[True, True], [False, False], [False, True]]
    assert kept.advantages_B.tolist() == [1.0, 0.0, 0.5]
    assert batch.response_mask_BL.tolist() == mask.tolist()  # the original is untouched
