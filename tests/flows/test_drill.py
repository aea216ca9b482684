"""The CI drill (configs/drills/ci.yaml): 3 simulated nodes (the test run's shared cluster_utils cluster, pool gpu-a), the
tiny workload clean, then with a node lost mid-SFT and an engine killed mid-rollout. Both recover, nothing is
lost or left behind, and the report's numbers are the manifests'.

Every wait waits for an event under a generous bound; nothing depends on how fast the machine is.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from prefect import flow

from flows.drill import run_drill
from forge_core.compute.simulated import SimulatedCluster
from forge_core.drills.plan import load_plan
from forge_core.drills.report import CLEAN, RUN_HEADER
from forge_core.storage import ObjectStore
from tests.ray_cluster import POOL, POOL_NODES

pytestmark = [pytest.mark.integration, pytest.mark.timeout(2400)]

PLAN = "configs/drills/ci.yaml"
ON_TEST_POOL = [f"pool={POOL}"]
_cluster: list[SimulatedCluster] = []  # the adopted shared test cluster, for the flow below


@flow(name="ci-drill")
def ci_drill(out: str) -> dict:
    return run_drill(load_plan(PLAN, ON_TEST_POOL), _cluster[0], Path(out), ON_TEST_POOL)


@pytest.fixture(scope="module")
def drill(prefect_api, ray_cluster, tmp_path_factory) -> tuple[dict, Path]:
    folder = tmp_path_factory.mktemp("ci-drill")
    plan = load_plan(PLAN, ON_TEST_POOL)
    _cluster.append(SimulatedCluster.adopt(ray_cluster.raylets, ray_cluster.compute, POOL, plan.node.cpus, plan.node.gpus))
    try:
        return ci_drill(str(folder)), folder
    finally:
        _cluster.pop().close()


def runs_of(record: dict) -> dict[str, dict]:
    (step,) = record["steps"]
    assert step["nodes"] == 3
    return {run["name"]: run for run in step["runs"]}


def test_both_faults_are_recovered_within_their_bounds_and_the_drill_passes(drill):
    record, _ = drill
    assert record["problems"] == [] and record["passed"], record["problems"]
    runs = runs_of(record)
    assert list(runs) == [CLEAN, "node_lost@sft", "engine_killed@rollout"]
    lost = runs["node_lost@sft"]
    fault = lost["fault"]
    assert fault["attempts"] == 2 and fault["redirects"] == 1, fault
    assert 0 < fault["detect_s"] < fault["recover_s"] <= 600, fault
    assert fault["struck_node"] not in {n["node_id"] for n in _placement(lost, "sft")["nodes"]}
    assert lost["workload"]["sft_resumed_from_step"] == 2, lost["workload"]
    assert any(node["lost"] and node["node"] == fault["struck_node"] for node in lost["health"]), lost["health"]
    killed = runs["engine_killed@rollout"]
    assert killed["workload"]["engines_lost"] >= 1 and killed["workload"]["rerouted_prompts"] > 0, killed["workload"]
    assert 0 < killed["fault"]["recover_s"] <= 600 and killed["fault"]["attempts"] == 1, killed["fault"]
    assert runs[CLEAN]["workload"]["engines_lost"] == 0


def test_nothing_is_lost_or_left_behind(drill, ray_cluster):
    record, _ = drill
    runs = runs_of(record)
    clean = runs[CLEAN]
    for name, run in runs.items():
        assert run["error"] is None and run["leftovers"] == [], (name, run["error"], run["leftovers"])
        assert [s["label"] for s in run["stages"]] == [s["label"] for s in clean["stages"]], name
        for key in ("data_rows", "rollout_samples"):
            assert run["workload"][key] == clean["workload"][key] > 0, (name, key)
        # The SFT resumed after the lost node replays exactly the uninterrupted steps.
        assert abs(run["workload"]["sft_final_loss"] - clean["workload"]["sft_final_loss"]) <= 1e-6, name
    assert ray_cluster.stage_processes() == [] and ray_cluster.live_actors() == []
    assert len(ray_cluster.compute.pool_nodes(POOL)) == POOL_NODES


def _placement(run: dict, stage: str) -> dict:
    row = next(s for s in run["stages"] if s["stage"] == stage)
    return ObjectStore(run["store_root"]).read_manifest(row["uri"]).placement


def test_the_report_s_numbers_are_the_manifests(drill):
    record, folder = drill
    assert json.loads((folder / "drill.json").read_text())["problems"] == record["problems"]
    report = (folder / "drill.md").read_text()
    assert RUN_HEADER in report and "## 3 nodes" in report
    for name, run in runs_of(record).items():
        store = ObjectStore(run["store_root"])
        manifests = {s["label"]: store.read_manifest(s["uri"]) for s in run["stages"]}
        sft = manifests["sft"].metrics
        rollouts = [m.metrics for m in manifests.values() if m.kind == "rollouts"]
        assert run["workload"]["sft_tokens_per_s"] == sft["tokens_per_s"]
        assert run["workload"]["sft_final_loss"] == sft["final_loss"]
        assert run["workload"]["rollout_samples"] == sum(m["samples"] for m in rollouts)
        assert run["workload"]["rerouted_prompts"] == sum(m.get("engines/rerouted_prompts", 0) for m in rollouts)
        row = next(line for line in report.splitlines() if line.startswith(f"| {name} |"))
        assert f"| {run['workload']['sft_tokens_per_s']:.1f} |" in row, row
        if run.get("fault"):
            assert f"| {run['fault']['recover_s']:.1f} (600) |" in row, row
    for plot in ("throughput_vs_nodes.png", "timeline_3_nodes.png"):
        assert (folder / plot).stat().st_size > 0 and plot in report


def test_a_too_tight_bound_fails_the_drill_naming_the_fault_and_the_measured_time(drill, prefect_api):
    record, folder = drill
    measured = runs_of(record)["node_lost@sft"]["fault"]["recover_s"]
    done = subprocess.run(
        [sys.executable, "-m", "flows.cli", "drill", PLAN, *ON_TEST_POOL, "faults.0.recover_within_s=0.5",
         "--judge", str(folder / "drill.json")],
        capture_output=True, text=True, timeout=300, check=False, cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert (f"drill problem: node_lost@sft at 3 nodes: recovered in {measured:.1f} s, over its bound "
            "recover_within_s=0.5 s") in done.stderr, done.stderr
    assert "engine_killed" not in done.stderr
