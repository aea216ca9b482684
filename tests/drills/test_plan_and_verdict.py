"""Drill plans are validated like run configs, and the verdict names each fault, its measure and its bound."""

from __future__ import annotations

import pytest

from flows.drill import check_workload
from forge_core.config import ConfigError
from forge_core.drills.plan import load_plan
from forge_core.drills.report import judge, markdown, scaling, step_nodes

CI_PLAN = "configs/drills/ci.yaml"


def test_the_shipped_plans_load():
    for path in ("configs/drills/ci.yaml", "configs/drills/ladder.yaml"):
        plan = load_plan(path)
        check_workload(plan)
        assert plan.steps and plan.faults, path


def test_a_bad_plan_names_every_problem_at_once():
    with pytest.raises(ConfigError) as caught:
        load_plan(CI_PLAN, ["steps=[{nodes: 1}]", "faults.0.kind=node_gone", "faults.1.stage=grpo", "node.cpus=0",
                            "tolerance.loss=x"])
    text = str(caught.value)
    assert "5 problems" in text, text
    assert "steps.0.nodes=1: a step needs at least 2 nodes" in text
    assert "faults.0.kind='node_gone'" in text and "did you mean 'node_lost'" in text
    assert "faults.1.stage='grpo': engine_killed strikes one of ['rollout']" in text
    assert "node.cpus=0" in text and "tolerance.loss='x': expected a number" in text


def test_a_workload_that_cannot_recover_from_its_fault_is_refused_before_any_node_starts():
    plan = load_plan(CI_PLAN, ["overrides=[launch.sft.retries=0, rollout.num_engines=1]"])
    with pytest.raises(ValueError) as caught:
        check_workload(plan)
    text = str(caught.value)
    assert "node_lost@sft at 3 nodes: launch.sft.retries=0: the retry is the recovery" in text
    assert "launch.sft.nnodes=1: the lost node is the stage's second" in text
    assert "engine_killed@rollout at 3 nodes: rollout.num_engines=1" in text


def run(name: str, recover_s: float | None, *, injected: bool = True, **workload) -> dict:
    base = {"data_rows": 64, "rollout_samples": 16, "sft_final_loss": 1.0, "grpo_final_loss": 0.5,
            "accuracy_final": 0.5, "rerouted_prompts": 0}
    fault = None if name == "clean" else {
        "injected_at": 100.0 if injected else None, "recover_s": recover_s, "detect_s": 1.0, "attempts": 2,
        "redirects": 1, "bound_s": 600.0}
    return {"name": name, "wall_s": 60.0, "stages": [{"label": "sft"}, {"label": "grpo-1"}],
            "workload": {**base, "sft_tokens_per_s": 100.0, "rollout_tokens_per_s": 50.0,
                         "accuracy_gain_per_1k_samples": 0.0, **workload}, "fault": fault, "leftovers": []}


def record(steps: list[tuple[int, list[dict]]]) -> dict:
    drill = {"plan": {"name": "t", "config": CI_PLAN}, "cluster": "test", "overrides": [],
             "steps": [{"nodes": n, "runs": runs} for n, runs in steps]}
    drill["scaling"] = scaling(drill)
    return drill


def test_the_verdict_names_the_fault_the_measured_time_and_the_bound():
    plan = load_plan(CI_PLAN, ["faults.0.recover_within_s=5"])
    drill = record([(3, [run("clean", None), run("node_lost@sft", 12.5), run("engine_killed@rollout", 3.0)])])
    assert judge(drill, plan) == [
        ("node_lost@sft at 3 nodes: recovered in 12.5 s, over its bound recover_within_s=5 s; raise the bound or "
        "find what slowed the recovery")
    ]
    assert judge(drill, load_plan(CI_PLAN)) == []


def test_lost_data_a_fault_that_never_struck_and_a_drifted_result_each_fail():
    plan = load_plan(CI_PLAN)
    lost = run("node_lost@sft", 10.0, rollout_samples=12)
    lost["stages"] = [{"label": "sft"}]
    drifted = run("engine_killed@rollout", 10.0, sft_final_loss=1.5)
    drill = record([(3, [run("clean", None), lost, drifted]), (6, [run("clean", None), run("node_lost@sft", None, injected=False)])])
    problems = judge(drill, plan)
    assert "node_lost@sft at 3 nodes: data lost: stages ['grpo-1'] of the clean run were not committed" in problems
    assert "node_lost@sft at 3 nodes: data lost: rollout_samples=12, the clean run had 16" in problems
    assert any(p.startswith("engine_killed@rollout at 3 nodes: sft_final_loss differs from the clean run by 0.5") for p in problems)
    assert any(p.startswith("node_lost@sft at 6 nodes: the fault never struck") for p in problems)


def test_recovery_growing_faster_than_linearly_fails_with_the_fitted_exponent():
    plan = load_plan(CI_PLAN)
    quadratic = record([(n, [run("clean", None), run("node_lost@sft", n * n * 1.0)]) for n in (3, 6, 12)])
    fit = quadratic["scaling"]["node_lost@sft"]
    assert fit["exponent"] == pytest.approx(2.0) and fit["slope_s_per_node"] > 0
    (problem,) = judge(quadratic, plan)
    assert problem.startswith("node_lost@sft: recovery grows as nodes**2.00 along the ladder (3 nodes: 9.0 s")
    flat = record([(n, [run("clean", None), run("node_lost@sft", 30.0 + n)]) for n in (3, 6, 12)])
    assert judge(flat, plan) == [] and flat["scaling"]["node_lost@sft"]["exponent"] < 1.0
    text = markdown({**flat, "passed": True, "problems": []})
    assert "## 12 nodes" in text and "| node_lost@sft | 3 nodes: 33.0 s, 6 nodes: 36.0 s, 12 nodes: 42.0 s |" in text


def test_a_step_s_timeline_shows_the_nodes_alive_in_it_not_those_lost_before():
    sample = lambda t, node, alive: {"t": t, "node": node, "alive": alive, "cpu": 1.0, "rss_mb": 1.0}
    step = {"nodes": 3, "runs": [
        {"name": "clean", "samples": [sample(0, "a", True), sample(0, "b", True), sample(0, "gone", False)]},
        {"name": "node_lost@sft", "samples": [sample(1, "a", True), sample(1, "b", False), sample(1, "new", True),
                                              sample(1, "gone", False)]},
    ]}  # fmt: skip
    assert step_nodes(step) == ["a", "b", "new"]  # b was lost in this step; "gone" was lost before it
