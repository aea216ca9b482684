"""Which prompts an iteration samples: deterministic, without replacement within an epoch."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from forge_core.rollout.prompts import epoch_permutation, iteration_indices, prompts_from_table


def test_an_epoch_visits_every_prompt_once():
    picked = np.concatenate([iteration_indices(30, 6, k, seed=0) for k in range(5)])
    assert sorted(picked.tolist()) == list(range(30))


def test_iterations_are_reproducible_alone_and_depend_on_seed():
    assert iteration_indices(50, 8, 3, seed=1).tolist() == iteration_indices(50, 8, 3, seed=1).tolist()
    assert iteration_indices(50, 8, 3, seed=1).tolist() != iteration_indices(50, 8, 3, seed=2).tolist()
    # Iteration k is the k-th slice of the stream, whatever was computed before.
    stream = np.concatenate([iteration_indices(50, 8, k, seed=1) for k in range(4)])
    assert stream[24:32].tolist() == iteration_indices(50, 8, 3, seed=1).tolist()


def test_an_iteration_crossing_an_epoch_boundary_takes_the_next_permutation():
    # 10 prompts, 4 per iteration: iteration 2 = positions 8..11 = the end of epoch 0 + start of epoch 1.
    indices = iteration_indices(10, 4, 2, seed=5).tolist()
    assert indices[:2] == epoch_permutation(10, 0, 5)[8:].tolist()
    assert indices[2:] == epoch_permutation(10, 1, 5)[:2].tolist()
    assert epoch_permutation(10, 0, 5).tolist() != epoch_permutation(10, 1, 5).tolist()


def test_more_prompts_per_iteration_than_rows_wraps_into_later_epochs():
    indices = iteration_indices(3, 7, 0, seed=0).tolist()
    assert len(indices) == 7 and set(indices) == {0, 1, 2}


def test_the_permutation_is_pinned():
    """Hash-based, not numpy-RNG-based: the same prompts in every environment (never change this list)."""
    assert epoch_permutation(8, 0, 0).tolist() == PINNED_PERMUTATION


@pytest.mark.parametrize(("rows", "iteration"), [(0, 0), (5, -1)])
def test_bad_arguments(rows, iteration):
    with pytest.raises(ValueError):
        iteration_indices(rows, 2, iteration, seed=0)


def test_prompts_from_table_numbers_groups_from_the_first_id():
    table = pa.table(
        {
            "prompt_id": ["a", "b"],
            "prompt": ["Q: 1+1=? A: ", "Q: 2+2=? A: "],
            "prompt_ids": pa.array([[1, 2], [3]], type=pa.list_(pa.int32())),
            "ground_truth": ["2", "4"],
        }
    )
    prompts = prompts_from_table(table, first_group_id=12)
    assert [(p.prompt_id, p.group_id, p.prompt_ids, p.ground_truth) for p in prompts] == [
        ("a", 12, (1, 2), "2"),
        ("b", 13, (3,), "4"),
    ]


PINNED_PERMUTATION = [1, 4, 7, 2, 0, 5, 3, 6]
