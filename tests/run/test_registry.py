"""The stage registry (forge_core.stages) is the one table that names the stages: every record is consistent
with the config and the code it points at, everything that needs a stage's facts reads them from it, and a
stage registered from outside forge_core is found by another process through FORGE_STAGE_MODULES."""

from __future__ import annotations

import ast
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

import forge_core.stages as stages_module
from forge_core.config import RunConfig, load_config, select_sections
from forge_core.config.schema import ResourceConfig
from forge_core.run.external import _FINGERPRINTS
from forge_core.run.plan import launch_spec_for, plan_stage
from forge_core.run.scaffold import stage_body
from forge_core.run.spec import StageSpec
from forge_core.stages import (
    BUILTIN_STAGES,
    OPERATIONAL_KEYS,
    STAGE_MODULES_ENV,
    Stage,
    is_builtin,
    policy_kinds,
    register_stage,
    stage_named,
    stage_names,
    stage_of_kind,
)
from forge_core.storage import ObjectStore
from tests import toy_stage

REPO = Path(__file__).resolve().parents[2]


def test_the_builtin_stages_in_pipeline_order():
    assert stage_names()[:5] == ("prepare", "sft", "rollout", "grpo", "evaluate")
    assert {s.name: s.kind for s in BUILTIN_STAGES} == {
        "prepare": "data", "sft": "sft", "rollout": "rollouts", "grpo": "grpo", "evaluate": "eval",
    }  # fmt: skip
    assert policy_kinds() == ("sft", "grpo")


@pytest.mark.parametrize("stage", BUILTIN_STAGES, ids=lambda s: s.name)
def test_every_record_points_at_real_config_and_code(stage: Stage):
    """Sections, operational keys, external inputs and lifetime settings name real config keys; the entry is
    a function; the inputs' kinds are kinds some stage writes."""
    cfg = RunConfig()
    assert set(select_sections(cfg, stage.key_sections)) == set(stage.key_sections)
    assert set(stage.external) <= set(_FINGERPRINTS)
    if stage.lifetime_key:
        section, key = stage.lifetime_key.split(".")
        assert getattr(getattr(cfg, section), key) in ("stage", "flow")
    assert callable(stage_body(stage))
    kinds = {s.kind for s in BUILTIN_STAGES}
    for declared in stage.inputs:
        assert set(declared.kinds) <= kinds, declared
    assert isinstance(cfg.launch.for_stage(stage.name), ResourceConfig)
    assert cfg.launch.for_stage(stage.name) is getattr(cfg.launch, stage.name)


def test_operational_keys_are_real_keys_of_key_sections():
    cfg = RunConfig()
    sections = {section for s in BUILTIN_STAGES for section in s.key_sections}
    for dotted in OPERATIONAL_KEYS:
        section, key = dotted.split(".")
        assert section in sections and hasattr(getattr(cfg, section), key), dotted


def test_a_stage_without_a_launch_section_gets_the_default_resources():
    launch = load_config(None, ["launch.sft.deadline_s=7"]).launch
    assert launch.for_stage("toy_count") == ResourceConfig()
    assert launch.for_stage("sft").deadline_s == 7


def test_unknown_stages_are_refused_everywhere_with_the_list(tmp_path):
    with pytest.raises(ValueError, match=r"stage='train': unknown; valid stages: prepare, sft, rollout, grpo, evaluate"):
        stage_named("train")
    with pytest.raises(ValueError, match="stage='train': unknown"):
        StageSpec(stage="train", config={}, inputs={}, output_uri="file:///x")
    with pytest.raises(ValueError, match="FORGE_STAGE_MODULES"):
        plan_stage(load_config(None), ObjectStore(f"file://{tmp_path}/store"), "train")


def test_a_name_is_registered_once():
    assert register_stage(toy_stage.TOY) is toy_stage.TOY  # the same record again: fine
    with pytest.raises(ValueError, match="'toy_count' is already registered"):
        register_stage(dataclasses.replace(toy_stage.TOY, kind="other"))
    with pytest.raises(ValueError, match="entry='nomodule'; give 'module:function'"):
        Stage(name="bad", kind="k", entry="nomodule")


def test_the_planner_and_the_launcher_take_a_registered_stage_from_its_record(tmp_path):
    store = ObjectStore(f"file://{tmp_path}/store")
    cfg = load_config(None, [f"storage.root={store.root}"])
    plan = plan_stage(cfg, store, "toy_count", inputs={})
    assert plan.output_uri == store.artifact_uri("toy_counts", plan.key)
    launch = launch_spec_for(plan, cfg)
    assert not launch.torchrun and launch.args[:1] == ["toy_count"]
    assert launch.env[STAGE_MODULES_ENV] == "tests.toy_stage"  # the worker imports the registering module
    assert not is_builtin(toy_stage.TOY) and STAGE_MODULES_ENV not in launch_spec_for(
        plan_stage(cfg, store, "prepare"), cfg
    ).env
    with pytest.raises(ValueError, match=r"inputs \['policy'\]: the toy_count stage has no such input"):
        plan_stage(cfg, store, "toy_count", inputs={"policy": plan.output_uri})
    # Its key follows its own sections only.
    assert plan_stage(load_config(None, [f"storage.root={store.root}", "sft.steps=3"]), store, "toy_count").key == (
        plan.key
    )
    assert plan_stage(load_config(None, [f"storage.root={store.root}", "seed=4"]), store, "toy_count").key != (
        plan.key
    )


def test_another_process_finds_a_registered_stage_through_the_import_hook():
    probe = "from forge_core.stages import stage_named; print(stage_named('toy_count').kind)"
    env = {**os.environ, STAGE_MODULES_ENV: "tests.toy_stage"}
    found = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=False)
    assert found.returncode == 0 and found.stdout.strip() == "toy_counts", found.stderr
    env[STAGE_MODULES_ENV] = "tests.no_such_module"
    missing = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=False)
    assert missing.returncode != 0 and "cannot import 'tests.no_such_module'" in missing.stderr


def test_the_registry_names_the_tasks_and_the_key_metrics():
    from tasks import stage_task

    cfg = load_config(None, ["launch.sft.retries=5"])
    sft = stage_task(cfg, "sft")
    assert (sft.name, sft.description, sft.retries) == ("train_sft", stage_named("sft").description, 5)
    assert stage_task(cfg, "toy_count").name == "toy_count"  # no task name of its own: the stage's
    assert stage_named("evaluate").describe_metrics({"accuracy": 0.5}) == "accuracy 0.500"
    assert stage_named("rollout").describe_metrics({"reward_mean": 0.25, "pass_rate": 0.5}) == "reward 0.250 pass 0.500"
    assert stage_of_kind("toy_counts").describe_metrics({"rows": 3, "longest": 9}) == "rows 3, longest 9"
    assert stage_of_kind("nothing") is None
    with pytest.raises(ValueError, match="key_metric='nocolon'; give 'module:function' or None"):
        Stage(name="bad", kind="k", entry="m:f", key_metric="nocolon")


def test_a_registered_stage_that_produces_a_policy_adds_its_kind():
    record = Stage(name="distill", kind="distilled", entry="m:f", produces_policy=True)
    register_stage(record)
    try:
        assert policy_kinds() == ("sft", "grpo", "distilled")
    finally:
        with stages_module._lock:
            del stages_module._registry["distill"]
    assert policy_kinds() == ("sft", "grpo")


# A literal that holds three or more built-in stage names or kinds is a list of stages kept by hand.
_BUILTIN_WORDS = {s.name for s in BUILTIN_STAGES} | {s.kind for s in BUILTIN_STAGES}


def _hand_written_stage_lists(path: Path) -> list[str]:
    """"line: [the names]" of every literal in `path` that lists built-in stages."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            items = node.elts
        elif isinstance(node, ast.Dict):
            items = [key for key in node.keys if key is not None]
        else:
            continue
        words = {i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)}
        if len(words & _BUILTIN_WORDS) >= 3:
            found.append(f"{node.lineno}: {sorted(words & _BUILTIN_WORDS)}")
    return found


def test_no_other_module_lists_the_builtin_stages():
    modules = [p for root in ("forge_core", "tasks", "flows") for p in sorted((REPO / root).rglob("*.py"))]
    hand_written = [
        f"{p.relative_to(REPO)}:{hit}"
        for p in modules
        if p != REPO / "forge_core" / "stages.py"
        for hit in _hand_written_stage_lists(p)
    ]
    assert not hand_written, "read the stages from forge_core.stages instead:\n" + "\n".join(hand_written)


def test_the_stage_list_check_sees_a_list(tmp_path):
    module = tmp_path / "m.py"
    module.write_text('KINDS = ("data", "sft", "rollouts")\nPAIR = {"rollout", "grpo"}\n')
    assert _hand_written_stage_lists(module) == ["1: ['data', 'rollouts', 'sft']"]
