"""SFTTrainer: supervised fine-tuning on a committed `data` artifact's `sft.parquet`.

    data = SFTData.from_table(table)                      # input_ids list<int32>, loss_mask list<int8>
    trainer = SFTTrainer(engine, data, cfg.sft, seed=cfg.seed, log_every=cfg.logging.log_every,
                         sink=sink, checkpointer=ckpt, artifacts=ArtifactContext(store, "sft", cfg_dict, inputs))
    summary = trainer.fit()                                # resumes from the newest committed checkpoint

The loss is token cross-entropy on completion tokens (loss_mask = 1), averaged over the global batch.
`cfg.eval_rows` rows, chosen by the seed, are held out from training for the eval loss. The loop
checkpoints every `checkpoint_every` steps and after the last step; the data cursor and RNG states travel
in the checkpoint, so an interrupted run that resumes produces the same losses as one that was not.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from forge_core.batch import TokenBatch, pad_token_rows
from forge_core.config.schema import SFTConfig
from forge_core.engine import Checkpointer, Engine
from forge_core.losses import TokenCrossEntropy
from forge_core.metrics import MetricsSink
from forge_core.metrics.progress import emit_progress
from forge_core.trainers.base import ArtifactContext, TitanTrainer
from forge_core.trainers.sampler import GlobalBatchSampler

log = logging.getLogger(__name__)

SFT_COLUMNS = ("input_ids", "loss_mask")
# Right-padding granularity: fewer distinct shapes (kernel / compile caches) at a small padding cost.
PAD_TO_MULTIPLE = 8


@dataclass
class SFTData:
    """Token rows of an SFT table, split into training rows and held-out eval rows."""

    train_rows: list[tuple[np.ndarray, np.ndarray]]
    eval_rows: list[tuple[np.ndarray, np.ndarray]]

    @classmethod
    def from_table(cls, table: pa.Table, eval_rows: int, seed: int, where: str = "sft.parquet") -> SFTData:
        """Rows from a table with `input_ids` and `loss_mask` list columns; `eval_rows` of them, picked by
        `seed`, are held out."""
        missing = [c for c in SFT_COLUMNS if c not in table.column_names]
        if missing:
            raise ValueError(
                f"{where}: missing columns {missing}; expected {list(SFT_COLUMNS)} (prepare stage)"
            )
        rows = _token_rows(table, where)
        if eval_rows >= len(rows):
            raise ValueError(
                f"sft.eval_rows={eval_rows}: {where} has only {len(rows)} rows; hold out fewer (or 0)"
            )
        order = np.random.default_rng([seed, 2**31 - 1]).permutation(len(rows))
        held_out = set(order[:eval_rows].tolist())
        return cls(
            train_rows=[row for i, row in enumerate(rows) if i not in held_out],
            eval_rows=[rows[i] for i in sorted(held_out)],
        )


def _token_rows(table: pa.Table, where: str) -> list[tuple[np.ndarray, np.ndarray]]:
    ids_column = table.column("input_ids").combine_chunks()
    mask_column = table.column("loss_mask").combine_chunks()
    offsets = ids_column.offsets.to_numpy()
    if not np.array_equal(offsets, mask_column.offsets.to_numpy()):
        raise ValueError(f"{where}: input_ids and loss_mask differ in length in some rows")
    ids = ids_column.values.to_numpy().astype(np.int64)
    mask = mask_column.values.to_numpy().astype(np.int8)
    rows = []
    for i in range(len(offsets) - 1):
        start, end = offsets[i], offsets[i + 1]
        if end - start < 2:
            raise ValueError(f"{where}: row {i} has {end - start} tokens; SFT rows need at least 2")
        rows.append((ids[start:end], mask[start:end]))
    return rows


def micro_batches(rows: list[tuple[np.ndarray, np.ndarray]], micro_batch_size: int) -> list[TokenBatch]:
    """Right-padded micro-batches of `micro_batch_size` rows (the last one may be smaller)."""
    return [
        pad_token_rows(rows[i : i + micro_batch_size], pad_to_multiple=PAD_TO_MULTIPLE)
        for i in range(0, len(rows), micro_batch_size)
    ]


@dataclass
class SFTSummary:
    steps: int
    resumed_from_step: int
    final_loss: float
    eval_loss: float | None
    tokens_per_s: float
    wall_time_s: float
    train_rows: int
    eval_rows: int

    def as_metrics(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None}


class SFTTrainer(TitanTrainer):
    """The SFT loop on top of TitanTrainer: sampling, micro-batching, eval, checkpoints, resume."""

    def __init__(
        self,
        engine: Engine,
        data: SFTData,
        cfg: SFTConfig,
        *,
        seed: int,
        log_every: int = 10,
        sink: MetricsSink | None = None,
        checkpointer: Checkpointer | None = None,
        artifacts: ArtifactContext | None = None,
    ) -> None:
        super().__init__(engine, sink=sink, checkpointer=checkpointer, artifacts=artifacts)
        self.cfg = cfg
        self.data = data
        self.log_every = log_every
        self.loss = TokenCrossEntropy()
        self.sampler = GlobalBatchSampler(
            len(data.train_rows), cfg.batch_size, engine.dp_degree, engine.dp_rank, seed
        )
        self._eval_batches = self._build_eval_batches()
        self._last_loss = float("nan")

    def _build_eval_batches(self) -> list[TokenBatch]:
        """This rank's share of the held-out rows; every rank gets the same number of micro-batches."""
        degree, rank = self.engine.dp_degree, self.engine.dp_rank
        usable = len(self.data.eval_rows) - len(self.data.eval_rows) % degree
        if usable == 0:
            return []
        return micro_batches(self.data.eval_rows[:usable][rank::degree], self.cfg.micro_batch_size)

    def next_micro_batches(self) -> list[TokenBatch]:
        """This rank's micro-batches of the next global batch."""
        rows = [self.data.train_rows[i] for i in self.sampler.next_local_rows()]
        return micro_batches(rows, self.cfg.micro_batch_size)

    def evaluate_held_out(self) -> float | None:
        if not self._eval_batches:
            return None
        return self.evaluate(self._eval_batches, self.loss)["loss"]

    def _resume(self) -> int:
        if self.checkpointer is None:
            return 0
        resume = self.load_checkpoint()
        if resume is None:
            return 0
        self.sampler.restore(resume.data_cursor["sampler"])
        self._last_loss = resume.data_cursor["last_loss"]
        log.info("SFT resumes after step %d from %s", resume.step, resume.uri)
        return resume.step

    def _checkpoint(self) -> None:
        if self.checkpointer is not None:
            self.save_checkpoint(self.step, {"sampler": self.sampler.cursor(), "last_loss": self._last_loss})

    def fit(self) -> SFTSummary:
        """Train to `cfg.steps` (resuming first), evaluating and checkpointing on the way."""
        start = time.perf_counter()
        resumed_from = self._resume()
        eval_loss = None
        tokens, train_time = 0.0, 0.0
        while self.step < self.cfg.steps:
            metrics = self.train_step(self.next_micro_batches(), self.loss)
            self._last_loss = metrics["loss"]
            if self.rank == 0:
                emit_progress("sft", self.step, self.cfg.steps)
            tokens += metrics["tokens"]
            train_time += metrics["step_time_s"]
            is_last = self.step == self.cfg.steps
            if self.cfg.eval_every and self.step % self.cfg.eval_every == 0 and not is_last:
                eval_loss = self.evaluate_held_out()
                if eval_loss is not None:
                    metrics["eval_loss"] = eval_loss
            if self.step % self.log_every == 0 or is_last or self.step == resumed_from + 1:
                self.record_metrics(metrics)
            if self.step % self.cfg.checkpoint_every == 0 or is_last:
                self._checkpoint()
        final_eval = self.evaluate_held_out()
        if final_eval is not None:
            eval_loss = final_eval
            self.record_metrics({"eval_loss": final_eval})
        return SFTSummary(
            steps=self.step,
            resumed_from_step=resumed_from,
            final_loss=self._last_loss,
            eval_loss=eval_loss,
            tokens_per_s=tokens / train_time if train_time > 0 else 0.0,
            wall_time_s=time.perf_counter() - start,
            train_rows=len(self.data.train_rows),
            eval_rows=len(self.data.eval_rows),
        )
