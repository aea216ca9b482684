"""What the training stages (SFT, GRPO) do at their end: export the trained policy and commit the stage artifact.

Layout of a training stage's artifact (`sft` or `grpo` kind) at `<output_uri>`:

    policy/                 a nested committed `policy` artifact (HF folder, see forge_core.artifacts.policy)
    _checkpoints/step-N/    nested committed DCP checkpoints (resume; the newest storage.keep_checkpoints); a
                            GRPO stage's last one holds the AdamW state the next iteration carries on
    _attempts/<attempt>/    train_summary.json: stage metrics (+ per-step metrics for GRPO)
    _MANIFEST.json          kind sft|grpo, lineage (inputs), config, metrics, the attempt it lists

Two attempts of one stage (a zombie, two runs of one config) may both reach the export or the commit: the
first manifest wins, and the other attempt uses the winner's artifact (same content key, same URI).

    policy = export_policy(trainer, output_uri, tokenizer_dir=local, metrics=m)   # collective: .uri, .commit_s
    run_on_rank0(lambda: commit_stage(store, output_uri, "grpo", config, inputs, metrics, summary), dist)
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import torch

from forge_core.artifacts.policy import policy_uri
from forge_core.engine.distributed import broadcast_object
from forge_core.storage import ArtifactAlreadyCommitted, ObjectStore
from forge_core.trainers.base import PolicyExport, TitanTrainer

log = logging.getLogger(__name__)

SUMMARY_FILE = "train_summary.json"


def export_policy(
    trainer: TitanTrainer,
    output_uri: str,
    tokenizer_dir: str | None,
    metrics: dict,
    alongside: Callable[[Mapping[str, torch.Tensor]], object] | None = None,
) -> PolicyExport:
    """Collective: commit the trainer's weights as `<output_uri>/policy` (skipped when a previous attempt of
    the stage already committed it), running `alongside` (collective) meanwhile as `export_weights` does (given
    no weights when the policy was committed already)."""
    assert trainer.artifacts is not None, "export_policy needs a trainer built with artifacts=ArtifactContext"
    store = trainer.artifacts.store
    uri = policy_uri(store, output_uri)
    is_rank0 = trainer.engine.dist.is_rank0
    if broadcast_object(store.is_committed(uri) if is_rank0 else None):  # one answer for every rank
        if alongside is not None:
            alongside({})
        return PolicyExport(uri)
    try:
        return trainer.export_weights(uri, tokenizer_dir, metrics=metrics, alongside=alongside)
    except Exception as exc:
        # Rank 0 raises the writer's own error; the other ranks a RuntimeError about rank 0: rank 0 decides.
        if not broadcast_object(isinstance(exc, ArtifactAlreadyCommitted) if is_rank0 else None):
            raise
        log.warning("%s: another attempt of this stage exported the policy first; using it", uri)
    return PolicyExport(uri)


def commit_stage(
    store: ObjectStore,
    output_uri: str,
    kind: str,
    config: dict,
    inputs: dict[str, str],
    metrics: dict,
    summary: dict,
) -> None:
    """Rank 0: write `train_summary.json` and commit the stage artifact. When another attempt committed it
    first, this attempt's files are removed and the stage is done all the same."""
    writer = None
    try:
        writer = store.writer(output_uri, kind=kind, stage=kind)
        writer.write_json(SUMMARY_FILE, summary)
        writer.commit(config=config, inputs=inputs, metrics=metrics)
    except ArtifactAlreadyCommitted as exc:
        log.warning("%s; the stage is done", exc)
        if writer is not None:
            writer.abort()
