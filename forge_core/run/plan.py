"""Planning a stage run: content-addressed output key, spec, launch command.

This is the Prefect-free half of a stage task (tasks/ adds retries, concurrency and UI artifacts):

    plan = plan_stage(cfg, store, "sft", inputs={"data": data_uri})
    if not store.is_committed(plan.output_uri):
        write_spec(store, plan.spec)
        result = launch(launch_spec_for(plan, cfg), log=...)
        result.raise_for_outcome()

The key hashes only the config sections that can change a stage's output (so a new wandb project or a larger
deadline does not retrain), the manifests of its inputs, its params, the contents of what it reads from
outside the store (forge_core.run.external), its reward versions and world size where they matter
(`stage_dependencies`), and the code version (forge_core's source and the versions of the packages that shape
results).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from forge_core.config import RunConfig, config_to_dict, select_sections
from forge_core.credentials import secret_urls_env
from forge_core.launch import LaunchSpec
from forge_core.run.external import KEYED_BY_CONTENT_ONLY, external_fingerprints
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
        """Where this plan's spec is written: `<output_uri>/_specs/<attempt>.json` (no attempt: `_spec.json`)."""
        return self.spec.uri

    def for_attempt(self, attempt: str) -> StagePlan:
        """The same plan as task attempt `attempt` (forge_core.storage.new_attempt_id): its spec names the
        attempt and is written to a spec object of its own, so racing runs never overwrite each other's."""
        return dataclasses.replace(self, spec=dataclasses.replace(self.spec, attempt=attempt))


# Keys inside those sections that only say how the work is run, never what it produces.
OPERATIONAL_KEYS = {
    # The reward bounds say how scoring runs; with no timeout or crash the rewards are the same.
    "rollout": ("engine_lifetime", "engine_state_dir", "reward_timeout_s", "reward_workers"),
    # grpo.mode / max_staleness pick the rollouts a GRPO stage trains on (its input), not what it makes of them;
    # allow_uncorrected_async only lets such a config through validation.
    "grpo": ("trainer_lifetime", "mode", "max_staleness", "allow_uncorrected_async"),
}


def stage_key_material(cfg: RunConfig, stage: str) -> dict:
    """The slice of the resolved config that identifies a stage's output."""
    material = select_sections(cfg, STAGE_CONFIG_SECTIONS[stage])
    for section, keys in OPERATIONAL_KEYS.items():
        if section in material:
            material[section] = {k: v for k, v in material[section].items() if k not in keys}
    for dotted in KEYED_BY_CONTENT_ONLY:  # their contents are keyed instead (external_fingerprints)
        *parents, name = dotted.split(".")
        section = material
        for part in parents:
            section = section.get(part, {}) if isinstance(section, dict) else {}
        section.pop(name, None)
    return material


# Stages whose output holds reward scores: the versions of the reward functions are part of their key.
SCORING_STAGES = frozenset({"rollout", "evaluate"})


def stage_dependencies(cfg: RunConfig, stage: str, fingerprints: dict[str, str]) -> dict:
    """What else a stage's output depends on, beyond its config slice, inputs and params: the contents of what
    it reads outside the store, its reward functions' versions (scoring stages), and its world size (training
    stages: per-rank RNG streams and data shards, and a checkpoint resumes only on as many ranks as wrote it).
    The rest of `launch.*` (pool, deadline, retries) stays out of every key: a pool change must not retrain."""
    dependencies: dict = {}
    if fingerprints:
        dependencies["external"] = dict(fingerprints)
    if stage in SCORING_STAGES:
        from forge_core.rewards import RewardSet

        dependencies["rewards"] = RewardSet.from_config(cfg.rollout.rewards).versions()
    if stage in DISTRIBUTED_STAGES:
        resources = getattr(cfg.launch, stage)
        dependencies["world_size"] = resources.nnodes * resources.nproc_per_node
    return dependencies


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
    fingerprints = external_fingerprints(cfg, store, stage)
    material = {
        "config": stage_key_material(cfg, stage),
        "params": params,
        **stage_dependencies(cfg, stage, fingerprints),
    }
    key = content_key(stage, material, input_hashes, code_version())
    output_uri = store.artifact_uri(STAGE_KINDS[stage], key)
    spec = StageSpec(
        stage=stage,
        config=config_to_dict(cfg),
        inputs=inputs,
        output_uri=output_uri,
        params=params,
        fingerprints=fingerprints,
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
    # The config (so the spec) holds tokenised URLs redacted; the worker gets the real ones like AWS keys.
    env.update(secret_urls_env())
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
