"""The flow-lifetime GRPO trainer group (`grpo.trainer_lifetime: flow`, forge_core.run.trainer_group) on real
flows, against the stage lifetime (`grpo.trainer_lifetime: stage`, each iteration its own torchrun launch).

On the tiny config with a reward that varies within groups (so GRPO really updates the policy):

- a real post-train flow process with the defaults (its own embedded Ray, its own launch registry): one trainer
  group of 1 node x 2 ranks serves both iterations, and each trained policy reaches the run's engine from its
  ranks (forge_core.run.weight_sync), not from the store; no process of the run (engines, ranks, Ray itself)
  survives the flow;
- its two GRPO iterations again on its SFT policy and rollouts (a copy of its store), in this process on the
  test run's Ray cluster (tests/ray_cluster.py), with stage lifetime: the same committed policies, bitwise, and
  the same step metrics (a stage loads the export and the committed optimizer state, where the flow run's group
  trained on with the engine and AdamW of its first iteration);
- a run that ends after iteration 0 and a new run of iteration 1: the new group loads the committed policy and
  its final AdamW state from the store and commits the same policy, bitwise;
- a user error inside the group fails the stage FATAL with the worker's message and leaves no group;
- the same iterations by a trainer group of one rank on each of two nodes of the pool, with a rank SIGKILLed
  mid-iteration: the task's retry places a new group, which resumes from the in-stage checkpoint and goes on
  with its engine and AdamW; the policies and step metrics are again the flow run's, bitwise;
- a rank SIGKILLed as it writes iteration 0's final AdamW state behind that stage's commit: iteration 1 runs on a
  new group, which first trains iteration 0 again to rebuild the lost state; the policies are the flow run's;
- two engines on two pool nodes take each policy from the rank on their node (through shared memory when they
  share it), and an engine whose vLLM is killed mid-transfer is restarted from the store and rejoins the next.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from prefect import flow
from prefect_readers import settled_task_runs

from forge_core.config import config_from_dict, config_to_json, load_config
from forge_core.launch import Outcome
from forge_core.launch.process_tree import processes_with_launch_id
from forge_core.run.plan import plan_stage
from forge_core.run.resources import FlowResources
from forge_core.run.runner import Cancel
from forge_core.run.runners import runner_for
from forge_core.run.spec import write_spec
from forge_core.storage import ObjectStore
from tasks import stage_task
from tests.ray_cluster import POOL

pytestmark = pytest.mark.integration

CONFIG = "configs/tiny_test.yaml"
FLOW_TIMEOUT_S = 1500.0
# Partial credit, so rewards vary inside a group and GRPO really updates the tiny SFT policy.
REWARDS = 'rollout.rewards=[{"name": "per_digit", "weight": 1.0}, {"name": "answer_format", "weight": 0.5}]'
# A KL term: iteration 1 scores its batch under the SFT reference, a swap of weights its kept engine undoes.
COMMON = [REWARDS, "grpo.iterations=2", "rollout.engine_lifetime=flow", "eval.num_prompts=4", "grpo.loss.kl_coef=0.05"]
STAGE_DONE = re.compile(r"stage (grpo-\d+): done in ([0-9.]+)s")


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _cmdline(proc: psutil.Process) -> str | None:
    try:
        return " ".join(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        return None


def _run_processes(flow_proc: psutil.Process, registry: Path) -> dict[int, str]:
    """Every process of the flow run now: its descendants (its embedded Ray's processes and their workers among
    them), and every process of a launch in its registry."""
    procs = []
    try:
        procs += flow_proc.children(recursive=True)
    except psutil.NoSuchProcess:
        pass
    for record in registry.glob("*.json"):
        procs += processes_with_launch_id(record.stem)
    return {p.pid: cmd for p in procs if (cmd := _cmdline(p)) is not None}


class FlowRun:
    def __init__(self, root: Path, returncode: int, log: str, seen: dict[int, str]):
        self.root, self.returncode, self.log, self.seen = root, returncode, log, seen
        self.store = ObjectStore(f"file://{root}/store")

    def grpo_uri(self, iteration: int) -> str:
        found = [
            uri
            for uri in self.store.list_committed("grpo")
            if self.store.read_manifest(uri).metrics.get("iteration") == iteration
        ]
        assert len(found) == 1, (iteration, found)
        return found[0]

    def grpo_seconds(self) -> dict[str, float]:
        return {label: float(s) for label, s in STAGE_DONE.findall(self.log)}


def _post_train(prefect_api: str, root: Path, overrides: list[str], env: dict | None = None) -> FlowRun:
    """Run the post-train flow in its own process, recording its processes every half second."""
    registry = root / "launch-registry"
    registry.mkdir(parents=True, exist_ok=True)
    full_env = {
        **os.environ,
        "PREFECT_API_URL": prefect_api,
        "FORGE_LAUNCH_REGISTRY": str(registry),  # this run's launches only, not a concurrent demo's
        **(env or {}),
    }
    overrides = [f"storage.root=file://{root}/store", f"logging.dir={root}/runs", *COMMON, *overrides]
    log_path = root / "flow.log"
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "flows.post_train", CONFIG, *overrides],
            env=full_env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    seen: dict[int, str] = {}
    try:
        flow_proc = psutil.Process(proc.pid)
        deadline = time.monotonic() + FLOW_TIMEOUT_S
        while proc.poll() is None and time.monotonic() < deadline:
            seen |= _run_processes(flow_proc, registry)
            time.sleep(0.5)
        assert proc.poll() is not None, f"the flow did not end in {FLOW_TIMEOUT_S} s"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return FlowRun(root, proc.returncode, log_path.read_text(), seen)


def _copy_store(source: FlowRun, root: Path) -> ObjectStore:
    """A new store with `source`'s committed data, SFT and rollouts, where its GRPO stages are not committed."""
    for kind in ("data", "sft", "rollouts"):
        shutil.copytree(source.root / "store" / kind, root / "store" / kind)
    return ObjectStore(f"file://{root}/store")


def _policy_bytes(store: ObjectStore, grpo_uri: str) -> dict[str, bytes]:
    policy = store.reader(store.join(grpo_uri, "policy"))
    weights = {rel: policy.read_bytes(rel) for rel in policy.files() if rel.endswith(".safetensors")}
    assert weights, f"{grpo_uri}: its policy lists no weights"
    return weights


def _step_metrics(store: ObjectStore, grpo_uri: str) -> list[dict]:
    """The per-step metrics of an iteration that do not depend on timing."""
    steps = store.reader(grpo_uri).read_json("train_summary.json")["steps"]
    return [{k: v for k, v in step.items() if not re.search(r"time|_s$|per_s|wall", k)} for step in steps]


@flow(name="grpo-chain")
def grpo_chain(
    config_json: str, sft_uri: str, rollouts: list[str], retries: int, first_iteration: int = 0
) -> list[tuple[str, float]]:
    """GRPO iterations on given rollout batches, from `sft_uri` (or any committed policy), with the flow's own stop
    hooks; (policy, task seconds) each."""
    cfg = config_from_dict(json.loads(config_json))
    grpo = stage_task(cfg, "grpo").with_options(retries=retries, retry_delay_seconds=0)
    policy, out = sft_uri, []
    with FlowResources.of(cfg):
        for iteration, rollouts_uri in enumerate(rollouts, start=first_iteration):
            started = time.monotonic()
            policy = grpo(cfg, "grpo", {"policy": policy, "rollouts": rollouts_uri}, {"iteration": iteration})
            out.append((policy, time.monotonic() - started))
    return out


def _chain_on_copy(source: FlowRun, root: Path, lifetime: str, retries: int = 0, extra: tuple[str, ...] = ()):
    """The source run's two GRPO iterations again, on its own SFT policy and rollouts, in a copy of its store."""
    store = _copy_store(source, root)
    cfg = load_config(
        CONFIG,
        [
            f"storage.root={store.root}",
            f"logging.dir={root}/runs",
            *COMMON,
            f"grpo.trainer_lifetime={lifetime}",
            *extra,
        ],
    )
    rollouts = [
        source.store.read_manifest(source.grpo_uri(i))
        .inputs["rollouts"]
        .uri.replace(source.store.root, store.root)
        for i in (0, 1)
    ]
    sft_uri = store.list_committed("sft")[0]
    state = grpo_chain(config_to_json(cfg), sft_uri, rollouts, retries, return_state=True)
    return store, state


def _assert_nothing_survives(run: FlowRun) -> None:
    alive = {pid: cmd for pid, cmd in run.seen.items() if _alive(pid)}
    assert alive == {}, f"processes left alive after the flow: {alive}"


@pytest.fixture(scope="module")
def flow_lifetime_run(prefect_api, tmp_path_factory) -> FlowRun:
    return _post_train(prefect_api, tmp_path_factory.mktemp("trainer-flow"), ["grpo.trainer_lifetime=flow"])


def test_one_group_serves_every_iteration_and_nothing_survives(flow_lifetime_run):
    run = flow_lifetime_run
    assert run.returncode == 0, run.log[-4000:]
    assert run.log.count("started the run's embedded Ray cluster") == 1, run.log[-4000:]
    assert run.log.count("grpo: placing the run's trainer group, 1 node(s) x 2 rank(s)") == 1, run.log[-4000:]
    assert "forge_core.run grpo --spec" not in "\n".join(run.seen.values())  # no per-stage GRPO worker
    assert any("raylet" in cmd for cmd in run.seen.values()), run.seen  # the embedded Ray was the flow's own
    assert "stopped the run's trainer group" in run.log
    for iteration in (0, 1):  # each stage records its wait for the last one's state write (0 when none was left)
        assert run.store.read_manifest(run.grpo_uri(iteration)).metrics["phase/state_wait_s"] >= 0
    _assert_nothing_survives(run)


def test_engines_take_each_trained_policy_from_the_trainer_group(flow_lifetime_run):
    """rollout.weight_sync.transport=group (the default) in grpo.mode=sync: each GRPO iteration's policy reaches
    the run's engine from the trainer ranks while rank 0 writes its export, never through the store; the engine
    serves it under the committed version, and the next stages sample with it without a sync of their own."""
    from forge_core.artifacts.policy import committed_policy_version

    run = flow_lifetime_run
    assert run.returncode == 0, run.log[-4000:]
    for iteration in (0, 1):
        uri = run.grpo_uri(iteration)
        assert f"weight sync of {uri} from rank 0 to engine 0: done alongside its export" in run.log, run.log[-4000:]
        assert f"policy {uri}/policy at" not in run.log  # no engine fetched it from the store
        metrics = run.store.read_manifest(uri).metrics
        # The push and rank 0's write and commit of the export both ran within the export's phase.
        assert 0 < metrics["phase/push_s"] <= metrics["phase/export_s"]
        assert 0 < metrics["phase/commit_s"] <= metrics["phase/export_s"]
    sampled = run.store.read_manifest(run.grpo_uri(1)).inputs["rollouts"].uri
    versions = set(run.store.reader(sampled).read_table("rollouts.parquet").column("policy_version").to_pylist())
    assert versions == {committed_policy_version(run.store, run.grpo_uri(0))}
    # Both stages that sample with iteration 0's policy (its evaluation, then the next rollouts) found the engine
    # serving it already: neither paid a sync.
    samplers = sorted(
        (m for kind in ("eval", "rollouts") for m in map(run.store.read_manifest, run.store.list_committed(kind))
         if m.inputs.get("policy") and m.inputs["policy"].uri == run.grpo_uri(0)),
        key=lambda m: m.committed_at,
    )  # fmt: skip
    assert [m.kind for m in samplers] == ["eval", "rollouts"], [(m.kind, m.committed_at) for m in samplers]
    assert [m.metrics["phase/sync_s"] for m in samplers] == [0.0, 0.0]


def _assert_same_policies_as_the_flow_run(
    store: ObjectStore, results: list, flow_run: FlowRun, kept: bool, repaired: bool = False
) -> None:
    """Each iteration's step metrics and committed policy are the flow run's, bitwise. With `kept` (a trainer
    group's chain), iteration 1 goes on with the engine and AdamW that trained iteration 0 (`repaired`: that trained
    iteration 0 again to rebuild its lost state); otherwise (a stage per iteration) it loads the export and the
    committed optimizer state."""
    for iteration, (uri, _) in enumerate(results):
        reference = flow_run.grpo_uri(iteration)
        assert _step_metrics(store, uri) == _step_metrics(flow_run.store, reference)
        assert _policy_bytes(store, uri) == _policy_bytes(flow_run.store, reference)
        went_on = kept and iteration == 1
        metrics = store.read_manifest(uri).metrics
        assert metrics["model_init"] == ("kept" if went_on else "export")
        # grpo.optimizer_state=carry: iteration 1's AdamW goes on from iteration 0's, held by the group's ranks
        # or read from iteration 0's committed final checkpoint; the same policy either way (above).
        carried = "repaired" if repaired else "kept" if went_on else "checkpoint"
        assert metrics["optimizer_init"] == ("fresh" if iteration == 0 else carried)
        # A kept engine's stage reads the input policy's config and tokenizer from the store, not its weights.
        weights = sum(map(len, _policy_bytes(store, store.read_manifest(uri).inputs["policy"].uri).values()))
        assert (metrics["load/policy_bytes_read"] < weights) == went_on, (metrics["load/policy_bytes_read"], weights)


def test_stage_lifetime_commits_the_same_policy(flow_lifetime_run, prefect_api, ray_cluster, tmp_path):
    """The flow run's two iterations again with a torchrun launch per iteration: the same policies, bitwise."""
    flow_run = flow_lifetime_run
    assert flow_run.returncode == 0, flow_run.log[-4000:]
    store, state = _chain_on_copy(flow_run, tmp_path / "stage", "stage")
    assert state.is_completed(), state.message
    results = state.result()
    _assert_same_policies_as_the_flow_run(store, results, flow_run, kept=False)
    assert ray_cluster.live_actors() == []
    updates = [
        m for i in (0, 1) for m in _step_metrics(flow_run.store, flow_run.grpo_uri(i)) if not m.get("skipped")
    ]
    assert updates, "no GRPO step updated the policy: the comparison would prove nothing"
    timings = {"stage": [round(seconds, 2) for _, seconds in results]}
    (tmp_path / "grpo_task_seconds.json").write_text(json.dumps(timings))
    print(f"GRPO task wall seconds per iteration: {timings}; in the flow run: {flow_run.grpo_seconds()}")


def test_a_new_run_goes_on_from_the_policy_the_store_committed(flow_lifetime_run, prefect_api, ray_cluster, tmp_path):
    """A run that ends after iteration 0 (its trainer group with it, as a killed flow run's) and a new run of
    iteration 1: the new group holds nothing, so it loads iteration 0's committed policy from the store
    (`model_init: export`), and commits the uninterrupted run's iteration-1 policy, bitwise."""
    flow_run = flow_lifetime_run
    assert flow_run.returncode == 0, flow_run.log[-4000:]
    store = _copy_store(flow_run, tmp_path / "resumed")
    cfg = load_config(
        CONFIG, [f"storage.root={store.root}", f"logging.dir={tmp_path}/runs", *COMMON, "grpo.trainer_lifetime=flow"]
    )
    rollouts = [
        flow_run.store.read_manifest(flow_run.grpo_uri(i)).inputs["rollouts"].uri.replace(flow_run.store.root, store.root)
        for i in (0, 1)
    ]
    [(first, _)] = grpo_chain(config_to_json(cfg), store.list_committed("sft")[0], rollouts[:1], 0)
    assert ray_cluster.live_actors() == []  # the first run's group ended with it
    [(second, _)] = grpo_chain(config_to_json(cfg), first, rollouts[1:], 0, first_iteration=1)
    assert store.read_manifest(second).metrics["model_init"] == "export"
    assert store.read_manifest(second).metrics["optimizer_init"] == "checkpoint"  # the store's, as the group's was
    assert store.read_manifest(second).metrics["optimizer/adam_steps"] > store.read_manifest(first).metrics[
        "optimizer/adam_steps"
    ]
    assert store.read_manifest(second).inputs["policy"].uri == first
    reference = flow_run.grpo_uri(1)
    assert flow_run.store.read_manifest(reference).metrics["model_init"] == "kept"
    assert _step_metrics(store, second) == _step_metrics(flow_run.store, reference)
    assert _policy_bytes(store, second) == _policy_bytes(flow_run.store, reference)


def test_user_error_in_the_group_is_fatal_and_ends_it(flow_lifetime_run, ray_cluster, tmp_path):
    run = flow_lifetime_run
    assert run.returncode == 0, run.log[-4000:]
    cfg = load_config(
        CONFIG,
        [
            f"storage.root={run.store.root}",
            f"logging.dir={tmp_path}/runs",
            *COMMON,
            "grpo.trainer_lifetime=flow",
        ],
    )
    sft_uri = run.store.list_committed("sft")[0]
    data_uri = run.store.list_committed("data")[0]
    # A data artifact where the rollouts should be: the worker's own input check raises ValueError.
    plan = plan_stage(cfg, run.store, "grpo", inputs={"policy": sft_uri, "rollouts": data_uri}, params={})
    write_spec(run.store, plan.spec)
    lines: list[str] = []
    result = runner_for(cfg, "grpo").run(plan, lines.append)
    assert result.outcome is Outcome.FATAL, result
    assert "ValueError" in result.reason and "inputs.rollouts" in result.reason, result.reason
    assert not run.store.is_committed(plan.output_uri)
    resources = FlowResources.of(cfg)
    assert resources.stop_trainer_group(failing=False) == ""  # it ended with the failed order: nothing to stop
    resources.close()
    assert ray_cluster.live_actors() == [] and ray_cluster.stage_processes() == []


# ---- the same iterations by a trainer group on two nodes of a pool ---------------------------------------------

ON_TWO_POOL_NODES = [
    "launch.pool_wait_s=600",
    f"launch.grpo.pool={POOL}",
    "launch.grpo.nnodes=2",
    "launch.grpo.nproc_per_node=1",  # world size 2, as the flow run's 1 node x 2 ranks: the same artifacts' keys
]


def test_trainer_group_on_two_nodes_with_a_rank_killed_is_retried_by_a_new_group_which_resumes(
    flow_lifetime_run, ray_cluster, prefect_api, tmp_path, monkeypatch
):
    """The two iterations as orders to a trainer group of one rank on each of two Ray nodes, whose rank 1 SIGKILLs
    itself after iteration 0's step 2 (before that step's checkpoint): the order fails retryably, the task's retry
    places a new group, which resumes from step 1 and then serves iteration 1 too, going on with its engine and
    AdamW. Both commit the flow run's (1 node x 2 ranks) policies and step metrics, bitwise, and nothing is left
    of either group."""
    import ray

    flow_run = flow_lifetime_run
    assert flow_run.returncode == 0, flow_run.log[-4000:]
    marker = tmp_path / "fault-fired"
    monkeypatch.setenv("FORGE_FAULT", "kill_rank:1:2@grpo")
    monkeypatch.setenv("FORGE_FAULT_ONCE", str(marker))
    store, state = _chain_on_copy(flow_run, tmp_path / "killed", "flow", retries=1, extra=ON_TWO_POOL_NODES)
    assert state.is_completed(), state.message
    assert marker.exists()
    runs = settled_task_runs(state.state_details.flow_run_id, count=2)
    assert sorted(run.run_count for run in runs) == [1, 2], runs  # iteration 0 was retried once
    results = state.result()
    assert store.read_manifest(results[0][0]).metrics["resumed_from_step"] == 1
    _assert_same_policies_as_the_flow_run(store, results, flow_run, kept=True)
    placements = [store.read_manifest(uri).placement for uri, _ in results]
    assert placements[0]["served_by"] == "trainer" and placements[0] == placements[1], placements
    assert len({node["node_id"] for node in placements[0]["nodes"]}) == 2, placements[0]
    assert all(t["state"] == "REMOVED" for t in ray.util.placement_group_table().values())
    assert ray_cluster.live_actors() == []


def test_a_group_killed_while_it_writes_a_state_behind_the_commit_is_repaired_by_the_next_iteration(
    flow_lifetime_run, ray_cluster, prefect_api, tmp_path, monkeypatch
):
    """Rank 1 SIGKILLs itself as it starts writing iteration 0's final AdamW state behind that stage's commit:
    iteration 0 is committed without its state. Iteration 1 runs on a new group (after a retryable failure when its
    order reached the broken group first), which trains iteration 0 again to rebuild the state and goes on with
    that engine. The policies and step metrics are the flow run's, bitwise, and nothing is left of either group."""
    import ray

    from forge_core.engine import checkpoint_uri

    flow_run = flow_lifetime_run
    assert flow_run.returncode == 0, flow_run.log[-4000:]
    state_step = int(flow_run.store.read_manifest(flow_run.grpo_uri(0)).metrics["optimizer/state_step"])
    marker = tmp_path / "fault-fired"
    monkeypatch.setenv("FORGE_FAULT", f"kill_saving:1:{state_step}@grpo")
    monkeypatch.setenv("FORGE_FAULT_ONCE", str(marker))
    store, state = _chain_on_copy(flow_run, tmp_path / "killed-saving", "flow", retries=1)
    assert state.is_completed(), state.message
    assert marker.exists()
    results = state.result()
    first_uri = results[0][0]
    assert store.read_manifest(first_uri).metrics["optimizer/state_step"] == state_step
    assert store.is_committed(checkpoint_uri(store, first_uri, state_step))  # rebuilt
    assert store.read_manifest(results[1][0]).metrics["phase/repair_s"] > 0
    _assert_same_policies_as_the_flow_run(store, results, flow_run, kept=True, repaired=True)
    assert all(t["state"] == "REMOVED" for t in ray.util.placement_group_table().values())
    assert ray_cluster.live_actors() == []


def test_trainer_group_stopped_while_a_rank_hangs_names_it_and_leaves_nothing(
    flow_lifetime_run, ray_cluster, tmp_path, monkeypatch
):
    """Rank 1 hangs after step 1 while rank 0 goes on to the step's checkpoint and waits for it there; a cancel
    (as a lost lease or the flow's cancel would send) ends the whole group, the result names rank 1 from the
    ranks' heartbeats, and no actor or placement group is left."""
    import ray

    flow_run = flow_lifetime_run
    assert flow_run.returncode == 0, flow_run.log[-4000:]
    marker = tmp_path / "fault-fired"
    monkeypatch.setenv("FORGE_FAULT", "hang_rank:1:1@grpo")
    monkeypatch.setenv("FORGE_FAULT_ONCE", str(marker))
    store = _copy_store(flow_run, tmp_path / "hung")
    overrides = [f"storage.root={store.root}", f"logging.dir={tmp_path}/runs", *COMMON, "grpo.trainer_lifetime=flow"]
    cfg = load_config(CONFIG, [*overrides, *ON_TWO_POOL_NODES])
    rollouts_uri = flow_run.store.read_manifest(flow_run.grpo_uri(0)).inputs["rollouts"].uri
    inputs = {"policy": store.list_committed("sft")[0], "rollouts": rollouts_uri.replace(flow_run.store.root, store.root)}
    plan = plan_stage(cfg, store, "grpo", inputs=inputs, params={"iteration": 0})
    write_spec(store, plan.spec)
    cancel = Cancel()

    def rank_1_is_behind() -> bool:
        group = FlowResources.of(cfg).trainer_group
        if not marker.exists() or group is None:
            return False
        beats, _ = group.probe()
        return 0 in beats and 1 in beats and beats[0].seq > beats[1].seq

    def cancel_once_hung() -> None:
        # Only once rank 0's heartbeat is past rank 1's (the state the note describes), however fast the machine.
        deadline = time.monotonic() + FLOW_TIMEOUT_S
        while not rank_1_is_behind() and time.monotonic() < deadline:
            time.sleep(0.2)
        cancel.request("cancelled by the test")

    canceller = threading.Thread(target=cancel_once_hung, daemon=True)
    canceller.start()
    with FlowResources.of(cfg) as resources:
        result = runner_for(cfg, "grpo").run(plan, lambda line: None, cancel)
        assert resources.trainer_group is None  # the stopped group was ended and forgotten
    canceller.join()
    assert marker.exists() and result.outcome is Outcome.CANCELLED, result
    assert result.stall.startswith("rank 1 made no progress since step 1"), result.stall
    assert not store.is_committed(plan.output_uri)
    assert all(t["state"] == "REMOVED" for t in ray.util.placement_group_table().values())
    assert ray_cluster.live_actors() == []


# ---- weight sync to engines on two nodes ---------------------------------------------------------------------

ENGINES_ON_TWO_POOL_NODES = [
    "rollout.num_engines=2",
    f"launch.rollout.pool={POOL}",
    "launch.rollout.nnodes=2",
    "rollout.weight_sync.bucket_mb=1",  # the tiny policy's 1.6 MB in 2 buckets: a kill after the first lands mid-transfer
]


def test_two_engines_on_two_nodes_take_each_policy_from_the_group_and_a_killed_one_rejoins(
    flow_lifetime_run, ray_cluster, tmp_path, monkeypatch, caplog
):
    """Two engines on two pool nodes and a trainer group of one rank on each of two pool nodes, both held by one
    FlowResources as a flow run holds them (grpo.mode=sync: each GRPO order pushes its policy while it is
    exported). Iteration 0: one engine's vLLM SIGKILLs itself after the first bucket; the stage commits all the
    same, the group lives on, and the engine whose transfer failed is restarted from the store at the next serve.
    Iteration 1: both engines, the restarted one included, receive the policy from the rank on their own node
    (rank 0 where none; through shared memory when a rank's engines all share its node) during the stage, and
    serve its committed version before they sample, with nothing left to push or fetch."""
    from forge_core.artifacts.policy import policy_ref
    from forge_core.rollout import prompts_from_table
    from forge_core.run.weight_sync import trainer_pusher

    flow_run = flow_lifetime_run
    assert flow_run.returncode == 0, flow_run.log[-4000:]
    marker = tmp_path / "fault-fired"
    monkeypatch.setenv("FORGE_FAULT", "kill_vllm_transfer:1")
    monkeypatch.setenv("FORGE_FAULT_ONCE", str(marker))
    caplog.set_level(logging.INFO, logger="forge_core")
    store = _copy_store(flow_run, tmp_path / "sync")
    overrides = [f"storage.root={store.root}", f"logging.dir={tmp_path}/runs", *COMMON, "grpo.trainer_lifetime=flow"]
    cfg = load_config(CONFIG, [*overrides, *ON_TWO_POOL_NODES, *ENGINES_ON_TWO_POOL_NODES])
    rollouts = [
        flow_run.store.read_manifest(flow_run.grpo_uri(i)).inputs["rollouts"].uri.replace(flow_run.store.root, store.root)
        for i in (0, 1)
    ]
    prompts = prompts_from_table(store.reader(store.list_committed("data")[0]).read_table("rl_prompts.parquet"))[:4]
    policy_uri = store.list_committed("sft")[0]
    with FlowResources.of(cfg) as resources:
        with resources.engine_actors(seed=0) as engines:
            engines.serve(policy_ref(store, policy_uri))  # both engines up on the SFT policy, from the store
            engine_nodes = {node["node_rank"]: node["node_id"] for node in engines.placement()["nodes"]}
        assert len(set(engine_nodes.values())) == 2, engine_nodes
        for iteration, rollouts_uri in enumerate(rollouts):
            inputs = {"policy": policy_uri, "rollouts": rollouts_uri}
            plan = plan_stage(cfg, store, "grpo", inputs=inputs, params={"iteration": iteration})
            write_spec(store, plan.spec)
            caplog.clear()
            lines: list[str] = []
            result = runner_for(cfg, "grpo").run(plan, lines.append, Cancel())
            assert result.outcome is Outcome.SUCCESS, result  # a failed push does not fail the stage
            policy_uri = plan.output_uri
            policy = policy_ref(store, policy_uri)
            with resources.lock:
                assert resources.trainer_group is not None  # nor does it end the group
                ranks_on = {rank.place.node_id: k for k, rank in reversed(list(enumerate(resources.trainer_group.ranks)))}
            pushes = [line for line in lines if line.startswith(f"weight sync of {policy_uri} from rank ")]
            with resources.engine_actors(seed=0) as engines:
                router = engines.serve(policy, "rollout", push=trainer_pusher(resources, policy))
                served = list(engines.slots)
                assert router.policy_version == policy.version and len(router.live) == 2
                samples = router.generate(prompts, cfg.rollout.sampling, seed=iteration)  # refused by a stale engine
                assert len(samples) == len(prompts) * cfg.rollout.sampling.group_size
            if iteration == 0:
                assert marker.exists(), "the fault never fired: nothing was tested"
                failed = [line for line in pushes if ": failed (" in line]
                assert len(failed) == 1 and "restarted from the store" in failed[0], pushes
                assert "its vLLM died (interrupted weight transfer" in caplog.text, caplog.text  # restarted
                continue
            expected: dict[int, list[int]] = {}
            for index in sorted(engine_nodes):
                expected.setdefault(ranks_on.get(engine_nodes[index], 0), []).append(index)
            node_of_rank = {k: node for node, k in ranks_on.items()}
            # A rank whose engines all share its node sends through shared memory, else over the group.
            senders = "; ".join(
                f"rank {k} -> {', '.join(f'engine {i}' for i in expected[k])}"
                + (", shared memory" if all(engine_nodes[i] == node_of_rank[k] for i in expected[k]) else "")
                for k in sorted(expected)
            )
            assert f"weight sync: {policy_uri} goes to 2 engine(s) while it is exported ({senders})" in caplog.text
            assert sorted(pushes) == sorted(
                f"weight sync of {policy_uri} from rank {k} to {', '.join(f'engine {i}' for i in expected[k])}: "
                "done alongside its export" for k in expected
            ), pushes
            # The serve found both engines on it already: nothing pushed, nothing reloaded from the store.
            assert "from the trainer group" not in caplog.text
            assert [engine.reload_s for engine in served] == [0.0, 0.0], [engine.reload_s for engine in served]
    assert ray_cluster.live_actors() == []
