"""Stage-generic pieces of the training stages (SFT, GRPO): reading a policy out of a stage artifact,
exporting the trained policy, committing the stage artifact.

Layout of a training stage's artifact (`sft` or `grpo` kind) at `<output_uri>`:

    policy/                 a nested committed `policy` artifact: HF folder (safetensors, config, tokenizer)
    _checkpoints/step-N/    nested committed DCP checkpoints (resume)
    train_summary.json      stage metrics (+ per-step metrics for GRPO)
    _MANIFEST.json          kind sft|grpo, lineage (inputs), config, metrics

    local = download_policy(store, parent_uri, workdir / "policy")       # verified HF folder
    policy_uri = export_policy(trainer, output_uri, tokenizer_dir=local, metrics=m)   # collective
    run_on_rank0(lambda: commit_stage(store, output_uri, "grpo", config, inputs, metrics, summary), dist)
"""

from __future__ import annotations

from pathlib import Path

from forge_core.storage import ArtifactError, ObjectStore
from forge_core.trainers.base import TitanTrainer

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
    uri = policy_uri_of(trainer.artifacts.store, output_uri)
    if not trainer.artifacts.store.is_committed(uri):
        trainer.export_weights(uri, tokenizer_dir, metrics=metrics)
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
    """Rank 0: write `train_summary.json` and commit the stage artifact (the manifest is the commit point)."""
    writer = store.writer(output_uri, kind=kind, stage=kind)
    writer.write_json(SUMMARY_FILE, summary)
    writer.commit(config=config, inputs=inputs, metrics=metrics)
