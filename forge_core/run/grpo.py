"""The GRPO stage: one process per rank under torchrun, one plain process, or an order to the flow's trainer group.

    torchrun --standalone --nproc-per-node 2 -m forge_core.run grpo --spec <output_uri>/_specs/<attempt>.json

Inputs:
  policy     a committed `sft` or `grpo` artifact; training starts from its exported weights (`policy/`).
  rollouts   a committed `rollouts` artifact (`rollouts.parquet`) sampled from that policy.
  reference  optional KL reference (read only when grpo.loss.kl_coef > 0); default: the lineage's SFT root.
Params: `iteration` (int, default 0) seeds the mini-batch order of this rollout batch.

With a mismatch correction or `grpo.correction.measure_mismatch`, every row is first scored with the weights
that sampled it (its `policy_uri`), one no-grad forward per distinct policy.

Output (kind `grpo`): `policy/` (HF folder), DCP checkpoints `_checkpoints/step-N/`, `train_summary.json`, and a
manifest with lineage and metrics, including the phases `phase/*_s` (load, score, steps, state, export, commit,
push; the state is written, and an order's push streams the weights to the engines, while rank 0 writes and
commits the export, so the export's phase holds the commit and both). On a trainer group the state is
only taken there (its tensors as they are, not copied) and written behind the commit, at a lower CPU priority,
while the engines sample the next rollout batch (its checkpoint's manifest records `write_s`); that checkpoint
holds no weights, which the export holds. The next stage waits for that write before its engine is taken
(`phase/state_wait_s`).

Every stage starts from the exported weights and a new LR schedule over its rollout batch. With
`grpo.optimizer_state: carry` (the default) AdamW goes on with the moments and step counts of the stage that
trained a `grpo` input policy: that stage committed them as its final in-stage checkpoint (manifest metric
`optimizer/state_step`), which a stage reads from the store (`optimizer_init: checkpoint`), while a
trainer-group rank that trained the input policy has them in memory (`optimizer_init: kept`); an `sft` input, or
`fresh`, starts a new AdamW (`optimizer_init: fresh`). A trainer-group rank that trained the input policy keeps
its model (`model_init: kept`), bitwise equal to loading the export, and reads only the policy's config and
tokenizer from the store (`load/policy_bytes_read`). A retried stage resumes exactly from its newest in-stage
checkpoint. A stage whose `grpo` input committed but not that input's final state (a trainer group ended while
writing it) first trains the input's stage again from what its manifest records, which commits the state
(`optimizer_init: repaired`, `phase/repair_s`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from forge_core.artifacts.policy import committed_policy_version, download_policy, policy_uri
from forge_core.batch import RLBatch
from forge_core.config import RunConfig
from forge_core.engine import CheckpointRef, Engine, PendingSave, checkpoint_uri
from forge_core.engine.distributed import DistContext, broadcast_object, run_on_rank0
from forge_core.losses.correction import mismatch_summary
from forge_core.losses.grpo import ClippedPolicyLoss, build_policy_loss
from forge_core.metrics.phases import PhaseClock
from forge_core.models import load_hf_folder, read_hf_info
from forge_core.models.hf import is_weights_file
from forge_core.run.scaffold import StageContext, checked_context
from forge_core.run.spec import StageSpec
from forge_core.run.training import TrainingRun, training_process_group
from forge_core.run.weight_sync import ExportPush
from forge_core.storage import ArtifactError, ObjectStore
from forge_core.trainers.grpo import (
    GRPOTrainer,
    RolloutBatch,
    rollouts_to_rl_batch,
    steps_per_batch,
    summarize_steps,
    training_rows,
)
from forge_core.trainers.staleness import check_staleness

log = logging.getLogger(__name__)

ROLLOUTS_TABLE = "rollouts.parquet"
# Manifest metric of a stage that carries its optimizer on: the step of its final in-stage checkpoint.
OPTIMIZER_STATE_STEP = "optimizer/state_step"


@dataclass(frozen=True)
class GRPOInputs:
    """The stage's resolved inputs: what it trains from, on, and (for the KL term) towards."""

    policy_uri: str
    rollouts_uri: str
    reference_uri: str | None

    def lineage(self) -> dict[str, str]:
        inputs = {"policy": self.policy_uri, "rollouts": self.rollouts_uri}
        if self.reference_uri is not None:
            inputs["reference"] = self.reference_uri
        return inputs


def reference_policy_uri(ctx: StageContext) -> str | None:
    """The KL reference: `inputs.reference`, else the SFT root of the policy's lineage (None if unknown)."""
    if ctx.optional_input("reference"):
        return ctx.input("reference")
    policy_uri = ctx.input("policy")
    if ctx.input_kinds["policy"] == "sft":
        return policy_uri
    parent_ref = ctx.store.read_manifest(policy_uri).inputs.get("reference")
    return parent_ref.uri if parent_ref is not None else None


def resolve_inputs(ctx: StageContext, kl_on: bool) -> GRPOInputs:
    policy_uri = ctx.input("policy")
    reference_uri = reference_policy_uri(ctx)
    if kl_on and reference_uri is None:
        raise ValueError(
            f"grpo.loss.kl_coef>0: inputs.policy={policy_uri} records no reference policy in its "
            f"lineage; pass inputs.reference=<sft artifact URI> or set grpo.loss.kl_coef=0"
        )
    return GRPOInputs(policy_uri, ctx.input("rollouts"), reference_uri)


def carried_optimizer_state(ctx: StageContext, policy_uri: str) -> CheckpointRef | None:
    """The checkpoint whose AdamW state the stage goes on with: the input policy's final optimizer state when
    `grpo.optimizer_state` is carry and that policy is a `grpo` stage's; None starts a new AdamW. Raises
    ValueError when that stage committed no optimizer state."""
    if ctx.cfg.grpo.optimizer_state != "carry" or ctx.input_kinds["policy"] != "grpo":
        return None
    step = ctx.store.read_manifest(policy_uri).metrics.get(OPTIMIZER_STATE_STEP)
    if step is None:
        raise ValueError(
            f"grpo.optimizer_state=carry: inputs.policy={policy_uri} committed no optimizer state to go on with (it "
            "was trained with grpo.optimizer_state=fresh); set grpo.optimizer_state=fresh to start a new AdamW on it"
        )
    return CheckpointRef(step=int(step), uri=checkpoint_uri(ctx.store, policy_uri, int(step)))


def optimizer_init(engine: Engine, carried: CheckpointRef | None, repaired: bool) -> str:
    """How the stage's AdamW began: fresh, kept (the group's engine went on), read from a checkpoint, or
    repaired (its input's stage trained again to rebuild it)."""
    if carried is None:
        return "fresh"
    if repaired:
        return "repaired"
    return "kept" if engine.restarted else "checkpoint"


def repair_carried_state(ctx: StageContext, dist: DistContext, policy_uri: str, carried: CheckpointRef | None) -> bool:
    """Collective: when the carried state's checkpoint is missing (the input policy's trainer group ended while
    it wrote the state behind its commit) and no rank here holds that policy's engine, train the input's stage
    again on these ranks from its manifest (its config, inputs and iteration): it resumes from its newest
    in-stage checkpoint and commits the final state (on a trainer group, leaving its engine held). Returns
    whether it did."""
    if carried is None or (ctx.held is not None and ctx.held.holds(policy_uri)):
        return False
    if broadcast_object(ctx.store.is_committed(carried.uri) if dist.is_rank0 else None):
        return False
    log.warning(
        "%s committed but not its final optimizer state %s (its trainer group ended while writing it); training "
        "that stage again to rebuild it", policy_uri, carried.uri,
    )  # fmt: skip
    spec = committed_spec(ctx.store, policy_uri)
    parent = checked_context(spec, spec.run_config(), ctx.store, process_group=dist, held=ctx.held)
    with tempfile.TemporaryDirectory(prefix="forge-grpo-repair-") as folder:
        train(dataclasses.replace(parent, work_folder=Path(folder)))
    return True


def committed_spec(store: ObjectStore, uri: str) -> StageSpec:
    """The spec that runs the committed GRPO stage `uri` again: its config, inputs and iteration as its manifest
    records them."""
    manifest = store.read_manifest(uri)
    return StageSpec(
        stage=manifest.stage, config=manifest.config, inputs={name: ref.uri for name, ref in manifest.inputs.items()},
        output_uri=uri.rstrip("/"), params={"iteration": int(manifest.metrics.get("iteration", 0))},
    )  # fmt: skip


def read_rollouts(store: ObjectStore, cfg: RunConfig, inputs: GRPOInputs) -> RolloutBatch:
    """The verified rollout table as a training batch, with a check of its lineage and lengths."""
    source = f"inputs.rollouts={inputs.rollouts_uri}/{ROLLOUTS_TABLE}"
    try:
        table = store.reader(inputs.rollouts_uri).read_table(ROLLOUTS_TABLE)
    except (ArtifactError, FileNotFoundError) as exc:
        raise ValueError(f"{source}: cannot read the rollout artifact: {exc}") from exc
    rollouts = rollouts_to_rl_batch(table, cfg.grpo.advantage, source=source)
    longest = int(rollouts.batch.lengths_B.max()) + 1
    if longest > cfg.model.max_seq_len:
        raise ValueError(
            f"{source}: a prompt + response has {longest} tokens, more than model.max_seq_len="
            f"{cfg.model.max_seq_len}; raise model.max_seq_len or lower rollout.sampling.max_new_tokens"
        )
    stats = {**rollouts.stats, **check_staleness(table, cfg.grpo, source)}  # fatal above grpo.max_staleness
    sampled_by = sampler_stage_uris(training_rows(table), inputs.policy_uri)
    if "policy_uri" in table.column_names:
        on_input_policy = set(sampled_by) == {inputs.policy_uri.rstrip("/")}
        if not on_input_policy:
            log.warning(
                "rollouts were sampled by %s, not by inputs.policy=%s: the first step is off-policy (the ratio "
                "is taken against the sampling policy, up to clipping)",
                sorted(set(sampled_by)), inputs.policy_uri,
            )
        stats["rollout/sampled_by_input_policy"] = float(on_input_policy)
    return RolloutBatch(batch=rollouts.batch, stats=stats, sampled_by=sampled_by)


def sampler_stage_uris(table: pa.Table, policy_uri: str) -> tuple[str, ...]:
    """Per row, the stage URI of the policy that sampled it (`policy_uri` minus `/policy`); `policy_uri` for
    every row of a table without that column."""
    if "policy_uri" not in table.column_names:
        return (policy_uri.rstrip("/"),) * table.num_rows
    return tuple(uri.rstrip("/").removesuffix("/policy") for uri in table.column("policy_uri").to_pylist())


def plan_seed(seed: int, iteration: int) -> int:
    """The mini-batch order's seed for one rollout batch: distinct per iteration, fixed by the run seed."""
    return int(np.random.SeedSequence([seed, iteration]).generate_state(1)[0])


class InputPolicyFolder:
    """Rank 0's verified copy of the input policy (`path`; None on the other ranks). A rank that holds the engine
    which trained that policy goes on with it and never reads the weights: the copy starts without them when
    `with_weights` is False, and `weights()` fetches them when a new engine must be built after all."""

    def __init__(self, store: ObjectStore, stage_uri: str, folder: Path, dist: DistContext, with_weights: bool):
        self.store, self.stage_uri, self.folder, self.dist = store, stage_uri, folder, dist
        self.path: Path | None = self._fetch(None if with_weights else lambda name: not is_weights_file(name))
        self._has_weights = with_weights

    def _fetch(self, select: Callable[[str], bool] | None) -> Path | None:
        """Collective: download the files `select` accepts (all without it) on rank 0."""
        return run_on_rank0(
            lambda: download_policy(self.store, self.stage_uri, self.folder, select=select), self.dist
        )

    def weights(self) -> Path | None:
        """Collective: `path`, its weights downloaded now if they were not."""
        if not self._has_weights:
            self._fetch(is_weights_file)
            self._has_weights = True
        return self.path

    def bytes_read(self) -> int:
        """What rank 0 has read of the policy from the store so far (0 on the other ranks)."""
        return sum(f.stat().st_size for f in self.path.rglob("*") if f.is_file()) if self.path else 0


def _load_policy_weights(engine: Engine, folder: Path | None) -> None:
    """Collective: replace the engine's weights with an HF folder read on rank 0."""
    engine.load_full_state_dict(load_hf_folder(folder)[0] if engine.dist.is_rank0 else None)


def score_under_policies(
    trainer: GRPOTrainer,
    batch: RLBatch,
    stage_uris: Sequence[str],
    store: ObjectStore,
    inputs: GRPOInputs,
    workdir: Path,
) -> dict[str, torch.Tensor]:
    """Collective: {stage URI: the batch's logprobs under that policy's weights}. Other policies' weights are
    swapped in and the input policy's put back at the end from a host-memory copy (never read again from the
    store); every rank walks the same order."""
    engine = trainer.engine
    own = inputs.policy_uri.rstrip("/")
    scores: dict[str, torch.Tensor] = {}
    saved = None
    for index, uri in enumerate(sorted(set(stage_uris), key=lambda u: (u != own, u))):
        if uri != own:
            if saved is None:
                saved = engine.local_weights()
            name = "reference" if uri == (inputs.reference_uri or "").rstrip("/") else "sampler"
            download = functools.partial(download_policy, store, uri, workdir / f"weights-{index}", name)
            folder = run_on_rank0(download, engine.dist)
            _load_policy_weights(engine, folder)
        scores[uri] = trainer.score_logprobs(batch)
    if saved is not None:
        engine.load_local_weights(saved)
    return scores


def scores_samplers(cfg: RunConfig, loss: ClippedPolicyLoss) -> bool:
    """Whether the batch is scored under the weights that sampled it (a correction needs it; else on request)."""
    return loss.correction.reads_old_logprobs or cfg.grpo.correction.measure_mismatch


def attach_policy_logprobs(
    trainer: GRPOTrainer,
    rollouts: RolloutBatch,
    store: ObjectStore,
    inputs: GRPOInputs,
    workdir: Path,
    samplers: bool,
    kl_on: bool,
) -> RLBatch:
    """Collective: the batch with `old_logprobs_BL` (when `samplers`: each row under its sampler's weights) and
    `ref_logprobs_BL` (when `kl_on`); a policy that is both is scored once."""
    batch = rollouts.batch
    sampled_by = rollouts.sampled_by or (inputs.policy_uri.rstrip("/"),) * batch.batch_size
    reference = (inputs.reference_uri or "").rstrip("/") if kl_on else None
    wanted = [*(sampled_by if samplers else ()), *([reference] if reference else [])]
    if not wanted:
        return batch
    scores = score_under_policies(trainer, batch, wanted, store, inputs, workdir)
    old_BL = None
    if samplers:
        old_BL = torch.empty_like(batch.generator_logprobs_BL)
        for uri, logprobs_BL in scores.items():
            rows = torch.tensor([sampler == uri for sampler in sampled_by], dtype=torch.bool)
            old_BL[rows] = logprobs_BL[rows]
    ref_BL = scores[reference] if reference else None
    return dataclasses.replace(batch, old_logprobs_BL=old_BL, ref_logprobs_BL=ref_BL)


def export_push(ctx: StageContext, dist: DistContext, engine: Engine) -> ExportPush | None:
    """Collective: this rank's part in pushing the policy to the engines as it is exported, when the order asked
    for one and this attempt exports it (not when an earlier attempt committed it: those weights may differ)."""
    order = ctx.held.push if ctx.held is not None else None
    if order is None:
        return None
    committed = ctx.store.is_committed(policy_uri(ctx.store, ctx.output_uri)) if dist.is_rank0 else None
    exported_before = broadcast_object(committed)
    if exported_before:
        log.info("%s: committed by an earlier attempt; the engines take it after the stage", ctx.output_uri)
        return None
    return ExportPush(engine, order)


def train(ctx: StageContext) -> None:
    """Collective: train on the rollouts, export `<output_uri>/policy`, commit the `grpo` artifact. Per-stage
    workers and trainer-group ranks run the same code."""
    cfg, store, workdir = ctx.cfg, ctx.store, ctx.workdir
    iteration = int(ctx.params.get("iteration", 0))
    loss = build_policy_loss(cfg.grpo.loss, cfg.rollout.sampling.max_new_tokens, cfg.grpo.correction)
    inputs = resolve_inputs(ctx, kl_on=loss.kl is not None)
    optimizer_state = carried_optimizer_state(ctx, inputs.policy_uri)
    with training_process_group(ctx) as dist:
        phases = PhaseClock()
        repaired = repair_carried_state(ctx, dist, inputs.policy_uri, optimizer_state)
        if repaired:
            phases.lap("repair")
        # A trainer group's rank that trained the input policy goes on with that engine (TrainingRun.engine):
        # its weights are not read from the store.
        holds_input = ctx.held is not None and ctx.held.holds(inputs.policy_uri)
        policy = InputPolicyFolder(store, inputs.policy_uri, workdir / "policy", dist, with_weights=not holds_input)
        policy_dir = policy.path
        # Every rank builds the model its policy's config.json describes (rank 0 alone holds the folder).
        checkpoint = broadcast_object(read_hf_info(policy_dir) if dist.is_rank0 else None)
        vocab_size = checkpoint.vocab_size
        rollouts = read_rollouts(store, cfg, inputs)
        steps = steps_per_batch(cfg.grpo, rollouts.batch.batch_size)
        run = TrainingRun(ctx, dist, lineage=inputs.lineage(), run_name=f"{cfg.name}-{ctx.stage.name}-{iteration}")
        if ctx.held is not None:  # the last stage's state, when it is still being written behind its commit
            phases.lap("load")
            ctx.held.settle()
            phases.lap("state_wait")
        engine = run.engine(
            vocab_size, cfg.grpo.optimizer, max(steps, 1), policy_dir, checkpoint, weights_of=inputs.policy_uri,
            fetch_weights=policy.weights, optimizer_state=optimizer_state,
        )
        trainer = GRPOTrainer(engine, cfg.grpo, loss, **run.trainer_parts(engine))
        phases.lap("load")
        try:
            batch = attach_policy_logprobs(
                trainer, rollouts, store, inputs, workdir,
                samplers=scores_samplers(cfg, loss), kl_on=loss.kl is not None,
            )
            # Over the whole rollout batch (quantiles included), before any update; the steps log theirs.
            mismatch = mismatch_summary(batch, loss.correction) if batch.old_logprobs_BL is not None else {}
            mismatch["train/score_logprobs_s"] = phases.lap("score")
            resume = trainer.load_checkpoint()
            history = resume.data_cursor["history"] if resume is not None else []
            phases.lap("load")  # a resumed stage's checkpoint read counts with the model's
            history = trainer.fit(
                batch, plan_seed(cfg.seed, iteration), history, log_extra={**rollouts.stats, **mismatch}
            )
            fit_s = phases.lap("steps")

            pending: PendingSave | None = None

            def save_optimizer_state(_exported) -> dict:
                """The next iteration goes on from here, whatever runs it. A trainer group's rank writes the state
                behind the commit, on its save group; the held engine is not changed until that has ended
                (HeldPolicy)."""
                nonlocal pending
                clock = PhaseClock()
                cursor = {"history": history}
                if ctx.held is not None and ctx.held.save_group is not None:
                    pending = trainer.save_optimizer_state_behind(trainer.step, cursor, ctx.held.save_group)
                    step = pending.ref.step
                else:
                    step = trainer.save_checkpoint(trainer.step, cursor).step
                clock.lap("state")
                return {OPTIMIZER_STATE_STEP: step, **clock.metrics()}

            metrics = {
                **rollouts.stats,
                **summarize_steps(history),
                **mismatch,
                "correction": loss.correction.name,
                "sampler_uris": sorted(set(rollouts.sampled_by)),
                # The whole fit, slicing, logging and checkpoints included (train/time_s counts the steps alone).
                "train/fit_s": fit_s,
                "iteration": iteration,
                "resumed_from_step": resume.step if resume is not None else 0,
                "optimizer_init": optimizer_init(engine, optimizer_state, repaired),
                "optimizer/adam_steps": engine.optimizer_steps(),  # over every iteration it carried on from
                "model_init": "kept" if engine.restarted else "export",  # kept: the group's engine went on
                "load/policy_bytes_read": policy.bytes_read(),  # kept: the config and tokenizer files alone
                **phases.metrics(),
            }
            # The state is written, and the engines load the weights (ExportPush), while rank 0 writes the export.
            push = export_push(ctx, dist, engine)
            # The push first: it cannot raise, so no rank leaves the others in one of its gathers.
            alongside = [work for work in (
                push.send if push else None, save_optimizer_state if cfg.grpo.optimizer_state == "carry" else None,
            ) if work is not None]  # fmt: skip
            run.finish(
                trainer, metrics, str(policy_dir) if policy_dir else None, steps=history,
                alongside=(lambda full: {k: v for work in alongside for k, v in work(full).items()}) if alongside else None,
            )  # fmt: skip
            if push is not None:
                version = committed_policy_version(store, ctx.output_uri) if dist.is_rank0 else None
                ctx.held.push_failed = push.finish(broadcast_object(version))
            if ctx.held is not None:
                # The exported weights, for the engines (weight_sync), and the state still being written.
                ctx.held.keep(engine, ctx.output_uri, pending)
        finally:
            trainer.close()
