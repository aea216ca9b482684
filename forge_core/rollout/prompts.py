"""Which prompts a GRPO iteration samples, and reading them from a `data` artifact.

Iteration k takes positions [k*P, (k+1)*P) of an endless stream over `rl_prompts` (P =
rollout.prompts_per_iteration). Each epoch of the stream is a permutation fixed by (seed, epoch), by a keyed
hash stable across numpy and Python versions: no prompt repeats within an epoch, and a retried or resumed
iteration picks exactly the same prompts.

    indices = iteration_indices(num_rows=len(table), per_iteration=32, iteration=3, seed=0)
    prompts = prompts_from_table(table.take(indices), first_group_id=3 * 32)
"""

from __future__ import annotations

import hashlib

import numpy as np
import pyarrow as pa

from forge_core.rollout.types import Prompt

PROMPT_COLUMNS = ("prompt_id", "prompt", "prompt_ids", "ground_truth")


def epoch_permutation(num_rows: int, epoch: int, seed: int) -> np.ndarray:
    """A permutation of range(num_rows), fixed by (seed, epoch)."""
    key = f"forgeflow-rl-prompts:{seed}:{epoch}".encode()
    scores = [
        hashlib.blake2b(i.to_bytes(8, "little"), key=key[:64], digest_size=8).digest()
        for i in range(num_rows)
    ]
    return np.array(sorted(range(num_rows), key=scores.__getitem__), dtype=np.int64)


def iteration_indices(num_rows: int, per_iteration: int, iteration: int, seed: int) -> np.ndarray:
    """Row indices of iteration `iteration`'s prompts (see module docstring)."""
    if num_rows < 1:
        raise ValueError("rl_prompts has no rows; the data stage must produce at least one RL prompt")
    if iteration < 0:
        raise ValueError(f"iteration={iteration}: must be >= 0")
    positions = np.arange(iteration * per_iteration, (iteration + 1) * per_iteration, dtype=np.int64)
    epochs, offsets = np.divmod(positions, num_rows)
    indices = np.empty_like(positions)
    for epoch in np.unique(epochs):
        chosen = epochs == epoch
        indices[chosen] = epoch_permutation(num_rows, int(epoch), seed)[offsets[chosen]]
    return indices


def check_prompt_table(table: pa.Table, source: str) -> None:
    missing = [c for c in PROMPT_COLUMNS if c not in table.column_names]
    if missing:
        raise ValueError(
            f"{source}: missing columns {missing} (has {table.column_names}); a prompts table from the data "
            f"stage has {list(PROMPT_COLUMNS)}"
        )


def prompts_from_table(table: pa.Table, first_group_id: int = 0) -> list[Prompt]:
    """One Prompt per row, in row order; group ids count up from `first_group_id`."""
    columns = {name: table.column(name).to_pylist() for name in PROMPT_COLUMNS}
    return [
        Prompt(
            prompt_id=str(columns["prompt_id"][row]),
            prompt_ids=tuple(int(t) for t in columns["prompt_ids"][row]),
            ground_truth=str(columns["ground_truth"][row]),
            group_id=first_group_id + row,
            text=str(columns["prompt"][row]),
        )
        for row in range(table.num_rows)
    ]
