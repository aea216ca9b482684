"""GRPOTrainer: several optimizer steps of a GRPO-family loss on one committed rollout batch.

    table = store.reader(rollouts_uri).read_table("rollouts.parquet")
    rollouts = rollouts_to_rl_batch(table, cfg.grpo.advantage)        # kept rows, advantages, aligned logprobs
    loss = build_policy_loss(cfg.grpo.loss, max_new_tokens, cfg.grpo.correction)
    trainer = GRPOTrainer(engine, cfg.grpo, loss, sink=sink, checkpointer=checkpointer)
    old_BL = trainer.score_logprobs(rollouts.batch)                      # under the sampler's weights, loaded
    batch = dataclasses.replace(rollouts.batch, old_logprobs_BL=old_BL)  # (forge_core.run.grpo swaps them in)
    resume = trainer.load_checkpoint()                                   # mid-stage resume (or None)
    history = trainer.fit(batch, seed=plan_seed, history=resume.data_cursor["history"] if resume else [])

One rollout batch feeds `epochs * samples / mini_batch_size` optimizer steps (`forge_core.batch.plan_minibatches`).
Resume: the plan is a pure function of (samples, config, seed, rank) and the checkpoint stores the completed
steps, their metrics and every rank's RNG, so a resumed stage runs exactly the steps an uninterrupted one would.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
import torch.distributed as dist

from forge_core.batch import MiniBatchStep, RLBatch, next_token_batch, plan_minibatches
from forge_core.config.schema import AdvantageConfig, GRPOConfig
from forge_core.engine import Engine
from forge_core.losses.grpo import ClippedPolicyLoss
from forge_core.metrics.progress import emit_progress
from forge_core.rollout.table import KEPT_COLUMN, RESPONSE_MASK_COLUMN
from forge_core.trainers.advantages import compute_advantages
from forge_core.trainers.base import TitanTrainer

log = logging.getLogger(__name__)

# Columns of `rollouts.parquet` the trainer reads (the rollout stage writes more).
ROLLOUT_COLUMNS = ("prompt_ids", "response_ids", "response_logprobs", "group_id", "reward", "finish_reason")
TRUNCATED_FINISH_REASON = "length"

# Step metrics that are maxima over a stage rather than means.
_MAX_OVER_STEPS = frozenset(
    {"policy/ratio_max", "policy/logprob_gap_max", "mismatch/logprob_diff_max", "mismatch/seq_ratio_max"}
)


@dataclass(frozen=True)
class RolloutBatch:
    """A rollout batch ready for training: the RLBatch (advantages in, dropped completions masked out), the
    reward/advantage statistics of the whole batch and, per row, the stage URI of the policy that sampled it
    (empty when unknown)."""

    batch: RLBatch
    stats: dict[str, float]
    sampled_by: tuple[str, ...] = ()


def _group_indices(values: pa.ChunkedArray) -> torch.Tensor:
    """Group ids of any Arrow type (ints, strings) as dense int64 codes."""
    _, codes = np.unique(np.asarray(values.to_pylist(), dtype=object).astype(str), return_inverse=True)
    return torch.from_numpy(codes.astype(np.int64))


def _check_rollout_columns(table: pa.Table, source: str) -> None:
    missing = [c for c in ROLLOUT_COLUMNS if c not in table.column_names]
    if missing:
        raise ValueError(
            f"{source}: missing columns {missing} (has {table.column_names}); GRPO reads {list(ROLLOUT_COLUMNS)} "
            "from a rollout artifact written by the rollout stage"
        )
    if table.num_rows == 0:
        raise ValueError(f"{source}: no rollouts; the rollout stage must sample at least one group")


def training_rows(table: pa.Table) -> pa.Table:
    """The rows GRPO trains on: those flagged `kept` by dynamic sampling (every row of a table without the
    column). The others stay in the artifact for lineage."""
    if KEPT_COLUMN not in table.column_names:
        return table
    return table.filter(table.column(KEPT_COLUMN))


def _list_lengths(table: pa.Table, column: str) -> np.ndarray:
    """Each row's list length in `column` (0 for a null)."""
    return pc.list_value_length(table.column(column)).fill_null(0).to_numpy().astype(np.int64)


def _list_values(table: pa.Table, column: str) -> np.ndarray:
    """Every row's list items in `column`, one row after another."""
    return table.column(column).combine_chunks().flatten().to_numpy(zero_copy_only=False)


def _first_bad_row(bad_B: np.ndarray) -> int | None:
    rows = np.flatnonzero(bad_B)
    return int(rows[0]) if rows.size else None


def rollouts_to_rl_batch(
    table: pa.Table, advantage_cfg: AdvantageConfig, pad_id: int = 0, source: str = "rollouts.parquet"
) -> RolloutBatch:
    """Turn the rollout rows GRPO trains on (`training_rows`) into one right-padded RLBatch, in table order.

    Row i is `prompt_ids + response_ids`; response token j is the target at position `len(prompt) - 1 + j`,
    where its generator logprob and response mask are placed. A multi-turn episode carries loss only on the
    tokens the model generated (its `response_mask`). Advantages come from `reward` within `group_id`;
    completions with `finish_reason == "length"` are truncated (masked when `advantage_cfg.mask_truncated`).
    Raises ValueError for missing columns, no kept rows, or malformed rows.
    """
    _check_rollout_columns(table, source)
    generated = table.num_rows
    table = training_rows(table)
    if table.num_rows == 0:
        raise ValueError(f"{source}: no row is flagged {KEPT_COLUMN}; dynamic sampling keeps at least one group")
    prompt_B, response_B = _list_lengths(table, "prompt_ids"), _list_lengths(table, "response_ids")
    logprobs_B = _list_lengths(table, "response_logprobs")
    if (i := _first_bad_row((prompt_B == 0) | (response_B == 0))) is not None:
        raise ValueError(f"{source}: row {i} has an empty prompt or response; every rollout needs both")
    if (i := _first_bad_row(logprobs_B != response_B)) is not None:
        raise ValueError(
            f"{source}: row {i} has {response_B[i]} response tokens but {logprobs_B[i]} logprobs; "
            "the generator must return one logprob per sampled token"
        )
    multi_turn = RESPONSE_MASK_COLUMN in table.column_names
    mask_B = _list_lengths(table, RESPONSE_MASK_COLUMN) if multi_turn else response_B
    if (i := _first_bad_row(mask_B != response_B)) is not None:
        raise ValueError(
            f"{source}: row {i} has {response_B[i]} response tokens but a {RESPONSE_MASK_COLUMN} of {mask_B[i]}; "
            "an episode's mask marks each of its tokens"
        )
    # Row i is prompt_ids + response_ids, right-padded: the items of a column land, in order, where its mask is.
    total_B = prompt_B + response_B
    position_S = np.arange(int(total_B.max()))
    in_prompt_BS = position_S < prompt_B[:, None]
    in_response_BS = ~in_prompt_BS & (position_S < total_B[:, None])
    ids_BS = np.full(in_prompt_BS.shape, pad_id, dtype=np.int64)
    ids_BS[in_prompt_BS] = _list_values(table, "prompt_ids")
    ids_BS[in_response_BS] = _list_values(table, "response_ids")
    # Loss only on the tokens the model generated: every response token, or an episode's mask of them.
    learn_BS = in_response_BS.copy()
    if multi_turn:
        learn_BS[in_response_BS] = _list_values(table, RESPONSE_MASK_COLUMN).astype(bool)
    tokens = next_token_batch(ids_BS, learn_BS, total_B - 1, pad_id)
    # Response token j is the target at input position len(prompt) - 1 + j.
    generator_BS = np.zeros(in_prompt_BS.shape, dtype=np.float32)
    generator_BS[in_response_BS] = _list_values(table, "response_logprobs")
    generator_BL = torch.from_numpy(np.ascontiguousarray(generator_BS[:, 1:]))

    rewards_B = torch.tensor(table.column("reward").to_pylist(), dtype=torch.float64)
    truncated_B = torch.tensor(
        [reason == TRUNCATED_FINISH_REASON for reason in table.column("finish_reason").to_pylist()]
    )
    advantages_B, keep_B, stats = compute_advantages(
        rewards_B, _group_indices(table.column("group_id")), advantage_cfg, truncated_B
    )
    batch = RLBatch.from_token_batch(tokens, advantages_B, generator_BL).keep_rows(keep_B)
    stats = {
        **stats,
        "rollout/samples": float(table.num_rows),
        "rollout/generated_samples": float(generated),
        "rollout/response_tokens": float(response_B.sum()),
    }
    return RolloutBatch(batch=batch, stats=stats)


def trim_padding(batch: RLBatch) -> RLBatch:
    """Drop the trailing columns that are padding in every row; with causal attention no real token saw them."""
    width = int(batch.lengths_B.max())
    if width == batch.seq_len:
        return batch
    changes = {
        f.name: value[:, :width]
        for f in dataclasses.fields(batch)
        if f.name.endswith("_BL") and isinstance(value := getattr(batch, f.name), torch.Tensor)
    }
    return dataclasses.replace(batch, **changes)


def summarize_steps(history: Sequence[dict[str, float]]) -> dict[str, float]:
    """Stage-level numbers from the per-step metrics: means over the steps that trained (maxima for the max
    metrics), plus the trainer-vs-generator gap measured by the first step, before any update."""
    trained = [m for m in history if not m.get("skipped")]
    summary: dict[str, float] = {
        "train/steps": float(len(trained)),
        "train/skipped_steps": float(len(history) - len(trained)),
    }
    if not trained:
        return summary
    for key in sorted(trained[0]):
        values = [float(m[key]) for m in trained if key in m]
        summary[key] = max(values) if key in _MAX_OVER_STEPS else float(np.mean(values))
    summary["train/time_s"] = float(sum(m.get("step_time_s", 0.0) for m in trained))
    summary["final/loss"] = float(trained[-1]["loss"])
    if not history[0].get("skipped"):
        for name in ("mean", "max"):
            key = f"policy/logprob_gap_{name}"
            if key in history[0]:
                summary[f"generator_gap/{name}"] = float(history[0][key])
    return summary


def steps_per_batch(cfg: GRPOConfig, num_samples: int) -> int:
    """Optimizer steps (plan steps) one rollout batch of `num_samples` feeds: what the LR schedule spans."""
    return cfg.epochs * (num_samples // cfg.mini_batch_size)


class GRPOTrainer(TitanTrainer):
    """TitanTrainer plus GRPO's data plan (mini-batches x epochs over one rollout batch), logprobs under fixed
    weights, in-stage checkpoints and progress lines."""

    def __init__(self, engine: Engine, cfg: GRPOConfig, loss: ClippedPolicyLoss, **kwargs) -> None:
        super().__init__(engine, **kwargs)
        self.cfg = cfg
        self.loss = loss

    # ---- the plan -----------------------------------------------------------------------------------------

    def plan(self, num_samples: int, seed: int) -> list[MiniBatchStep]:
        """Every optimizer step of a rollout batch of `num_samples`, for this rank."""
        return plan_minibatches(
            num_samples,
            self.cfg.mini_batch_size,
            self.cfg.micro_batch_size,
            self.cfg.epochs,
            seed=seed,
            dp_rank=self.engine.dp_rank,
            dp_size=self.engine.dp_degree,
        )

    @staticmethod
    def micro_batch_rows(batch: RLBatch, step: MiniBatchStep) -> list[torch.Tensor]:
        """Row indices of this rank's micro-batches of one step, regrouped by length (a stable sort) so rows
        of similar length share less padding; the step's gradient is a sum over all its rows, so only fp
        rounding changes."""
        rows = torch.cat(step.micro_rows)
        by_length = rows[torch.sort(batch.lengths_B[rows], stable=True).indices]
        return list(by_length.split([len(r) for r in step.micro_rows]))

    def micro_batches(self, batch: RLBatch, step: MiniBatchStep) -> list[RLBatch]:
        """This rank's micro-batches of one step, each trimmed to its longest row."""
        return [trim_padding(batch.select(rows)) for rows in self.micro_batch_rows(batch, step)]

    # ---- scoring under fixed weights (sampler, reference) ----------------------------------------------------

    @torch.no_grad()
    def score_logprobs(self, batch: RLBatch) -> torch.Tensor:
        """Collective: [B, L] fp32 logprobs (CPU) of every row's targets under the engine's CURRENT weights
        (load the sampler's or the reference's first). Each data-parallel rank scores an equal share of the
        rows and every rank gets all of them. Raises ValueError when B does not divide over the ranks."""
        dp_size, dp_rank = self.engine.dp_degree, self.engine.dp_rank
        rows = batch.batch_size
        if rows % dp_size:
            raise ValueError(
                f"rollout batch of {rows} samples: not divisible by the {dp_size} data-parallel ranks; make "
                "rollout.prompts_per_iteration * group_size a multiple of the rank count"
            )
        share = rows // dp_size
        mine = torch.arange(dp_rank * share, (dp_rank + 1) * share)
        by_length = mine[torch.sort(batch.lengths_B[mine], stable=True).indices]
        local_BL = torch.zeros((share, batch.seq_len), dtype=torch.float32)
        for chunk in by_length.split(self.cfg.micro_batch_size):
            logprobs_BL = self.compute_logprobs(trim_padding(batch.select(chunk))).float().cpu()
            local_BL[chunk - dp_rank * share, : logprobs_BL.shape[1]] = logprobs_BL
        if self.engine.dp_group is None:
            return local_BL
        local_BL = local_BL.to(self.device)
        gathered = [torch.empty_like(local_BL) for _ in range(dp_size)]
        dist.all_gather(gathered, local_BL, group=self.engine.dp_group)
        return torch.cat(gathered).cpu()

    # ---- the loop ------------------------------------------------------------------------------------------

    def fit(
        self, batch: RLBatch, seed: int, history: Sequence[dict[str, float]] = (), log_extra: dict | None = None
    ) -> list[dict[str, float]]:
        """Run the plan of one rollout batch from step `len(history)` to its end. Returns the metrics of every
        step of the plan, `history` included; `log_extra` is logged with the plan's first step.

        A mini-batch in which no completion carries loss is skipped rather than stepped (AdamW's momentum
        would still move the weights) and counts as a plan step with metrics {"skipped": 1}. With a
        checkpointer, checkpoints every `checkpoint_every` plan steps except after the last (the stage decides
        what follows it); a checkpointed stage trains exactly one rollout batch. Without one, `fit`
        may run batch after batch and `self.step` keeps counting across them."""
        plan = self.plan(batch.batch_size, seed)
        carries_loss = self._minibatches_with_loss(batch, seed)
        history = [dict(m) for m in history]
        for index in range(len(history), len(plan)):
            step = plan[index]
            if carries_loss[index]:
                metrics = self.train_step(self.micro_batches(batch, step), self.loss)
            else:
                self.step += 1
                metrics = {"skipped": 1.0}
            metrics.update({"epoch": float(step.epoch), "minibatch": float(step.index)})
            history.append(metrics)
            self.record_metrics({**(log_extra or {}), **metrics} if index == 0 else metrics)
            if self.rank == 0:
                emit_progress("grpo", index + 1, len(plan))
            is_last = index + 1 == len(plan)
            if self.checkpointer is not None and (index + 1) % self.cfg.checkpoint_every == 0 and not is_last:
                assert self.step == index + 1, "a checkpointed stage trains exactly one rollout batch"
                self.save_checkpoint(self.step, {"history": history})
        return history

    def _minibatches_with_loss(self, batch: RLBatch, seed: int) -> list[bool]:
        """Per plan step: does its whole mini-batch (all ranks) hold a token that carries loss? Computed
        identically on every rank without communicating."""
        whole = plan_minibatches(
            batch.batch_size, self.cfg.mini_batch_size, self.cfg.mini_batch_size, self.cfg.epochs, seed=seed
        )
        return [bool(batch.loss_mask_BL[step.micro_rows[0]].any()) for step in whole]
