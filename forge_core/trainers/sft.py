"""SFTTrainer: supervised fine-tuning on a committed `data` artifact's `sft.parquet`.

    data = SFTData.from_table(table, cfg.eval_rows, seed)  # input_ids, loss_mask (+ ground_truth for exact match)
    trainer = SFTTrainer(engine, data, cfg.sft, seed=cfg.seed, log_every=cfg.logging.log_every,
                         exact_match=GreedyExactMatch(...),   # optional: forge_core.trainers.validation
                         sink=sink, checkpointer=ckpt, artifacts=ArtifactContext(store, "sft", cfg_dict, inputs))
    summary = trainer.fit()        # resumes from the newest committed checkpoint; ends holding the selected weights

The loss is token cross-entropy on completion tokens. `cfg.eval_rows` rows, chosen by the seed, are held out
and validated every `eval_every` steps and after the last step; `cfg.select`, `patience` and `target` pick the
weights `fit` ends with and when it stops (forge_core.trainers.validation.Selection). A new best is
checkpointed at once and pinned against retention, so its weights can be loaded back at the end. Checkpoints
carry the data cursor, RNG and selection state, so a resumed run reproduces an uninterrupted one.
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
from forge_core.engine.checkpoint import ModelState
from forge_core.losses import TokenCrossEntropy
from forge_core.metrics import MetricsSink
from forge_core.metrics.progress import emit_progress
from forge_core.trainers.base import ArtifactContext, TitanTrainer
from forge_core.trainers.sampler import GlobalBatchSampler
from forge_core.trainers.validation import EXACT_MATCH, LOSS, GreedyExactMatch, Selection, split_completion

log = logging.getLogger(__name__)

SFT_COLUMNS = ("input_ids", "loss_mask")
GROUND_TRUTH_COLUMN = "ground_truth"  # what a verifier checks a generated completion against (validation)
# Right-padding granularity: fewer distinct shapes (kernel / compile caches) at a small padding cost.
PAD_TO_MULTIPLE = 8


@dataclass
class SFTData:
    """Token rows of an SFT table, split into training rows and held-out validation (eval) rows."""

    train_rows: list[tuple[np.ndarray, np.ndarray]]
    eval_rows: list[tuple[np.ndarray, np.ndarray]]
    # The held-out rows' ground truths, when the table has a ground_truth column (greedy exact match).
    eval_ground_truths: list[str] | None = None

    @classmethod
    def from_table(cls, table: pa.Table, eval_rows: int, seed: int, where: str = "sft.parquet") -> SFTData:
        """Rows from a table with `input_ids` and `loss_mask` list columns (and optionally `ground_truth`);
        `eval_rows` of them, picked by `seed`, are held out. Raises ValueError for a malformed table."""
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
        held_out = sorted(order[:eval_rows].tolist())
        held_out_set = set(held_out)
        truths = None
        if GROUND_TRUTH_COLUMN in table.column_names:
            column = table.column(GROUND_TRUTH_COLUMN)
            truths = [column[i].as_py() for i in held_out]
        return cls(
            train_rows=[row for i, row in enumerate(rows) if i not in held_out_set],
            eval_rows=[rows[i] for i in held_out],
            eval_ground_truths=truths,
        )

    def validation_prompts(self) -> tuple[list[list[int]], list[list[int]]]:
        """(prompts, reference completions) of the held-out rows."""
        pairs = [split_completion(ids, mask) for ids, mask in self.eval_rows]
        return [p for p, _ in pairs], [c for _, c in pairs]


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
    steps: int  # optimizer steps run (fewer than sft.steps after an early stop)
    resumed_from_step: int
    final_loss: float  # training loss of the last step run
    eval_loss: float | None  # validation loss of the selected weights
    tokens_per_s: float
    wall_time_s: float
    train_rows: int
    eval_rows: int
    selected_step: int  # the step whose weights the trainer ends with (and the stage exports)
    # "last", "best" (the best validation), "early_stop" (the best, patience ran out) or "target" (the first
    # validation that reached sft.target)
    selected_by: str
    select_metric: str
    val_exact_match: float | None = None  # greedy exact match of the selected weights on the validation rows
    verifier_reference_pass: float | None = None  # the verifier's pass rate on the reference completions
    validation: list[dict] | None = None  # every validation: {"step", "loss", "exact_match"?}

    def as_metrics(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None}


class SFTTrainer(TitanTrainer):
    """The SFT loop on top of TitanTrainer: sampling, validation and selection, checkpoints, resume."""

    def __init__(
        self,
        engine: Engine,
        data: SFTData,
        cfg: SFTConfig,
        *,
        seed: int,
        log_every: int = 10,
        exact_match: GreedyExactMatch | None = None,
        sink: MetricsSink | None = None,
        checkpointer: Checkpointer | None = None,
        artifacts: ArtifactContext | None = None,
    ) -> None:
        super().__init__(engine, sink=sink, checkpointer=checkpointer, artifacts=artifacts)
        self.cfg = cfg
        self.data = data
        self.log_every = log_every
        self.loss = TokenCrossEntropy()
        self.exact_match = exact_match
        self.selection = Selection.from_config(cfg)
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

    def validate(self) -> dict:
        """Collective: {"step", "loss", "exact_match" (with an exact_match scorer)} at the current weights."""
        point = {"step": self.step, LOSS: self.evaluate_held_out()}
        if self.exact_match is not None:
            point[EXACT_MATCH] = self.exact_match(self)
        return point

    def _check_selection_inputs(self) -> None:
        cfg = self.cfg
        if cfg.select == "best" and not self._eval_batches:
            raise ValueError(
                f"sft.select=best with sft.eval_rows={cfg.eval_rows}: no validation rows for the "
                f"{self.engine.dp_degree} data-parallel ranks; hold out at least {self.engine.dp_degree}, or set "
                "sft.select=last"
            )
        if cfg.select == "best" and self.checkpointer is None:
            raise ValueError("sft.select=best loads the best step's weights from its checkpoint: pass a checkpointer")
        if cfg.select_metric == EXACT_MATCH and cfg.select == "best" and self.exact_match is None:
            raise ValueError(
                "sft.select_metric=exact_match needs an exact-match scorer (the SFT stage builds one from "
                "sft.verifier and the data's ground_truth column); or set sft.select_metric=loss (with a loss sft.target, or null)"
            )
        if self.exact_match is not None:
            self.exact_match.check_verifier(self)

    def _validation_due(self, is_last: bool) -> bool:
        if not self._eval_batches:
            return False
        return is_last or bool(self.cfg.eval_every and self.step % self.cfg.eval_every == 0)

    def _resume(self) -> int:
        if self.checkpointer is None:
            return 0
        resume = self.load_checkpoint()
        if resume is None:
            return 0
        self.sampler.restore(resume.data_cursor["sampler"])
        self._last_loss = resume.data_cursor["last_loss"]
        self.selection.load_state_dict(resume.data_cursor["selection"])
        log.info("SFT resumes after step %d from %s", resume.step, resume.uri)
        return resume.step

    def _checkpoint(self) -> None:
        cursor = {
            "sampler": self.sampler.cursor(),
            "last_loss": self._last_loss,
            "selection": self.selection.state_dict(),
        }
        pinned = self.selection.pinned_step
        self.save_checkpoint(self.step, cursor, pins=[] if pinned is None or pinned == self.step else [pinned])

    def save_checkpoint(self, step: int, data_cursor: dict, pins: list[int] | None = None):
        """Collective: TitanTrainer's checkpoint, pinning `pins` (earlier steps retention must keep)."""
        if not pins:
            return super().save_checkpoint(step, data_cursor)
        return self._require_checkpointer().save(step, self.engine.checkpoint_components(), data_cursor, pins=pins)

    def fit(self) -> SFTSummary:
        """Train to `cfg.steps` or an early stop (resuming first), validating and checkpointing on the way, and
        end holding the selected weights (`self.step` = their step)."""
        start = time.perf_counter()
        self._check_selection_inputs()
        resumed_from = self._resume()
        tokens, train_time = 0.0, 0.0
        while self.step < self.cfg.steps and not self.selection.stopped:
            metrics = self.train_step(self.next_micro_batches(), self.loss)
            self._last_loss = metrics["loss"]
            if self.rank == 0:
                emit_progress("sft", self.step, self.cfg.steps)
            tokens += metrics["tokens"]
            train_time += metrics["step_time_s"]
            is_last = self.step == self.cfg.steps
            improved = False
            if self._validation_due(is_last):
                point = self.validate()
                improved = self.selection.observe(point)
                metrics.update({f"val/{k}": v for k, v in point.items() if k != "step" and v is not None})
            ends = is_last or self.selection.stopped
            if self.step % self.log_every == 0 or ends or self.step == resumed_from + 1 or "val/loss" in metrics:
                self.record_metrics(metrics)
            # The last step needs no checkpoint (the export follows); a new best is checkpointed at once, since
            # its weights may be the ones exported.
            pin_now = improved and self.selection.pinned_step == self.step
            if not ends and (self.step % self.cfg.checkpoint_every == 0 or pin_now):
                self._checkpoint()
        steps_run = self.step
        selected_step, reason = self.selection.selected(steps_run)
        if selected_step != steps_run:
            self._load_weights_of(selected_step)
        if reason in ("early_stop", "target"):
            log.info("SFT stopped after step %d (%s); exports step %d", steps_run, reason, selected_step)
        chosen = self.selection.point_at(selected_step) or {}
        return SFTSummary(
            steps=steps_run,
            resumed_from_step=resumed_from,
            final_loss=self._last_loss,
            eval_loss=chosen.get(LOSS),
            tokens_per_s=tokens / train_time if train_time > 0 else 0.0,
            wall_time_s=time.perf_counter() - start,
            train_rows=len(self.data.train_rows),
            eval_rows=len(self.data.eval_rows),
            selected_step=selected_step,
            selected_by=reason,
            select_metric=self.selection.metric,
            val_exact_match=chosen.get(EXACT_MATCH),
            verifier_reference_pass=self.exact_match.reference_pass_rate if self.exact_match else None,
            validation=self.selection.curve or None,
        )

    def _load_weights_of(self, step: int) -> None:
        """Collective: the model's weights from the committed checkpoint of `step` (the selected validation)."""
        model_only = {"model": ModelState(self.model)}
        self._require_checkpointer().load_step(step, model_only)
        log.info("SFT exports the weights of step %d (%s)", step, self.selection.metric)
        self.step = step
