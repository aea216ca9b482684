"""Typed batch containers: what the trainers build and the losses read. Shapes are in the names: B rows, L positions.

    batch = pad_token_rows(rows, pad_id=0)          # rows: [(token_ids, loss_mask), ...], right-padded
    for micro in batch.split(micro_batch_size): ...

Padding, not packing: each row holds one sequence, right-padded to the longest row of the batch (rounded up
to `pad_to_multiple`). With causal attention a real token never attends to the padding after it, and padded
targets carry no loss (their mask is 0), so padding changes no real token's output.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Self

import numpy as np
import torch


@dataclass(kw_only=True)
class TokenBatch:
    """Next-token prediction rows: the model reads `input_ids_BL` and is scored on `target_ids_BL` (the inputs
    shifted left by one) where `loss_mask_BL` is True.

    `positions_BL` is None for plain 0..L-1 positions; `lengths_B` counts the real (non-pad) input positions
    of each row. `select`, `split` and `to` also carry subclass fields whose first dimension is B.
    """

    input_ids_BL: torch.Tensor
    target_ids_BL: torch.Tensor
    loss_mask_BL: torch.Tensor
    positions_BL: torch.Tensor | None = None
    lengths_B: torch.Tensor | None = None

    def __post_init__(self) -> None:
        shape = tuple(self.input_ids_BL.shape)
        assert len(shape) == 2, f"input_ids_BL must be [B, L], got {shape}"
        for name in ("target_ids_BL", "loss_mask_BL", "positions_BL"):
            value = getattr(self, name)
            assert value is None or tuple(value.shape) == shape, f"{name} {tuple(value.shape)} != {shape}"

    @property
    def batch_size(self) -> int:
        return int(self.input_ids_BL.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.input_ids_BL.shape[1])

    def num_tokens(self) -> int:
        """Real (non-pad) input tokens; all positions when lengths are unknown."""
        if self.lengths_B is None:
            return self.input_ids_BL.numel()
        return int(self.lengths_B.sum())

    def num_loss_tokens(self) -> int:
        return int(self.loss_mask_BL.sum())

    def _map_tensors(self, fn) -> Self:
        changes = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                changes[f.name] = fn(value)
        return dataclasses.replace(self, **changes)

    def to(self, device: torch.device | str) -> Self:
        return self._map_tensors(lambda t: t.to(device, non_blocking=True))

    def select(self, rows: slice) -> Self:
        """The rows `rows` of every per-row tensor field (fields whose first dimension is B)."""
        size = self.batch_size
        return self._map_tensors(lambda t: t[rows] if t.dim() > 0 and t.shape[0] == size else t)

    def split(self, micro_batch_size: int) -> list[Self]:
        """Consecutive micro-batches of `micro_batch_size` rows (the last may be smaller)."""
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size={micro_batch_size}: must be >= 1")
        return [
            self.select(slice(i, i + micro_batch_size)) for i in range(0, self.batch_size, micro_batch_size)
        ]


def pad_token_rows(
    rows: list[tuple[np.ndarray, np.ndarray]], pad_id: int = 0, pad_to_multiple: int = 1
) -> TokenBatch:
    """Right-pad `(token_ids, loss_mask)` rows into a TokenBatch for next-token prediction.

    `loss_mask[t]` marks tokens to learn; the target at input position t is token t+1, so the batch's loss
    mask is `loss_mask[1:]`. Raises ValueError if `rows` is empty or a row has fewer than 2 tokens.
    """
    if not rows:
        raise ValueError("pad_token_rows: no rows")
    lengths = np.array([len(ids) - 1 for ids, _ in rows], dtype=np.int64)
    if lengths.min() < 1:
        raise ValueError("pad_token_rows: every row needs at least 2 tokens (one input, one target)")
    width = -(-int(lengths.max()) // pad_to_multiple) * pad_to_multiple
    ids_BS = np.full((len(rows), width + 1), pad_id, dtype=np.int64)
    learn_BS = np.zeros((len(rows), width + 1), dtype=bool)
    for i, (ids, mask) in enumerate(rows):
        ids_BS[i, : len(ids)] = ids
        learn_BS[i, : len(ids)] = np.asarray(mask, dtype=bool)
    return next_token_batch(ids_BS, learn_BS, lengths, pad_id)


def next_token_batch(ids_BS: np.ndarray, learn_BS: np.ndarray, lengths_B: np.ndarray, pad_id: int) -> TokenBatch:
    """Whole rows, right-padded with `pad_id`, as a TokenBatch: row i is `ids_BS[i, : lengths_B[i] + 1]` and
    `learn_BS` marks the tokens to learn (False on padding). Input position t is scored on token t + 1; each
    input position from `lengths_B[i]` on is padding (`pad_id`, no loss)."""
    input_BL = ids_BS[:, :-1].copy()
    short = np.flatnonzero(lengths_B < input_BL.shape[1])
    input_BL[short, lengths_B[short]] = pad_id  # the row's last token is a target only
    return TokenBatch(
        input_ids_BL=torch.from_numpy(input_BL),
        target_ids_BL=torch.from_numpy(np.ascontiguousarray(ids_BS[:, 1:])),
        loss_mask_BL=torch.from_numpy(np.ascontiguousarray(learn_BS[:, 1:])),
        lengths_B=torch.from_numpy(np.asarray(lengths_B, dtype=np.int64).copy()),
    )
