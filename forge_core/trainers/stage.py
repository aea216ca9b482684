"""Stage-generic pieces of the training stages (SFT, GRPO): reading a policy out of a stage artifact,
exporting the trained policy, committing the stage artifact.

Layout of a training stage's artifact (`sft` or `grpo` kind) at `<output_uri>`:

    policy/                 a nested committed `policy` artifact: HF folder (safetensors, config, tokenizer)
    _checkpoints/step-N/    nested committed DCP checkpoints (resume; the newest storage.keep_checkpoints)
    _attempts/<attempt>/    train_summary.json: stage metrics (+ per-step metrics for GRPO)
    _MANIFEST.json          kind sft|grpo, lineage (inputs), config, metrics, the attempt it lists

Two attempts of one stage (a zombie, two runs of one config) may both reach the export or the commit: the
first manifest wins, and the other attempt uses the winner's artifact (same content key, same URI).

    local = download_policy(store, parent_uri, workdir / "policy")       # verified HF folder
    policy_uri = export_policy(trainer, output_uri, tokenizer_dir=local, metrics=m)   # collective
    run_on_rank0(lambda: commit_stage(store, output_uri, "grpo", config, inputs, metrics, summary), dist)
"""

from __future__ import annotations

import logging
from pathlib import Path

from forge_core.engine.distributed import broadcast_object
from forge_core.storage import ArtifactAlreadyCommitted, ArtifactError, ObjectStore
from forge_core.trainers.base import TitanTrainer

log = logging.getLogger(__name__)

POLICY_DIR = "policy"
SUMMARY_FILE = "train_summary.json"
# Artifact kinds whose `policy/` a training or rollout stage can start from.
POLICY_STAGE_KINDS = ("sft", "grpo")


def policy_uri_of(store: ObjectStore, stage_uri: str) -> str:
    """URI of the policy (HF folder artifact) inside a training stage's artifact."""
    return store.join(stage_uri, POLICY_DIR)


def stage_kind(store: ObjectStore, stage_uri: str, input_name: str) -> str:
    """The kind of a committed training-stage artifact; ValueError naming `input_name` when it is missing,
    uncommitted or not an sft/grpo artifact."""
    try:
        kind = store.read_manifest(stage_uri).kind
    except (ArtifactError, FileNotFoundError) as exc:
        raise ValueError(f"inputs.{input_name}={stage_uri}: not a committed artifact ({exc})") from exc
    if kind not in POLICY_STAGE_KINDS:
        raise ValueError(
            f"inputs.{input_name}={stage_uri}: a {kind!r} artifact; expected one of {list(POLICY_STAGE_KINDS)} "
            f"(the output of an SFT or GRPO stage, which holds {POLICY_DIR}/)"
        )
    return kind


def download_policy(store: ObjectStore, stage_uri: str, local_dir: str | Path, input_name: str = "policy") -> Path:
    """Verified copy of `<stage_uri>/policy/` into `local_dir` (an HF folder vLLM and the engine can load)."""
    uri = policy_uri_of(store, stage_uri)
    try:
        return store.reader(uri).download_dir("", local_dir)
    except (ArtifactError, FileNotFoundError) as exc:
        raise ValueError(f"inputs.{input_name}={stage_uri}: cannot read its policy at {uri}: {exc}") from exc


def export_policy(trainer: TitanTrainer, output_uri: str, tokenizer_dir: str | None, metrics: dict) -> str:
    """Collective: commit the trainer's weights as `<output_uri>/policy` (skipped when a previous attempt of
    the stage already committed it). Returns its URI."""
    assert trainer.artifacts is not None, "export_policy needs a trainer built with artifacts=ArtifactContext"
    store = trainer.artifacts.store
    uri = policy_uri_of(store, output_uri)
    is_rank0 = trainer.engine.dist.is_rank0
    if broadcast_object(store.is_committed(uri) if is_rank0 else None):  # one answer for every rank
        return uri
    try:
        trainer.export_weights(uri, tokenizer_dir, metrics=metrics)
    except Exception as exc:
        # Rank 0 raises the writer's own error; the other ranks a RuntimeError about rank 0: rank 0 decides.
        if not broadcast_object(isinstance(exc, ArtifactAlreadyCommitted) if is_rank0 else None):
            raise
        log.warning("%s: another attempt of this stage exported the policy first; using it", uri)
    return uri


def commit_stage(
    store: ObjectStore,
    output_uri: str,
    kind: str,
    config: dict,
    inputs: dict[str, str],
    metrics: dict,
    summary: dict,
) -> None:
    """Rank 0: write `train_summary.json` and commit the stage artifact (the manifest is the commit point).

    When another attempt of the stage committed it first, this attempt's files are removed and the stage is
    done all the same: the artifact at `output_uri` is the same computation's."""
    writer = None
    try:
        writer = store.writer(output_uri, kind=kind, stage=kind)
        writer.write_json(SUMMARY_FILE, summary)
        writer.commit(config=config, inputs=inputs, metrics=metrics)
    except ArtifactAlreadyCommitted as exc:
        log.warning("%s; the stage is done", exc)
        if writer is not None:
            writer.abort()
