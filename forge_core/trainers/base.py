"""TitanTrainer: the training machinery shared by SFT and GRPO, built by composition over an `Engine`.

    engine = Engine.Config.from_run_config(cfg, vocab_size, cfg.sft.optimizer, cfg.sft.steps).build()
    trainer = TitanTrainer(engine, sink=build_sinks(cfg.logging, "run", engine.dist.rank))
    metrics = trainer.train_step(batch.split(micro_batch_size), TokenCrossEntropy())
    eval_metrics = trainer.evaluate(eval_batches, TokenCrossEntropy())
    logp_BL = trainer.compute_logprobs(batch)          # no grad; 0 off batch.loss_mask_BL

Collectives: FSDP gathers parameters in every forward, so `train_step`, `evaluate` and `compute_logprobs`
must be called on every rank with the same number of micro-batches (rows may differ).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from forge_core.artifacts.policy import commit_policy
from forge_core.batch import TokenBatch
from forge_core.engine import Checkpointer, CheckpointRef, Engine, PendingSave, ResumeState
from forge_core.engine.distributed import all_reduce_sum, all_reduce_tensors, run_on_rank0
from forge_core.faults import maybe_inject_fault
from forge_core.launch.heartbeat import beat
from forge_core.losses.base import Loss, LossOutput, ModelOutputs, reduce_metric_dicts
from forge_core.metrics import MetricsSink, NullSink
from forge_core.models import forward_logits, hf_folder_files, on_positions, token_entropy, token_logprobs
from forge_core.storage import ObjectStore

log = logging.getLogger(__name__)

_LOSS_KEY = "__loss"
_TOKENS_KEY = "__tokens"


@dataclass(frozen=True)
class PolicyExport:
    """An exported policy: its artifact's URI and the seconds rank 0 took to write and commit it (0.0 on the other
    ranks, and when an earlier attempt had committed it)."""

    uri: str
    commit_s: float = 0.0


@dataclass
class ArtifactContext:
    """Where and under which lineage the trainer commits artifacts (exported policies)."""

    store: ObjectStore
    stage: str
    config: dict = field(default_factory=dict)
    inputs: dict[str, str] = field(default_factory=dict)


class TitanTrainer:
    """Generic trainer over an `Engine`: one forward/backward path for every loss, optimizer steps, evaluation,
    log-probabilities, checkpoints and weight export. Subclasses own data and loops."""

    def __init__(
        self,
        engine: Engine,
        *,
        sink: MetricsSink | None = None,
        checkpointer: Checkpointer | None = None,
        artifacts: ArtifactContext | None = None,
    ) -> None:
        self.engine = engine
        self.sink = sink or NullSink()
        self.checkpointer = checkpointer
        self.artifacts = artifacts
        self.step = 0  # completed optimizer steps

    @property
    def model(self) -> torch.nn.Module:
        return self.engine.model

    @property
    def device(self) -> torch.device:
        return self.engine.device

    @property
    def rank(self) -> int:
        return self.engine.dist.rank

    # ---- the one forward path -------------------------------------------------------------------------------

    def logits(
        self, input_ids_BL: torch.Tensor, positions_BL: torch.Tensor | None = None, at_BL: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits [B, L, V] of the current weights as one plain tensor (collective under FSDP/TP); given the bool
        mask `at_BL`, those of its N True positions alone, [N, V] (row-major), for which alone the output layer
        runs (`forward_logits`) unless it is tensor-parallel (its input is sharded over the sequence)."""
        pad_to = self.engine.padded_length(input_ids_BL.shape[1])
        tensor_parallel = self.engine.parallel_dims.tp_enabled
        selected_BL = None if tensor_parallel else at_BL
        logits = forward_logits(self.model, input_ids_BL, positions_BL, pad_to=pad_to, at_BL=selected_BL)
        if isinstance(logits, DTensor):
            # Tensor parallelism leaves the logits sharded over the vocab; gather them (differentiably) so the
            # loss sees plain per-token log-probabilities.
            logits = logits.full_tensor()
        return logits[at_BL] if tensor_parallel and at_BL is not None else logits

    def _model_outputs(self, batch: TokenBatch, with_entropy: bool) -> ModelOutputs:
        """The log-probabilities (and entropies) of the batch's targets where `loss_mask_BL` holds, 0 elsewhere:
        no loss reads the others, so the output layer runs at those positions alone."""
        at_BL = batch.loss_mask_BL
        logits_NV = self.logits(batch.input_ids_BL, batch.positions_BL, at_BL=at_BL)
        target_logprobs_N = token_logprobs(logits_NV, batch.target_ids_BL[at_BL])
        entropy_BL = None
        if with_entropy:
            with torch.no_grad():
                entropy_BL = on_positions(token_entropy(logits_NV.detach()), at_BL)
        return ModelOutputs(target_logprobs_BL=on_positions(target_logprobs_N, at_BL), entropy_BL=entropy_BL)

    def forward_backward(self, batch: TokenBatch, loss: Loss, global_normalizer: float) -> LossOutput:
        """Forward one micro-batch, apply `loss`, backpropagate (gradients accumulate); the detached result."""
        batch = batch.to(self.device)
        result = loss(self._model_outputs(batch, loss.needs_entropy), batch, global_normalizer)
        result.loss.backward()
        return LossOutput(loss=result.loss.detach(), metrics=result.metrics)

    def global_normalizer(self, micro_batches: Sequence[TokenBatch], loss: Loss) -> float:
        """Sum of `loss.normalizer` over this rank's micro-batches and all data-parallel ranks."""
        local = sum(loss.normalizer(mb) for mb in micro_batches)
        return all_reduce_sum(local, self.engine.dp_group, self.device)

    # ---- optimizer step -------------------------------------------------------------------------------------

    def train_step(self, micro_batches: Sequence[TokenBatch], loss: Loss) -> dict[str, float]:
        """Collective: one optimizer step over this rank's micro-batches (its share of the global batch); the
        step equals one big batch however it is split.

        Returns metrics: loss, grad_norm, lr (used by this step), tokens, step_time_s, tokens_per_s, mfu (GPU),
        plus the loss's own summarized metrics.
        """
        if not micro_batches:
            raise ValueError("train_step: no micro-batches")
        beat(self.rank, self.step, f"step {self.step + 1}")  # a rank that hangs is named by these (launcher)
        start = time.perf_counter()
        normalizer = self.global_normalizer(micro_batches, loss)
        with contextlib.closing(self.engine.micro_batch_passes(len(micro_batches))) as passes:
            outputs = [self.forward_backward(micro_batches[index], loss, normalizer) for index in passes]
        grad_norm = self.engine.clip_gradients()
        lr = self.engine.lr
        self.engine.step_optimizer()
        self.step += 1
        beat(self.rank, self.step, f"step {self.step} done")
        metrics = self._reduce_outputs(outputs, micro_batches, loss)
        elapsed = time.perf_counter() - start
        metrics.update(grad_norm=grad_norm, lr=lr, step_time_s=elapsed)
        metrics.update(self._throughput(metrics["tokens"], micro_batches, elapsed))
        maybe_inject_fault(self.rank, self.step)
        return metrics

    def _reduce_outputs(
        self, outputs: list[LossOutput], micro_batches: Sequence[TokenBatch], loss: Loss
    ) -> dict[str, float]:
        """Loss, token count and the loss's metrics, reduced over micro-batches and data-parallel ranks."""
        values = reduce_metric_dicts([o.metrics for o in outputs], loss.max_reduced_metrics)
        values[_LOSS_KEY] = torch.stack([o.loss.float() for o in outputs]).sum()
        values[_TOKENS_KEY] = torch.tensor(float(sum(mb.num_tokens() for mb in micro_batches)))
        values = {k: v.to(self.device) for k, v in values.items()}
        reduced = {
            k: float(v)
            for k, v in all_reduce_tensors(values, loss.max_reduced_metrics, self.engine.dp_group).items()
        }
        metrics = {"loss": reduced.pop(_LOSS_KEY), "tokens": reduced.pop(_TOKENS_KEY)}
        metrics.update(loss.summarize(reduced))
        return metrics

    def _throughput(
        self, tokens: float, micro_batches: Sequence[TokenBatch], elapsed: float
    ) -> dict[str, float]:
        out = {"tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0}
        if self.engine.peak_flops:
            seq_len = max(mb.seq_len for mb in micro_batches)
            flops = self.engine.flops_per_token(seq_len) * tokens
            out["mfu"] = flops / (elapsed * self.engine.peak_flops * self.engine.dist.world_size)
        return out

    # ---- no-grad passes -------------------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self, batches: Sequence[TokenBatch], loss: Loss) -> dict[str, float]:
        """Collective: `loss` over this rank's shard `batches`, updating nothing: {"loss", **loss.summarize}."""
        if not batches:
            raise ValueError("evaluate: no batches")
        beat(self.rank, self.step, f"evaluation at step {self.step}")
        self.model.eval()
        try:
            normalizer = self.global_normalizer(batches, loss)
            outputs = []
            for batch in batches:
                batch = batch.to(self.device)
                result = loss(self._model_outputs(batch, loss.needs_entropy), batch, normalizer)
                outputs.append(LossOutput(loss=result.loss.detach(), metrics=result.metrics))
        finally:
            self.model.train()
        metrics = self._reduce_outputs(outputs, batches, loss)
        metrics.pop("tokens")
        return metrics

    @torch.no_grad()
    def compute_logprobs(self, batch: TokenBatch) -> torch.Tensor:
        """fp32 log p(target_ids_BL) under the current weights where `loss_mask_BL` holds (0 elsewhere), shape [B, L],
        on the trainer's device."""
        return self._model_outputs(batch.to(self.device), with_entropy=False).target_logprobs_BL

    # ---- checkpoints, export, metrics -----------------------------------------------------------------------

    def _require_checkpointer(self) -> Checkpointer:
        if self.checkpointer is None:
            raise ValueError(
                "this trainer was built without a checkpointer; pass checkpointer=Checkpointer(...)"
            )
        return self.checkpointer

    def save_checkpoint(self, step: int, data_cursor: dict) -> CheckpointRef:
        """Collective: commit model + optimizer + LR schedule + step + data cursor + RNG at `step`."""
        beat(self.rank, self.step, f"checkpoint at step {step}")
        return self._require_checkpointer().save(step, self.engine.checkpoint_components(), data_cursor)

    def save_optimizer_state_behind(self, step: int, data_cursor: dict, group: Any) -> PendingSave:
        """Collective over `group`: what `save_checkpoint` commits but the weights (AdamW, LR schedule, step, data
        cursor, RNG), taken now and written on a thread of its own (`Checkpointer.save_behind`: the engine must
        not change until the save has ended). For a stage whose export holds its weights: the next stage starts
        from that export and goes on with this state; the checkpoint resumes no stage (`load_checkpoint` refuses
        it)."""
        beat(self.rank, self.step, f"optimizer state at step {step}, saved behind")
        components = {name: part for name, part in self.engine.checkpoint_components().items() if name != "model"}
        return self._require_checkpointer().save_behind(step, components, data_cursor, group)

    def load_checkpoint(self) -> ResumeState | None:
        """Collective: restore the newest valid committed checkpoint and set `self.step`; None when there is
        none."""
        resume = self._require_checkpointer().load_latest(self.engine.checkpoint_components())
        if resume is not None:
            self.step = resume.step
        return resume

    def export_weights(
        self,
        uri: str,
        tokenizer_dir: str | None,
        metrics: dict | None = None,
        alongside: Callable[[Mapping[str, torch.Tensor]], object] | None = None,
    ) -> PolicyExport:
        """Collective: write the full weights as an HF folder in `engine.export_dtype` and commit it as a
        `policy` artifact at `uri` (on rank 0).

        Args:
            alongside: collective work every rank runs while rank 0 writes and commits the folder on a thread of
                its own (the writing takes no collective); both have ended when this returns. It is given the full
                weights being written (torchtitan names, export dtype; rank 0's, empty on the other ranks), which it
                must not change.

        Raises:
            The error of `alongside` (every rank), else rank 0's writing error (as run_on_rank0 raises it).
        """
        if self.artifacts is None:
            raise ValueError("this trainer was built without artifacts=ArtifactContext(...); cannot export")
        full = self.engine.full_state_dict(dtype=self.engine.export_dtype)

        def write_and_commit() -> float:
            started = time.perf_counter()
            ctx = self.artifacts
            files = hf_folder_files(
                full, self.engine.config.model, self.engine.config.vocab_size, tokenizer_dir,
                checkpoint=self.engine.config.checkpoint,  # keeps the starting checkpoint's facts
            )
            commit_policy(
                ctx.store, uri, files, stage=ctx.stage, config=ctx.config, inputs=ctx.inputs,
                metrics={"step": self.step, **(metrics or {})},
            )
            return time.perf_counter() - started

        writing = None
        if self.engine.dist.is_rank0:
            pool = ThreadPoolExecutor(1, thread_name_prefix="forge-export")
            writing = pool.submit(write_and_commit)
            pool.shutdown(wait=False)
        try:
            if alongside is not None:
                alongside(full)
        finally:
            if writing is not None:
                futures.wait([writing])  # never a writer left running past the export
        commit_s = run_on_rank0(lambda: writing.result(), self.engine.dist)  # rank 0 alone calls it
        return PolicyExport(uri, commit_s or 0.0)

    def record_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.sink.log(metrics, self.step if step is None else step)

    def close(self) -> None:
        self.sink.close()
