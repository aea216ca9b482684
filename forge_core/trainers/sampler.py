"""Deterministic distributed batch sampling with a resumable cursor.

    sampler = GlobalBatchSampler(num_rows=936, global_batch_size=128, dp_degree=2, dp_rank=0, seed=0)
    rows = sampler.next_local_rows()      # this rank's 64 row indices of the next global batch
    cursor = sampler.cursor()             # {"epoch", "position", "seed", "num_rows"}: saved in checkpoints
    sampler.restore(cursor)

Every epoch is a permutation drawn from (seed, epoch) alone, so the sequence of global batches does not depend
on the number of ranks; a batch may span an epoch boundary. Rank r takes the r-th contiguous block of each.
"""

from __future__ import annotations

import numpy as np


class GlobalBatchSampler:
    def __init__(
        self, num_rows: int, global_batch_size: int, dp_degree: int, dp_rank: int, seed: int
    ) -> None:
        if num_rows < 1:
            raise ValueError("the SFT table has no training rows; check the data artifact's sft.parquet")
        if global_batch_size % dp_degree:
            raise ValueError(
                f"sft.batch_size={global_batch_size}: must be divisible by the data-parallel degree {dp_degree} "
                "(the number of training ranks / tp)"
            )
        self.num_rows = num_rows
        self.global_batch_size = global_batch_size
        self.dp_degree = dp_degree
        self.dp_rank = dp_rank
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_rows)

    def next_global_rows(self) -> np.ndarray:
        """The next global batch (row indices), advancing the cursor."""
        taken = []
        needed = self.global_batch_size
        while needed:
            chunk = self._order[self.position : self.position + needed]
            taken.append(chunk)
            needed -= len(chunk)
            self.position += len(chunk)
            if self.position == self.num_rows:
                self.epoch += 1
                self.position = 0
                self._order = self._permutation(self.epoch)
        return np.concatenate(taken)

    def next_local_rows(self) -> np.ndarray:
        """This rank's block of the next global batch."""
        rows = self.next_global_rows()
        per_rank = self.global_batch_size // self.dp_degree
        return rows[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank]

    def cursor(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "num_rows": self.num_rows}

    def restore(self, cursor: dict) -> None:
        if cursor.get("num_rows") != self.num_rows or cursor.get("seed") != self.seed:
            raise ValueError(
                f"checkpoint data cursor {cursor} was saved for another dataset/seed (now num_rows="
                f"{self.num_rows}, seed={self.seed}); resume with the same data artifact and seed"
            )
        self.epoch = int(cursor["epoch"])
        self.position = int(cursor["position"])
        self._order = self._permutation(self.epoch)
