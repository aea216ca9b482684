"""The long-lived engine service (forge_core.rollout.service) and the stages' `engine_lifetime: flow`.

Real services (`python -m forge_core.rollout.service`, an in-process vLLM engine each) on the tiny policies of
conftest.py. The tests share one state folder, so a service one test started is reused by the next, as the
stages of a flow do: in file order two engines start in all (the first test's, and the one a rollout worker
starts after the kill). Each test still starts what it needs when run alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import stat
import subprocess
import sys
import time

import psutil
import pytest

from forge_core.artifacts.policy import weights_version
from forge_core.config import config_from_dict, config_to_dict
from forge_core.launch import LaunchSpec, launch, registry
from forge_core.launch.process_tree import ProcessTree, is_alive, processes_with_launch_id
from forge_core.launch.spec import LAUNCH_ID_ENV
from forge_core.rollout import ROLLOUTS_TABLE, prompts_from_table
from forge_core.rollout.lifetime import engine_state_dir, stop_flow_engines
from forge_core.rollout.service import (
    EngineService,
    PolicyVersionMismatch,
    ServicePaths,
    ServiceRecord,
    end_stale_service,
    healthy_client,
    prepare_state_dir,
    read_record,
    stop_services,
    write_record,
)
from forge_core.run.plan import StagePlan
from forge_core.run.rollout import plan_rollout
from forge_core.run.runners import runner_for
from forge_core.run.scaffold import stage_context
from forge_core.run.spec import StageSpec, write_spec
from forge_core.storage import ObjectStore
from tests.rollout.conftest import POLICY_B_KEY, SAMPLING, run_config_dict

GREEDY = dataclasses.replace(SAMPLING, group_size=1, temperature=0.0)


# ---- fixtures -------------------------------------------------------------------------------------------


# The flow run the module's stages belong to: its engines live in engine_state_dir(run_cfg(...)).
RUN_ID = "test-engine-service-run"


def flow_run_config(store_root: str, engines_root, run_id: str = RUN_ID) -> dict:
    """A stage config with flow engines under `engines_root`, in flow run `run_id`."""
    config = run_config_dict(store_root, engine_lifetime="flow", engine_state_dir=str(engines_root))
    return {**config, "launch": {"run_id": run_id}}


@pytest.fixture(scope="module")
def engines_root(tmp_path_factory):
    return tmp_path_factory.mktemp("engines")


@pytest.fixture(scope="module")
def state_dir(world, engines_root, registry_dir):
    """The module's flow run's engine folder (`<rollout.engine_state_dir>/run-<hash>`)."""
    folder = engine_state_dir(config_from_dict(flow_run_config(world.store_root, engines_root)))
    yield folder
    stop_services(folder)


@pytest.fixture(scope="module")
def rollout_cfg(world):
    return config_from_dict(run_config_dict(world.store_root)).rollout


@pytest.fixture(scope="module")
def prompts(world):
    table = world.store.reader(world.data_uri).read_table("rl_prompts.parquet")
    return prompts_from_table(table.slice(0, 6))


def service_processes(pid: int, launch_id: str) -> list[psutil.Process]:
    found = processes_with_launch_id(launch_id)
    with_root = [psutil.Process(pid)] if psutil.pid_exists(pid) else []
    return [p for p in {q.pid: q for q in found + with_root}.values() if is_alive(p)]


def tokens(samples) -> list[tuple[int, ...]]:
    return [s.response_ids for s in samples]


# ---- policy version -------------------------------------------------------------------------------------


def commit_files(store: ObjectStore, uri: str, files: dict[str, bytes]) -> str:
    writer = store.writer(uri, kind="policy", stage="sft")
    for rel, data in files.items():
        writer.write_bytes(rel, data)
    writer.commit(config={}, inputs={}, metrics={})
    return uri


def test_policy_version_is_the_checksum_of_weights_and_config(tmp_path):
    store = ObjectStore(f"file://{tmp_path}/store")
    base = {"model.safetensors": b"weights-1", "config.json": b"{}", "tokenizer.json": b"tok-1"}
    versions = {
        name: weights_version(
            store.read_manifest(commit_files(store, store.artifact_uri("policy", name), files))
        )
        for name, files in {
            "base": base,
            "other-tokenizer": {**base, "tokenizer.json": b"tok-2"},
            "other-weights": {**base, "model.safetensors": b"weights-2"},
            "other-config": {**base, "config.json": b'{"a": 1}'},
        }.items()
    }
    # Same weights and config in another artifact (another manifest): same version; weights/config: another.
    assert versions["other-tokenizer"] == versions["base"]
    assert len({versions["base"], versions["other-weights"], versions["other-config"]}) == 3
    no_weights = commit_files(store, store.artifact_uri("policy", "none"), {"config.json": b"{}"})
    with pytest.raises(ValueError, match=r"no \*\.safetensors file"):
        weights_version(store.read_manifest(no_weights), "inputs.policy=x")


# ---- state folder, stale records, process ownership (no vLLM) --------------------------------------------


def test_state_dir_must_be_private_and_short(tmp_path):
    paths = prepare_state_dir(tmp_path / "engines")
    assert stat.S_IMODE(paths.state_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE(paths.authkey.stat().st_mode) == 0o600 and len(paths.authkey.read_bytes()) == 32
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    with pytest.raises(ValueError, match=r"rollout.engine_state_dir=.*shared: mode 0o755 .*chmod go-rwx"):
        prepare_state_dir(shared)
    with pytest.raises(ValueError, match=r"rollout.engine_state_dir=.*more than a Unix socket allows"):
        prepare_state_dir(tmp_path / ("x" * 120))


def test_a_stale_record_and_socket_are_cleaned(tmp_path):
    paths = prepare_state_dir(tmp_path / "engines")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    create_time = psutil.Process(gone.pid).create_time()
    gone.wait()
    write_record(paths, ServiceRecord(gone.pid, create_time, "engine-gone", status="ready"))
    paths.socket.write_bytes(b"")  # a dead service's socket file
    assert healthy_client(paths, timeout_s=5) is None
    assert end_stale_service(paths) == []
    assert read_record(paths) is None and not paths.socket.exists()


def test_the_launcher_leaves_a_process_of_another_launch_alone():
    """A stage worker's launcher must not end the engine service that worker started (process_tree.py)."""
    script = "sleep 60 & FORGE_LAUNCH_ID=engine-other sleep 61 & wait"
    root = subprocess.Popen(["bash", "-c", script], env={**os.environ, LAUNCH_ID_ENV: "stage-launch"})
    children: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 30
        while len(children) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
            children = [p for p in psutil.Process(root.pid).children() if p.cmdline()[:1] == ["sleep"]]
        other = [p for p in children if p.cmdline()[-1] == "61"]
        assert len(children) == 2 and len(other) == 1
        ProcessTree(root.pid, "stage-launch").terminate(grace_s=2)
        assert is_alive(other[0]), "the other launch's process was ended"
        assert not any(is_alive(p) for p in children if p not in other)
    finally:
        for proc in children:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        root.kill()
        root.wait(timeout=10)


# ---- the service (real vLLM) ----------------------------------------------------------------------------


@pytest.mark.integration
def test_version_mismatch_is_rejected(state_dir, rollout_cfg, policies, prompts):
    """A client expects the version it connected to or loaded: once another client loads other weights, its
    requests are refused (never silently the wrong policy), and the service goes on serving."""
    policy_a, policy_b = policies
    assert policy_a.version != policy_b.version
    with EngineService.ensure(state_dir, rollout_cfg, policy_a.local_dir, policy_a.version) as client:
        assert client.ping()["policy_version"] == policy_a.version
        other = healthy_client(ServicePaths(state_dir))  # a second client, expecting A too
        other.reload(policy_b.local_dir, policy_b.version)  # the service serves B now: `client` is stale
        with pytest.raises(PolicyVersionMismatch, match=rf"serves policy version {policy_b.version[:16]} "):
            client.generate(prompts, GREEDY, seed=0)
        client.reload(policy_a.local_dir, policy_a.version)  # and back to A: `other` (expecting B) is stale
        pattern = rf"serves policy version {policy_a.version[:16]} .*expects {policy_b.version[:16]}"
        with pytest.raises(PolicyVersionMismatch, match=pattern):
            other.generate(prompts, GREEDY, seed=0)
        other.close()
        # The refusal leaves the service serving: the right version still generates.
        assert len(client.generate(prompts, GREEDY, seed=0)) == len(prompts)


def stage_spec(world, engines_root, stage: str, policy_stage_uri: str, key: str) -> StageSpec:
    config = flow_run_config(world.store_root, engines_root)
    kind = "rollouts" if stage == "rollout" else "eval"
    return StageSpec(
        stage=stage,
        config=config_to_dict(config_from_dict(config)),
        inputs={"policy": policy_stage_uri, "data": world.data_uri},
        output_uri=world.store.artifact_uri(kind, key),
        params={"iteration": 1} if stage == "rollout" else {},
    )


def run_worker(world, spec: StageSpec, policy_cache) -> dict:
    """`python -m forge_core.run <stage>` under the real launcher (as a flow task runs it); its metrics."""
    uri = write_spec(world.store, spec)
    env = {"FORGE_POLICY_CACHE": str(policy_cache)}
    result = launch(LaunchSpec("forge_core.run", [spec.stage, "--spec", uri], torchrun=False, env=env))
    assert result.outcome.name == "SUCCESS", "\n".join(result.tail[-40:])
    return world.store.read_manifest(spec.output_uri).metrics


@pytest.mark.integration
def test_reload_equals_a_fresh_engine_and_a_killed_engine_is_restarted_by_the_next_stage(
    world, engines_root, state_dir, rollout_cfg, policies, prompts, tmp_path, monkeypatch
):
    """Load B in place, SIGKILL the service, then run the rollout worker (engine_lifetime=flow) under the real
    launcher: it finds the engine dead and starts a fresh one on B, which samples what the killed one sampled
    (same seed) and greedily what the reloaded one did; its launcher leaves that service running and the
    evaluate stage, run in this process as a flow task runs it, reuses it."""
    policy_a, policy_b = policies
    policy_b_stage = world.store.artifact_uri("sft", POLICY_B_KEY)
    monkeypatch.setenv("FORGE_POLICY_CACHE", str(tmp_path / "policy-cache"))
    rollout_spec = stage_spec(world, engines_root, "rollout", policy_b_stage, "flow-engine-rollout")
    plan = plan_rollout(stage_context(rollout_spec))  # its prompts and seed, as the worker will pick them

    with EngineService.ensure(state_dir, rollout_cfg, policy_a.local_dir, policy_a.version) as client:
        pid = client.pid
        greedy_a = client.generate(prompts, GREEDY, seed=0)
    with EngineService.ensure(state_dir, rollout_cfg, policy_b.local_dir, policy_b.version) as client:
        assert client.pid == pid and client.startup_s == 0.0 and client.reload_s > 0.0
        assert client.ping()["policy_version"] == policy_b.version
        greedy_b_reloaded = client.generate(prompts, GREEDY, seed=0)
        sampled_before_kill = client.generate(plan.prompts, plan.cfg.rollout.sampling, plan.seed)
    assert tokens(greedy_a) != tokens(greedy_b_reloaded)  # B's weights are in use, not A's

    os.kill(pid, signal.SIGKILL)
    psutil.Process(pid).wait(timeout=30)
    assert read_record(ServicePaths(state_dir)).pid == pid  # the dead service's record and socket remain

    rollout_metrics = run_worker(world, rollout_spec, tmp_path / "policy-cache")
    record = read_record(ServicePaths(state_dir))
    assert record.pid != pid and record.process() is not None, "the worker's service did not outlive it"
    assert rollout_metrics["engine_lifetime"] == "flow" and rollout_metrics["engine_startup_s"] > 0
    table = world.store.reader(rollout_spec.output_uri).read_table(ROLLOUTS_TABLE)
    assert table.column("response_ids").to_pylist() == [list(s.response_ids) for s in sampled_before_kill]
    assert set(table.column("policy_version").to_pylist()) == {policy_b.version}
    assert rollout_metrics["policy_version"] == policy_b.version

    with EngineService.ensure(state_dir, rollout_cfg, policy_b.local_dir, policy_b.version) as client:
        assert client.pid == record.pid and client.startup_s == 0.0
        greedy_b_fresh = client.generate(prompts, GREEDY, seed=0)
    assert tokens(greedy_b_fresh) == tokens(greedy_b_reloaded)
    for fresh, reloaded in zip(greedy_b_fresh, greedy_b_reloaded):
        assert fresh.response_logprobs == pytest.approx(reloaded.response_logprobs, abs=1e-5)

    # The evaluate stage as a flow task runs it with flow engines: in this process (forge_core.run.in_process).
    eval_spec = stage_spec(world, engines_root, "evaluate", policy_b_stage, "flow-engine-eval")
    write_spec(world.store, eval_spec)
    eval_plan = StagePlan("evaluate", "flow-engine-eval", eval_spec.output_uri, eval_spec, eval_spec.inputs)
    relayed: list[str] = []
    result = runner_for(config_from_dict(eval_spec.config), "evaluate").run(eval_plan, relayed.append)
    assert result.outcome.name == "SUCCESS", result.reason
    assert any("committed" in line and eval_spec.output_uri in line for line in relayed), relayed
    eval_metrics = world.store.read_manifest(eval_spec.output_uri).metrics
    assert eval_metrics["engine_startup_s"] == 0.0 and read_record(ServicePaths(state_dir)).pid == record.pid
    # The service belongs to the process that launched the workers (the flow; here pytest).
    assert registry.launch_owner(record.launch_id) == (os.getpid(), psutil.Process().create_time())


@pytest.mark.integration
def test_concurrent_runs_of_one_config_never_share_engines_or_trainer_jobs(
    world, engines_root, state_dir, rollout_cfg, policies
):
    """Two flow runs of one config (same name, store, folder, rollout.engine_state_dir) differ only in their
    run id: each gets its own engine and trainer folders, and one run's stop leaves the other's engine serving."""
    from forge_core.run.resources import trainer_state_dir

    run_a = config_from_dict(flow_run_config(world.store_root, engines_root))
    run_b = config_from_dict(flow_run_config(world.store_root, engines_root, run_id="another-run-of-it"))
    assert engine_state_dir(run_a) == state_dir != engine_state_dir(run_b)
    assert trainer_state_dir(run_a) != trainer_state_dir(run_b)
    defaults = [
        config_from_dict(
            {**run_config_dict(world.store_root, engine_lifetime="flow"), "launch": {"run_id": run}}
        )
        for run in ("run-a", "run-b")
    ]
    assert engine_state_dir(defaults[0]) != engine_state_dir(defaults[1])  # the temp-dir default too

    policy_a, _ = policies
    with EngineService.ensure(state_dir, rollout_cfg, policy_a.local_dir, policy_a.version) as client:
        pid = client.pid
    assert stop_flow_engines(run_b) == []  # run B's end: nothing of run A is touched
    client = healthy_client(ServicePaths(state_dir))
    assert client is not None, "run A's engine no longer answers after run B stopped its own"
    with client:
        assert client.pid == pid and client.ping()["policy_version"] == policy_a.version


@pytest.mark.integration
def test_stop_services_leaves_no_engine_process(state_dir, rollout_cfg, policies):
    policy_a, _ = policies
    with EngineService.ensure(state_dir, rollout_cfg, policy_a.local_dir, policy_a.version) as client:
        pid, launch_id = client.pid, client.info["launch_id"]
    processes = service_processes(pid, launch_id)
    assert pid in [p.pid for p in processes]

    assert pid in stop_services(state_dir)
    assert not [p.pid for p in processes if is_alive(p)]
    assert not processes_with_launch_id(launch_id)
    assert read_record(ServicePaths(state_dir)) is None and not ServicePaths(state_dir).socket.exists()
    assert registry.launch_owner(launch_id) is None
    assert stop_services(state_dir) == []  # nothing left: a second stop is a no-op


def test_engine_lifetime_is_not_part_of_the_artifact_keys(tmp_path):
    """Samples do not depend on where the engine lives: switching to the flow engine reuses committed work."""
    from forge_core.run.plan import stage_key_material

    stage = config_from_dict(run_config_dict(f"file://{tmp_path}/store"))
    flow = config_from_dict(
        run_config_dict(f"file://{tmp_path}/store", engine_lifetime="flow", engine_state_dir=str(tmp_path))
    )
    for name in ("rollout", "evaluate", "grpo"):
        assert stage_key_material(stage, name) == stage_key_material(flow, name)
    with pytest.raises(
        ValueError, match=r"rollout.engine_lifetime='forever': expected one of 'stage', 'flow'"
    ):
        config_from_dict(run_config_dict(f"file://{tmp_path}/store", engine_lifetime="forever"))


# ---- a wedged engine (real service) -------------------------------------------------------------------


def _wait_for_line(path, text: str, offset: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in path.read_bytes()[offset:].decode(errors="replace"):
        assert time.monotonic() < deadline, f"{path} never logged {text!r}"
        time.sleep(0.02)


@pytest.mark.integration
def test_a_second_sigterm_kills_a_service_whose_engine_is_wedged(
    rollout_cfg, policies, tmp_path, registry_dir
):
    """The service's vLLM engine core process is stopped (SIGSTOP: a wedged engine), so the clean-up of the
    first SIGTERM cannot finish (vLLM waits 5 s for the core, then the service's own STOP_GRACE_S escalation
    would fire); the second SIGTERM SIGKILLs the service and its engine core at once."""
    policy_a, _ = policies
    folder = tmp_path / "wedged"
    separate_core = dataclasses.replace(rollout_cfg, engine_in_process=False)
    with EngineService.ensure(folder, separate_core, policy_a.local_dir, policy_a.version) as client:
        pid, launch_id = client.pid, client.info["launch_id"]
    paths = ServicePaths(folder)
    try:
        cores = [p for p in processes_with_launch_id(launch_id) if p.pid != pid]
        assert cores, "no engine core process of its own to wedge"
        for core in cores:
            core.suspend()
        offset = paths.log.stat().st_size
        os.kill(pid, signal.SIGTERM)
        _wait_for_line(paths.log, "SIGTERM: stopping", offset)  # counted: the next one is a second signal
        second = time.monotonic()
        os.kill(pid, signal.SIGTERM)
        left = [p for p in [psutil.Process(pid), *cores] if is_alive(p)]
        deadline = time.monotonic() + 60
        while left and time.monotonic() < deadline:
            time.sleep(0.02)
            left = [p for p in left if is_alive(p)]
        gone_s = time.monotonic() - second
        assert left == [], f"still running after the second SIGTERM: {left}"
        log_text = paths.log.read_bytes()[offset:].decode(errors="replace")
        killed = [
            line for line in log_text.splitlines() if "SIGTERM again during the clean-up: SIGKILL" in line
        ]
        assert killed and all(str(core.pid) in killed[0] for core in cores), log_text[-2000:]
        assert f"engine service pid {pid} stopped" not in log_text  # no graceful end: it was killed
        print(f"service and wedged engine core gone {gone_s:.2f} s after the second SIGTERM")
    finally:
        end_stale_service(paths)
