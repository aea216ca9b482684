"""What the training stages (SFT, GRPO) share around their trainer: the process group, the engine, the trainer's
metric sink, checkpointer and artifact context, and the end (export the policy, commit on rank 0).

    with training_process_group(ctx) as dist:               # the job's, kept up; or one for this stage alone
        run = TrainingRun(ctx, dist, lineage, run_name=f"{ctx.cfg.name}-sft")
        engine = run.engine(vocab_size, ctx.cfg.sft.optimizer, ctx.cfg.sft.steps, init_weights_dir)
        trainer = SFTTrainer(engine, data, ctx.cfg.sft, seed=ctx.cfg.seed, **run.trainer_parts(engine))
        try:
            metrics = trainer.fit().as_metrics()
            run.finish(trainer, metrics, tokenizer_dir)
        finally:
            trainer.close()
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch

from forge_core.config.schema import OptimizerConfig
from forge_core.engine import (
    Checkpointer,
    CheckpointRef,
    Engine,
    destroy_distributed,
    init_distributed,
    load_components,
)
from forge_core.engine.distributed import DistContext, run_on_rank0
from forge_core.metrics import build_sinks
from forge_core.metrics.phases import PhaseClock
from forge_core.models import HFModelInfo
from forge_core.run.scaffold import StageContext
from forge_core.trainers.base import ArtifactContext, TitanTrainer
from forge_core.trainers.stage import commit_stage, export_policy

log = logging.getLogger(__name__)


@contextlib.contextmanager
def training_process_group(ctx: StageContext) -> Iterator[DistContext]:
    """The process group the stage trains in: the long-lived job's (left up), or one made for this stage and
    destroyed when it ends."""
    if ctx.process_group is not None:
        yield ctx.process_group
        return
    dist = init_distributed(ctx.cfg.training.device)
    try:
        yield dist
    finally:
        destroy_distributed()


@dataclass(frozen=True)
class TrainingRun:
    """One training stage's shared parts; `lineage` is what its artifacts record as inputs."""

    ctx: StageContext
    dist: DistContext
    lineage: dict[str, str]
    run_name: str  # the metric sinks' run name (a wandb run per stage)

    def engine(
        self,
        vocab_size: int,
        optimizer: OptimizerConfig,
        total_steps: int,
        init_weights_dir: str | None,
        checkpoint: HFModelInfo | None = None,
        weights_of: str | None = None,
        fetch_weights: Callable[[], object] | None = None,
        optimizer_state: CheckpointRef | None = None,
    ) -> Engine:
        """The engine (model, optimizer, LR schedule) from the run's config, started from an HF folder (with
        `checkpoint`'s architecture) or from the seed. `weights_of`: the stage that committed that folder; when
        this rank holds the engine that trained it with this model config, that engine is restarted instead of
        a new one built. Whatever else the rank held is dropped first. `fetch_weights` (collective) is called
        before a new engine is built, for a folder that may not hold its weights yet. `optimizer_state`: the
        checkpoint of `weights_of`'s final AdamW state to go on with (a restarted engine holds it already);
        None starts a new AdamW."""
        config = Engine.Config.from_run_config(
            self.ctx.cfg, vocab_size, optimizer, total_steps, init_weights_dir=init_weights_dir, checkpoint=checkpoint
        )
        held = self.ctx.held
        kept = None
        if held is not None and weights_of is not None:
            kept = held.take(weights_of)  # leaves nothing held
        elif held is not None:
            held.drop()
        if kept is not None and kept.restarts_as(config):
            return kept.restart(config) if optimizer_state is None else kept.go_on(config)
        del kept  # never two models on a rank
        if fetch_weights is not None:
            fetch_weights()
        engine = config.build()
        if optimizer_state is not None:
            load_components(self.ctx.store, optimizer_state, {"optimizer": engine.optimizers}, self.dist)
            engine.carry_optimizer()
        return engine

    def trainer_parts(self, engine: Engine) -> dict:
        """The trainer's keyword arguments: metric sink, in-stage checkpointer, artifact context."""
        ctx = self.ctx
        return {
            "sink": build_sinks(ctx.cfg.logging, self.run_name, engine.dist.rank, config=ctx.config),
            "checkpointer": Checkpointer(
                ctx.store, ctx.output_uri, engine.dist, stage=ctx.stage.name, config=ctx.config, inputs=self.lineage
            ),
            "artifacts": ArtifactContext(ctx.store, ctx.stage.name, ctx.config, self.lineage),
        }

    def finish(
        self,
        trainer: TitanTrainer,
        metrics: dict,
        tokenizer_dir: str | None,
        steps: list | None = None,
        alongside: Callable[[Mapping[str, torch.Tensor]], dict] | None = None,
    ) -> dict:
        """Collective: export `<output_uri>/policy`, then commit the stage artifact on rank 0 with `metrics` plus
        the policy URI, `phase/export_s` (gathering the weights, then writing and committing them beside
        `alongside`), `phase/commit_s` (rank 0's writing and committing alone), the engine's layout and `wall_s`;
        `train_summary.json` holds them (and, given `steps`, every step's). Returns the stage's metrics.

        Args:
            alongside: collective work run while rank 0 writes the export (the two overlap), given the weights
                written as `export_weights` gives them; the metrics it returns join the stage's (not the policy
                artifact's).
        """
        ctx = self.ctx
        export = PhaseClock()
        extra: dict = {}
        also = None if alongside is None else lambda full: extra.update(alongside(full))
        policy = export_policy(trainer, ctx.output_uri, tokenizer_dir, metrics, alongside=also)
        export.lap("export")
        phases = {**export.metrics(), "phase/commit_s": policy.commit_s}  # the commit: within the export's phase
        layout = {k: v for k, v in trainer.engine.describe().items() if not isinstance(v, dict)}
        final = {**metrics, **extra, **phases, "policy_uri": policy.uri, **layout, "wall_s": ctx.wall_s()}
        trainer.sink.summary({k: v for k, v in final.items() if isinstance(v, (int, float))})
        summary = final if steps is None else {"metrics": final, "steps": steps}
        run_on_rank0(
            lambda: commit_stage(ctx.store, ctx.output_uri, ctx.stage.kind, ctx.config, self.lineage, final, summary),
            trainer.engine.dist,
        )
        log.info("committed %s (policy %s)", ctx.output_uri, policy.uri)
        return final
