"""The stage registry: one record per pipeline stage, the one table that names the stages.

    from forge_core.stages import stage_named, stage_names
    sft = stage_named("sft")        # Stage(name="sft", kind="sft", inputs=(StageInput("data", ...),), ...)
    sft.entry                       # "forge_core.run.sft:train": the stage body, imported lazily by the worker

Everything that needs to know what a stage is reads it from here: the worker dispatcher
(`python -m forge_core.run <stage>`), the spec check, the planner (kind, key sections, world size, reward versions,
external inputs), the worker scaffold (inputs by name, kind-checked), the runner selection (which lifetime
setting moves the stage onto a long-lived process) and the Prefect tasks. This module imports nothing of
forge_core, so even the lowest layers (forge_core.faults) may read it.

Adding a stage is one module and one record (docs/architecture.md, "Adding a stage"):

    # mypkg/dedupe.py
    from forge_core.stages import Stage, StageInput, register_stage

    def run(ctx):                               # ctx: forge_core.run.scaffold.StageContext
        table = ctx.store.reader(ctx.input("data")).read_table("sft.parquet")
        writer = ctx.writer()
        writer.write_table("deduped.parquet", table)
        writer.commit(config=ctx.config, inputs=ctx.inputs, metrics={"rows": table.num_rows, "wall_s": ctx.wall_s()})

    register_stage(Stage(name="dedupe", kind="deduped", entry="mypkg.dedupe:run",
                         inputs=(StageInput("data", kinds=("data",), what="a committed data artifact"),),
                         key_sections=("seed", "data")))

A stage registered outside forge_core is found by a launched worker (another process, maybe another machine)
through `FORGE_STAGE_MODULES` (comma-separated modules imported on a lookup miss); the planner puts the module
of such a stage's entry into the worker's environment (forge_core.run.plan.launch_spec_for), so nothing else is
needed. A stage without a `launch.<stage>` config section runs with the default resources
(`cfg.launch.for_stage(name)`).
"""

from __future__ import annotations

import importlib
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

STAGE_MODULES_ENV = "FORGE_STAGE_MODULES"

# Config keys inside key sections that only say how the work is run, never what it produces: left out of every
# stage's key. The reward bounds and the reward workers' extra environment say how scoring runs (with no timeout
# or crash the rewards are the same);
# grpo.mode / max_staleness pick the rollouts a GRPO stage trains on (its input), not what it makes of them;
# allow_uncorrected_async only lets such a config through validation, max_no_signal_iterations only when the
# flow stops; the lifetimes and the engines' state folder
# say which process runs a stage; the engine's memory share and KV-cache size bound what it may hold at once, not
# what it samples (every request is seeded on its own); how a policy's weights reach the engines does not change
# them.
OPERATIONAL_KEYS = (
    "rollout.engine_lifetime",
    "rollout.weight_sync",
    "rollout.gpu_memory_utilization",
    "rollout.kv_cache_gib",
    "rollout.reward_timeout_s",
    "rollout.reward_workers",
    "rollout.worker_env_allow",
    "grpo.trainer_lifetime",
    "grpo.mode",
    "grpo.max_staleness",
    "grpo.allow_uncorrected_async",
    "grpo.max_no_signal_iterations",
)

# What a stage with a long-lived ("flow") lifetime is served by: a thread of the task's process talking to the
# flow's engine actors, or an order to the flow's trainer group on the Ray cluster (forge_core.run.runners).
FlowRunner = Literal["task_process", "trainer_group"]


@dataclass(frozen=True)
class StageInput:
    """A named input artifact of a stage: `kinds` it accepts, `what` it is (for error messages)."""

    name: str
    kinds: tuple[str, ...]
    what: str
    required: bool = True


@dataclass(frozen=True)
class Stage:
    """One stage: what it writes, reads and is keyed by, how it runs, and where its body lives."""

    name: str
    kind: str  # the artifact kind it writes: its top-level folder in the store
    entry: str  # "module:function", called with a forge_core.run.scaffold.StageContext
    inputs: tuple[StageInput, ...] = ()
    # Config sections whose values can change the output (minus OPERATIONAL_KEYS): its content key.
    key_sections: tuple[str, ...] = ("seed",)
    distributed: bool = False  # torchrun with launch.<stage>'s ranks; the world size is part of the key
    scoring: bool = False  # its output holds reward scores: the reward functions' versions are part of the key
    # Config keys naming a reward function it scores with besides rollout.rewards (its versions are in the key).
    verifiers: tuple[str, ...] = ()
    # Config keys naming files outside the store that it reads (forge_core.run.external): keyed by contents.
    external: tuple[str, ...] = ()
    produces_policy: bool = False  # its artifact holds `policy/`, an HF folder a later stage can start from
    # The config key that chooses the stage's lifetime ("stage" | "flow"), and what serves it with "flow".
    lifetime_key: str | None = None
    flow_runner: FlowRunner | None = None
    description: str = ""  # one line: what it does (the Prefect task's description)
    params: tuple[str, ...] = ()  # the params it reads (documentation: params are free-form JSON)
    task_name: str = ""  # the Prefect task that runs it, as its task runs are named in the UI; "" = `name`
    # "module:function" turning its manifest's metrics into the stage table's key-metric line; None = none.
    key_metric: str | None = None

    def __post_init__(self) -> None:
        if ":" not in self.entry:
            raise ValueError(f"stage {self.name!r}: entry={self.entry!r}; give 'module:function'")
        if self.key_metric is not None and ":" not in self.key_metric:
            raise ValueError(f"stage {self.name!r}: key_metric={self.key_metric!r}; give 'module:function' or None")
        if (self.lifetime_key is None) != (self.flow_runner is None):
            raise ValueError(
                f"stage {self.name!r}: lifetime_key={self.lifetime_key!r} and flow_runner={self.flow_runner!r} "
                "come together (the setting that moves the stage onto a long-lived process, and that process)"
            )
        names = [i.name for i in self.inputs]
        if len(set(names)) != len(names):
            raise ValueError(f"stage {self.name!r}: input names {names} repeat")

    def input_named(self, name: str) -> StageInput | None:
        return next((i for i in self.inputs if i.name == name), None)

    @property
    def task(self) -> str:
        """The name of the Prefect task that runs it."""
        return self.task_name or self.name

    def describe_metrics(self, metrics: Mapping) -> str:
        """Its key-metric line for a manifest's `metrics` ("" when it names no key metric)."""
        if self.key_metric is None:
            return ""
        module, _, function = self.key_metric.partition(":")
        return getattr(importlib.import_module(module), function)(metrics)

    @property
    def module(self) -> str:
        return self.entry.partition(":")[0]


_POLICY = ("sft", "grpo")  # the kinds of the stages below that produce a policy (checked by _check_builtins)
_KEY_METRICS = "forge_core.metrics.key_metrics"

BUILTIN_STAGES: tuple[Stage, ...] = (
    Stage(
        name="prepare",
        kind="data",
        entry="forge_core.run.prepare:prepare",
        key_sections=("seed", "data", "model"),
        external=("data.source", "data.tokenizer.path"),
        description="sources -> tokenized sft / rl_prompts / eval tables + tokenizer",
        task_name="prepare_data",
        key_metric=f"{_KEY_METRICS}:data_rows",
    ),
    Stage(
        name="sft",
        kind="sft",
        entry="forge_core.run.sft:train",
        inputs=(
            StageInput("data", ("data",), "a committed data artifact from the prepare stage (sft.parquet + tokenizer/)"),
        ),
        key_sections=("seed", "model", "training", "sft"),
        distributed=True,
        verifiers=("sft.verifier",),
        external=("model.hf_path",),
        produces_policy=True,
        description="supervised fine-tuning under torchrun; resumes from its newest committed checkpoint",
        task_name="train_sft",
        key_metric=f"{_KEY_METRICS}:sft_loss_and_selection",
    ),
    Stage(
        name="rollout",
        kind="rollouts",
        entry="forge_core.run.rollout:run",
        inputs=(
            StageInput("policy", _POLICY, "a committed sft or grpo artifact (the policy to sample)"),
            StageInput("data", ("data",), "a committed data artifact (rl_prompts.parquet)"),
        ),
        key_sections=("seed", "rollout"),
        scoring=True,
        lifetime_key="rollout.engine_lifetime",
        flow_runner="task_process",
        params=("iteration", "policy_iteration"),
        description="vLLM samples of this iteration's prompts, scored by the reward functions",
        task_name="generate_rollouts",
        key_metric=f"{_KEY_METRICS}:rollout_reward",
    ),
    Stage(
        name="grpo",
        kind="grpo",
        entry="forge_core.run.grpo:train",
        inputs=(
            StageInput("policy", _POLICY, "a committed sft or grpo artifact (the policy to train)"),
            StageInput("rollouts", ("rollouts",), "a committed rollouts artifact sampled from the policy"),
            StageInput(
                "reference", _POLICY, "a committed sft or grpo artifact (the KL reference policy)", required=False
            ),
        ),
        key_sections=("seed", "model", "training", "grpo", "rollout"),
        distributed=True,
        produces_policy=True,
        lifetime_key="grpo.trainer_lifetime",
        flow_runner="trainer_group",
        params=("iteration",),
        description="one GRPO update on a committed rollout batch (its own launch, or the flow's trainer group)",
        task_name="train_grpo",
        key_metric=f"{_KEY_METRICS}:grpo_loss_on_reward",
    ),
    Stage(
        name="evaluate",
        kind="eval",
        entry="forge_core.run.evaluate:run",
        inputs=(
            StageInput("policy", _POLICY, "a committed sft or grpo artifact (the policy to evaluate)"),
            StageInput("data", ("data",), "a committed data artifact (eval.parquet)"),
        ),
        key_sections=("seed", "eval", "rollout"),
        scoring=True,
        lifetime_key="rollout.engine_lifetime",
        flow_runner="task_process",
        description="greedy (or pass@k) evaluation of a policy on the held-out split",
        key_metric=f"{_KEY_METRICS}:eval_accuracy",
    ),
)

_registry: dict[str, Stage] = {stage.name: stage for stage in BUILTIN_STAGES}
_lock = threading.Lock()
_imported_modules: set[str] = set()


def register_stage(stage: Stage) -> Stage:
    """Add `stage` to the registry (idempotent for an equal record); returns it. A different record under a
    taken name is an error: stage names are what keys, specs and workers refer to."""
    with _lock:
        known = _registry.get(stage.name)
        if known is not None and known != stage:
            raise ValueError(
                f"stage {stage.name!r} is already registered as {known}; give the new stage another name"
            )
        _registry[stage.name] = stage
    return stage


def stage_names() -> tuple[str, ...]:
    """Every known stage, built-ins first (in pipeline order), then registered ones in registration order."""
    _import_stage_modules()
    with _lock:
        return tuple(_registry)


def all_stages() -> tuple[Stage, ...]:
    """Every known stage's record, in `stage_names` order."""
    _import_stage_modules()
    with _lock:
        return tuple(_registry.values())


def stage_of_kind(kind: str) -> Stage | None:
    """The stage that writes artifacts of `kind` (the first registered), or None."""
    return next((stage for stage in all_stages() if stage.kind == kind), None)


def is_stage(name: str) -> bool:
    return _lookup(name) is not None


def stage_named(name: str) -> Stage:
    """The record of stage `name`; ValueError listing the known stages (and the import hook) otherwise."""
    stage = _lookup(name)
    if stage is None:
        raise ValueError(
            f"stage={name!r}: unknown; valid stages: {', '.join(stage_names())} (a stage defined outside "
            f"forge_core is found through {STAGE_MODULES_ENV}=<module that registers it>)"
        )
    return stage


def is_builtin(stage: Stage) -> bool:
    return any(stage is builtin for builtin in BUILTIN_STAGES)


def policy_kinds() -> tuple[str, ...]:
    """Artifact kinds that hold a `policy/` (an HF folder a training or sampling stage can start from)."""
    return tuple(dict.fromkeys(s.kind for s in all_stages() if s.produces_policy))


def _lookup(name: str) -> Stage | None:
    with _lock:
        stage = _registry.get(name)
    if stage is None:
        _import_stage_modules()
        with _lock:
            stage = _registry.get(name)
    return stage


def _import_stage_modules() -> None:
    """Import the modules named in FORGE_STAGE_MODULES once each: they register their stages."""
    for module in filter(None, (m.strip() for m in os.environ.get(STAGE_MODULES_ENV, "").split(","))):
        if module in _imported_modules:
            continue
        _imported_modules.add(module)
        try:
            importlib.import_module(module)
        except ImportError as exc:
            _imported_modules.discard(module)
            raise ValueError(
                f"{STAGE_MODULES_ENV}={os.environ[STAGE_MODULES_ENV]!r}: cannot import {module!r} ({exc}); "
                "name importable modules that register stages"
            ) from exc


def _check_builtins() -> None:
    assert tuple(s.kind for s in BUILTIN_STAGES if s.produces_policy) == _POLICY, "_POLICY != policy stages"


_check_builtins()
