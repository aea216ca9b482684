"""Planning a stage run: content-addressed output key, spec, launch command.

This is the Prefect-free half of a stage task (tasks/ adds retries, concurrency and UI artifacts):

    plan = plan_stage(cfg, store, "sft", inputs={"data": data_uri})
    if not store.is_committed(plan.output_uri):
        write_spec(store, plan.spec)
        result = launch(launch_spec_for(plan, cfg), log=...)
        result.raise_for_outcome()

The key hashes only the config sections that can change a stage's output (so a new wandb project or a larger
deadline does not retrain), the manifests of its inputs, its params and the code version.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from forge_core.config import RunConfig, config_to_dict, select_sections
from forge_core.launch import LaunchSpec
from forge_core.run.spec import StageSpec
from forge_core.storage import ObjectStore, code_version, content_key

# The artifact kind each stage writes (its top-level folder in the store).
STAGE_KINDS = {
    "prepare": "data",
    "sft": "sft",
    "rollout": "rollouts",
    "grpo": "grpo",
    "evaluate": "eval",
}

# Config sections whose values can change each stage's output. Resources, storage and logging are left out
# on purpose: the same work on a different pool, or logged elsewhere, is the same artifact.
STAGE_CONFIG_SECTIONS = {
    "prepare": ("seed", "data", "model"),
    "sft": ("seed", "model", "training", "sft"),
    "rollout": ("seed", "rollout"),
    "grpo": ("seed", "model", "training", "grpo", "rollout"),
    "evaluate": ("seed", "eval", "rollout"),
}

# Stages that run under torchrun; the others run as one plain process.
DISTRIBUTED_STAGES = frozenset({"sft", "grpo"})


@dataclass(frozen=True)
class StagePlan:
    stage: str
    key: str
    output_uri: str
    spec: StageSpec
    inputs: dict[str, str] = field(default_factory=dict)

    @property
    def spec_uri(self) -> str:
        return self.output_uri.rstrip("/") + "/_spec.json"


# Keys inside those sections that only say how the work is run, never what it produces.
OPERATIONAL_KEYS = {
    "rollout": ("engine_lifetime", "engine_state_dir"),
    # grpo.mode / max_staleness pick the rollouts a GRPO stage trains on (its input), not what it makes of them.
    "grpo": ("trainer_lifetime", "mode", "max_staleness"),
}


def stage_key_material(cfg: RunConfig, stage: str) -> dict:
    """The slice of the resolved config that identifies a stage's output."""
    material = select_sections(cfg, STAGE_CONFIG_SECTIONS[stage])
    for section, keys in OPERATIONAL_KEYS.items():
        if section in material:
            material[section] = {k: v for k, v in material[section].items() if k not in keys}
    return material


def source_content_hash(cfg: RunConfig, store: ObjectStore) -> str | None:
    """Data prep reads files outside the store: their bytes are part of its key, so a source rewritten in
    place is prepared again instead of hitting a stale artifact. None for the generated demo task."""
    if cfg.data.source == "demo":
        return None
    from forge_core.data.sources import source_fingerprint

    return source_fingerprint(cfg.data.source, cfg.data.format, store.storage_options)


def plan_stage(
    cfg: RunConfig,
    store: ObjectStore,
    stage: str,
    inputs: dict[str, str] | None = None,
    params: dict | None = None,
) -> StagePlan:
    """Resolve a stage's output URI from its config, its committed inputs and its params."""
    if stage not in STAGE_KINDS:
        raise ValueError(f"stage={stage!r}: unknown; valid stages are {sorted(STAGE_KINDS)}")
    inputs = dict(inputs or {})
    params = dict(params or {})
    input_hashes = {name: store.manifest_sha256(uri) for name, uri in sorted(inputs.items())}
    material = {"config": stage_key_material(cfg, stage), "params": params}
    if stage == "prepare":
        material["source"] = source_content_hash(cfg, store)
    key = content_key(stage, material, input_hashes, code_version())
    output_uri = store.artifact_uri(STAGE_KINDS[stage], key)
    spec = StageSpec(
        stage=stage,
        config=config_to_dict(cfg),
        inputs=inputs,
        output_uri=output_uri,
        params=params,
    )
    return StagePlan(stage=stage, key=key, output_uri=output_uri, spec=spec, inputs=inputs)


def launch_spec_for(plan: StagePlan, cfg: RunConfig, extra_env: dict[str, str] | None = None) -> LaunchSpec:
    """The worker command for a planned stage: torchrun for training stages, one process otherwise."""
    resources = getattr(cfg.launch, plan.stage)
    distributed = plan.stage in DISTRIBUTED_STAGES
    env = dict(extra_env or {})
    if cfg.storage.endpoint_url:
        # The worker reads its spec before it has a config: tell it where a custom S3 endpoint is.
        env.setdefault("FORGE_S3_ENDPOINT_URL", cfg.storage.endpoint_url)
    return LaunchSpec(
        module="forge_core.run",
        args=[plan.stage, "--spec", plan.spec_uri],
        nproc_per_node=resources.nproc_per_node if distributed else 1,
        nnodes=resources.nnodes if distributed else 1,
        rdzv_endpoint=resources.rdzv_endpoint if distributed else None,
        env=env,
        deadline_s=resources.deadline_s,
        rank0_only_logs=cfg.logging.rank0_only,
        torchrun=distributed,
    )
