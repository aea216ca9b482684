"""Planning a stage run: content-addressed output key, spec, launch command (the Prefect-free half of a task).

    plan = plan_stage(cfg, store, "sft", inputs={"data": data_uri})
    if not store.is_committed(plan.output_uri):
        plan = plan.for_attempt(new_attempt_id())
        write_spec(store, plan.spec)
        result = runner_for(cfg, plan.stage).run(plan, log)     # forge_core.run.runners
        result.raise_for_outcome()

The key hashes what can change a stage's output: its config sections (less
`forge_core.stages.OPERATIONAL_KEYS`, so a new wandb project or deadline does not retrain), its inputs'
manifests, its params, `stage_dependencies`, and the code version.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from forge_core.config import RunConfig, config_to_dict, section_to_dict, select_sections
from forge_core.credentials import secret_urls_env
from forge_core.launch import LaunchSpec
from forge_core.run.external import KEYED_BY_CONTENT_ONLY, external_fingerprints
from forge_core.run.spec import StageSpec
from forge_core.stages import OPERATIONAL_KEYS, STAGE_MODULES_ENV, Stage, is_builtin, stage_named
from forge_core.storage import ObjectStore, code_version, content_key
from forge_core.timings import LAUNCHER_BACKSTOP_S


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
        """The same plan as task attempt `attempt`, whose spec is an object of its own, so racing runs never
        overwrite each other's."""
        return dataclasses.replace(self, spec=dataclasses.replace(self.spec, attempt=attempt))


def stage_key_material(cfg: RunConfig, stage: str) -> dict:
    """The slice of the resolved config that identifies a stage's output."""
    material = select_sections(cfg, stage_named(stage).key_sections)
    for dotted in (*OPERATIONAL_KEYS, *KEYED_BY_CONTENT_ONLY):  # contents are keyed instead: external_fingerprints
        *parents, name = dotted.split(".")
        section = material
        for part in parents:
            section = section.get(part, {}) if isinstance(section, dict) else {}
        if isinstance(section, dict):
            section.pop(name, None)
    return material


def stage_dependencies(cfg: RunConfig, stage: str, fingerprints: dict[str, str]) -> dict:
    """What else a stage's output depends on: the contents of what it reads outside the store, its reward and
    verifier versions, and its world size for training stages (RNG streams, shards, and a checkpoint resumes
    only on as many ranks as wrote it). The rest of `launch.*` stays out of every key."""
    record = stage_named(stage)
    dependencies: dict = {}
    if fingerprints:
        dependencies["external"] = dict(fingerprints)
    if record.scoring:
        from forge_core.rewards import RewardSet

        dependencies["rewards"] = RewardSet.from_config(cfg.rollout.rewards).versions()
    verifiers = {key: name for key in record.verifiers if (name := section_to_dict(cfg, key))}
    if verifiers:
        from forge_core.rewards import resolve_reward

        dependencies["verifiers"] = {key: resolve_reward(name).version for key, name in verifiers.items()}
    if record.distributed:
        resources = cfg.launch.for_stage(stage)
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
    record = stage_named(stage)
    inputs = dict(inputs or {})
    _check_input_names(record, inputs)
    params = dict(params or {})
    input_hashes = {name: store.manifest_sha256(uri) for name, uri in sorted(inputs.items())}
    fingerprints = external_fingerprints(cfg, store, stage)
    material = {
        "config": stage_key_material(cfg, stage),
        "params": params,
        **stage_dependencies(cfg, stage, fingerprints),
    }
    key = content_key(stage, material, input_hashes, code_version())
    output_uri = store.artifact_uri(record.kind, key)
    spec = StageSpec(
        stage=stage,
        config=config_to_dict(cfg),
        inputs=inputs,
        output_uri=output_uri,
        params=params,
        fingerprints=fingerprints,
    )
    return StagePlan(stage=stage, key=key, output_uri=output_uri, spec=spec, inputs=inputs)


def _check_input_names(record: Stage, inputs: dict[str, str]) -> None:
    unknown = sorted(name for name in inputs if record.input_named(name) is None)
    if unknown:
        raise ValueError(
            f"inputs {unknown}: the {record.name} stage has no such input; its inputs are "
            f"{[i.name for i in record.inputs]} (forge_core.stages)"
        )


def launch_spec_for(plan: StagePlan, cfg: RunConfig, extra_env: dict[str, str] | None = None) -> LaunchSpec:
    """One node's worker command for a planned stage: torchrun for distributed stages, one process otherwise;
    the Ray gang adds the node's rendezvous part and GPUs."""
    record = stage_named(plan.stage)
    resources = cfg.launch.for_stage(plan.stage)
    distributed = record.distributed
    env = dict(extra_env or {})
    if cfg.storage.endpoint_url:
        # The worker reads its spec before it has a config: tell it where a custom S3 endpoint is.
        env.setdefault("FORGE_S3_ENDPOINT_URL", cfg.storage.endpoint_url)
    if not is_builtin(record):
        env[STAGE_MODULES_ENV] = record.module  # the worker imports the module that registers the stage
    # The config (so the spec) holds tokenised URLs redacted; the worker gets the real ones like AWS keys.
    env.update(secret_urls_env())
    return LaunchSpec(
        module="forge_core.run",
        args=[plan.stage, "--spec", plan.spec_uri],
        nproc_per_node=resources.nproc_per_node if distributed else 1,
        env=env,
        deadline_s=resources.deadline_s + resources.kill_grace_s + LAUNCHER_BACKSTOP_S,
        rank0_only_logs=cfg.logging.rank0_only,
        torchrun=distributed,
        kill_grace_s=resources.kill_grace_s,
    )
