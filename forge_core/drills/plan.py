"""A drill plan: a ladder of cluster sizes, the workload run at each, the faults injected into it and the bounds
a recovery must meet. Plans are YAML files (configs/drills/*.yaml) validated like run configs: every problem at
once, each naming the key, the value and the fix.

    plan = load_plan("configs/drills/ci.yaml", ["steps=[{nodes: 3}]"])
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from forge_core.config.introspect import field_types
from forge_core.config.loader import load_model
from forge_core.config.schema import LaunchConfig, ResourceConfig, Section
from forge_core.stages import all_stages, is_builtin

FaultKind = Literal["node_lost", "engine_killed", "slow_node", "storage_outage", "net_delay"]
# The stage whose engines the engine-side faults strike.
ENGINE_STAGE = "rollout"


def trainer_stages() -> tuple[str, ...]:
    """Built-in stages that train a policy on a gang of nodes (the trainer-side faults strike them)."""
    return tuple(s.name for s in all_stages() if is_builtin(s) and s.produces_policy)


def pool_stages() -> tuple[str, ...]:
    """The stages a run places on a pool (`launch.<stage>.pool`)."""
    return tuple(name for name, tp in field_types(LaunchConfig).items() if tp is ResourceConfig)


def fault_stages(kind: str) -> tuple[str, ...]:
    """The stages a fault of `kind` may strike; the first is its default."""
    if kind == "engine_killed":
        return (ENGINE_STAGE,)
    if kind == "slow_node":
        return trainer_stages()
    if kind == "storage_outage":
        return (*trainer_stages(), *(name for name in pool_stages() if name not in trainer_stages()))
    return (*trainer_stages(), ENGINE_STAGE)


class NodeShape(Section):
    """What one simulated node is: a raylet of this machine with these logical CPUs and fake GPUs."""

    cpus: int = 2
    gpus: int = 1

    def check(self) -> list[str]:
        errors = []
        if self.cpus < 1:
            errors.append(f"cpus={self.cpus}: a node needs at least 1 CPU; use cpus=2 (an engine and a rank)")
        if self.gpus < 0:
            errors.append(f"gpus={self.gpus}: must be >= 0")
        return errors


class LadderStep(Section):
    # Live nodes of the drill's pool during this step (simulated: raylets started for it).
    nodes: int = 3
    # Run-config overrides of this step's workload only (e.g. more engines on a bigger cluster).
    overrides: list[str] = Field(default_factory=list)

    def check(self) -> list[str]:
        if self.nodes < 2:
            return [f"nodes={self.nodes}: a step needs at least 2 nodes (a lost one must leave a node to retry on)"]
        return []


class DrillFault(Section):
    kind: FaultKind = "node_lost"
    # The stage it strikes (node_lost: sft, grpo = the trainer side, rollout = the engine side); null = the
    # kind's default (the first of forge_core.drills.plan.fault_stages(kind)).
    stage: str | None = None
    # When it strikes. node_lost on sft/grpo: after this optimizer step (rank 1 stops, then its node goes);
    # engine_killed: once this many samples are done in the engine (0 = mid-generation); unused otherwise.
    at: int = 1
    # slow_node: how long the node is throttled; storage_outage: how long every storage call fails.
    seconds: float = 10.0
    # slow_node: the share of each 100 ms the node's processes are stopped (0.5 = half speed).
    slowdown: float = 0.5
    # The fault fails the drill when its stage is not committed this many seconds after the fault struck.
    recover_within_s: float = 600.0

    @property
    def target(self) -> str:
        return self.stage or fault_stages(self.kind)[0]

    @property
    def label(self) -> str:
        return f"{self.kind}@{self.target}"

    def check(self) -> list[str]:
        errors = []
        allowed = fault_stages(self.kind)
        if self.stage is not None and self.stage not in allowed:
            errors.append(f"stage={self.stage!r}: {self.kind} strikes one of {list(allowed)}; use stage={allowed[0]!r}")
        if self.at < 0:
            errors.append(f"at={self.at}: must be >= 0")
        if self.kind == "node_lost" and self.target in ("sft", "grpo") and self.at < 1:
            errors.append(f"at={self.at}: node_lost on {self.target} strikes after an optimizer step; use at=1 or more")
        if self.seconds <= 0:
            errors.append(f"seconds={self.seconds}: must be > 0")
        if not 0 < self.slowdown < 1:
            errors.append(f"slowdown={self.slowdown}: the share of time stopped must be in (0, 1), e.g. 0.5")
        if self.recover_within_s <= 0:
            errors.append(f"recover_within_s={self.recover_within_s}: must be > 0")
        return errors


class Tolerance(Section):
    """How far a run that recovered from a fault may end from the clean run of its step."""

    # |final SFT loss - clean| and |final GRPO loss - clean|: a resume from a checkpoint replays exactly.
    loss: float = 1e-4
    # |final held-out accuracy - clean|: re-routed prompts keep their seeds, but a tiny eval is coarse.
    accuracy: float = 0.125


class DrillPlan(Section):
    """A drill (module docstring)."""

    name: str = "drill"
    # The workload: a run config, and overrides applied to every run of the drill.
    config: str = "configs/tiny_test.yaml"
    overrides: list[str] = Field(default_factory=list)
    # The pool label (forgeflow.pool) of the nodes the workload runs on.
    pool: str = "drill"
    node: NodeShape = Field(default_factory=NodeShape)
    steps: list[LadderStep] = Field(default_factory=lambda: [LadderStep()])
    faults: list[DrillFault] = Field(default_factory=list)
    tolerance: Tolerance = Field(default_factory=Tolerance)
    # The drill fails when recovery time grows faster than nodes**max_recovery_exponent along the ladder
    # (a fitted log-log slope; needs two steps or more).
    max_recovery_exponent: float = 1.0
    # After a run, how long its processes, actors and placement groups may take to be gone.
    leftover_wait_s: float = 120.0
    # null: a simulated cluster on this machine; an address ("auto", "ray://head:10001"): that real cluster.
    ray_address: str | None = None
    # On a real cluster: how long to wait for a lost node's replacement before the next run.
    spare_wait_s: float = 600.0
    # Node health samples, seconds apart.
    health_every_s: float = 1.0

    def check(self) -> list[str]:
        errors = []
        if not self.steps:
            errors.append("steps=[]: a drill needs at least one step, e.g. steps: [{nodes: 3}]")
        sizes = [step.nodes for step in self.steps]
        if sizes != sorted(set(sizes)):
            errors.append(f"steps: nodes={sizes}: a ladder climbs, each step bigger than the one before")
        if not Path(self.config).is_file():
            errors.append(f"config={self.config!r}: no such run config; name one of configs/*.yaml")
        if not self.name or not self.name.replace("-", "").replace("_", "").isalnum():
            errors.append(f"name={self.name!r}: use letters, digits, '-' and '_' (it names the report's folder)")
        for number, value in (("leftover_wait_s", self.leftover_wait_s), ("spare_wait_s", self.spare_wait_s),
                              ("health_every_s", self.health_every_s),
                              ("max_recovery_exponent", self.max_recovery_exponent)):
            if value <= 0:
                errors.append(f"{number}={value}: must be > 0")
        return errors


def load_plan(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> DrillPlan:
    """Read and validate a drill plan.

    Raises:
        ConfigError: every problem of the plan and the overrides at once.
    """
    return load_model(DrillPlan, path, overrides)
