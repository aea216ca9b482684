"""The fault-injection hooks themselves (forge_core/faults.py) and the orphan reaper (forge_core/launch/registry.py),
each against the real mechanism it drives: the store's retry path, a process titled like vLLM's engine core,
a launcher process that dies by SIGKILL."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
from fault_kit import OutageMotoServer

from forge_core import faults
from forge_core.faults import InjectedFault, maybe_inject_fault, parse_faults
from forge_core.rollout.engine_watch import engine_core_processes
from forge_core.storage import ObjectStore, StorageUnavailable

pytestmark = pytest.mark.integration
HERE = Path(__file__).resolve().parent


def test_stage_suffix_limits_a_fault_to_that_stage(monkeypatch):
    monkeypatch.setenv("FORGE_FAULT", "raise_rank:0:1@grpo")
    monkeypatch.setattr(faults, "_current_stage", "sft")
    maybe_inject_fault(rank=0, step=1)  # an SFT worker: not its stage
    monkeypatch.setattr(faults, "_current_stage", "grpo")
    with pytest.raises(InjectedFault):
        maybe_inject_fault(rank=0, step=1)


def test_each_fault_fires_once_with_its_own_marker(monkeypatch, tmp_path):
    monkeypatch.setenv("FORGE_FAULT", "raise_rank:0:1,raise_rank:0:2")
    monkeypatch.setenv("FORGE_FAULT_ONCE", str(tmp_path / "fired"))
    for step in (1, 2):
        with pytest.raises(InjectedFault):
            maybe_inject_fault(rank=0, step=step)
        maybe_inject_fault(rank=0, step=step)  # a retry passes the same step: runs clean
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fired", "fired.1"]


@pytest.mark.parametrize(
    "spec, why",
    [
        ("kill_vllm:x", "kill_vllm:<samples>"),
        ("storage_outage:0", "duration in seconds > 0"),
        ("kill_rank:1:2@", "empty stage"),
    ],
)
def test_bad_fault_entries_say_what_is_expected(spec, why):
    with pytest.raises(ValueError, match=why):
        parse_faults(spec)


@pytest.mark.fault(
    fault="`storage_outage:0.4:create` (every store call fails for 0.4 s from the manifest's exclusive create)",
    where="ObjectStore retry path (any stage; file:// here)",
    checked="the outage starts at the manifest's create itself; with enough retries the create succeeds after the "
    "outage and the artifact is committed; with too few the create fails with StorageUnavailable naming it "
    "(retryable for the launcher) and nothing is committed",
)
def test_storage_outage_is_ridden_out_by_the_store_retries(monkeypatch, tmp_path, fault_row):
    def commit_under_outage(store: ObjectStore) -> None:
        writer = store.writer(store.artifact_uri("data", "k"), kind="data", stage="prepare")
        writer.write_bytes("rows.bin", b"x" * 10)
        monkeypatch.setenv("FORGE_FAULT", "storage_outage:0.4:create")  # files written: only the create is left
        monkeypatch.setattr(faults, "_outage_started", None)
        monkeypatch.setattr(faults, "_outage_spent", False)
        writer.commit(config={}, inputs={}, metrics={})

    patient = ObjectStore(f"file://{tmp_path}/a", retries=8, retry_backoff_s=0.05)
    commit_under_outage(patient)
    assert faults._outage_started is not None, "the outage never started"
    assert patient.is_committed(patient.artifact_uri("data", "k"))
    assert patient.retrier.retried >= 1
    fault_row.fact(f"{patient.retrier.retried} retries of the create")

    impatient = ObjectStore(f"file://{tmp_path}/b", retries=1, retry_backoff_s=0.01)
    with pytest.raises(StorageUnavailable, match=r"create \S+/_MANIFEST\.json: still failing after 1 retries"):
        commit_under_outage(impatient)
    monkeypatch.setattr(faults, "_outage_spent", True)  # end the outage to look
    assert not impatient.is_committed(impatient.artifact_uri("data", "k"))


def test_kill_vllm_kills_the_engine_process_after_the_given_samples(monkeypatch, tmp_path):
    engine = subprocess.Popen([sys.executable, str(HERE / "sleeper.py"), "VLLM::EngineCore"])
    try:
        _wait_for_title(engine.pid, "VLLM::EngineCor")
        monkeypatch.setenv("FORGE_FAULT", "kill_vllm:2@rollout")
        monkeypatch.setenv("FORGE_FAULT_ONCE", str(tmp_path / "fired"))
        monkeypatch.setattr(faults, "_current_stage", "rollout")
        monkeypatch.setattr(faults, "_completed_samples", 0)
        progress = faults.engine_kill_progress(engine_core_processes)
        assert list(progress([1, 2, 3])) == [1, 2, 3]  # vLLM's prompt-rendering pass: untouched
        bar = progress(total=4)
        bar.update(1)
        assert engine.poll() is None
        bar.update(1)
        assert engine.wait(timeout=10) == -9
    finally:
        engine.kill()
        engine.wait()
    monkeypatch.setattr(faults, "_current_stage", "sft")
    assert faults.engine_kill_progress(engine_core_processes) is None  # other stages get no progress hook


_OWNER = """
import sys, time
from forge_core.launch import LaunchSpec, start
handle = start(LaunchSpec("sleeper", torchrun=False, deadline_s=600), log=lambda line: None)
print(handle.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.fault(
    fault="launcher process SIGKILLed while its launch runs",
    where="forge_core.launch registry (what a flow calls at its start)",
    checked="the orphaned worker outlives its launcher; reap_orphaned_launches ends it and drops its record; "
    "the launch of a live launcher is left alone",
)
def test_launches_of_a_sigkilled_launcher_are_reaped_and_live_ones_are_not(tmp_path, fault_row):
    from forge_core.launch import reap_orphaned_launches

    registry = tmp_path / "launches"
    env = {
        **os.environ,
        "FORGE_LAUNCH_REGISTRY": str(registry),
        "PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    owners = [
        subprocess.Popen([sys.executable, "-c", _OWNER], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    try:
        workers = [psutil.Process(int(owner.stdout.readline())) for owner in owners]
        dead = owners[0]
        dead.kill()
        dead.wait()
        time.sleep(0.5)
        assert workers[0].is_running(), "the worker died with its launcher: no orphan to reap"
        assert len(list(registry.glob("*.json"))) == 2

        assert reap_orphaned_launches(registry, grace_s=2) == [workers[0].pid]
        assert not _running(workers[0])
        assert workers[1].is_running() and len(list(registry.glob("*.json"))) == 1
    finally:
        for owner in owners:
            owner.kill()
            owner.wait()
        reap_orphaned_launches(registry, grace_s=2)
    assert not _running(workers[1])
    fault_row.fact("1 orphan ended, 1 live launch kept")


def _wait_for_title(pid: int, title: str) -> None:
    deadline = time.monotonic() + 60
    while not psutil.Process(pid).name().startswith(title):
        assert time.monotonic() < deadline, f"pid {pid} never took the title {title!r}"
        time.sleep(0.05)


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.fault(
    fault="moto S3 server stopped on the first PUT of a DCP shard (world of one)",
    where="Checkpointer.save (DCP FsspecWriter)",
    checked="the failure surfaces as RetryableStageError (DCP's CheckpointException is a BaseException the "
    "launcher would call fatal); the half-written checkpoint is not committed; the previous one is",
)
def test_s3_down_while_dcp_writes_shards_is_a_retryable_checkpoint_failure(fake_aws_env, monkeypatch):
    import torch

    from forge_core.engine import Checkpointer, checkpoint_uri
    from forge_core.engine.checkpoint import ModelState
    from forge_core.engine.distributed import DistContext
    from forge_core.launch import RetryableStageError

    # DCP's own S3 client (botocore) retries a refused connection for seconds; one attempt tells the same.
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    server = OutageMotoServer().start()
    try:
        bucket = f"forge-dcp-{uuid.uuid4().hex[:10]}"
        store = ObjectStore(
            f"s3://{bucket}/run", endpoint_url=server.endpoint_url, retries=1, retry_backoff_s=0.05
        )
        store.fs.call_s3("create_bucket", Bucket=bucket)
        world_of_one = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
        output = store.artifact_uri("sft", "run")
        checkpointer = Checkpointer(store, output, world_of_one, stage="sft", config={}, inputs={})
        model = {"model": ModelState(torch.nn.Linear(4, 3))}
        checkpointer.save(1, model, {})
        server.arm(r"^PUT /[^ ]*/step-2/[^ ]*\.distcp", outage_s=600)

        with pytest.raises(RetryableStageError, match="writing shards failed"):
            checkpointer.save(2, model, {})

        server.end_outage()  # the same data: moto keeps it in its process across the outage
        assert server.events[-1].refused_requests >= 1
        assert store.is_committed(checkpoint_uri(store, output, 1))
        assert not store.is_committed(checkpoint_uri(store, output, 2))
    finally:
        server.close()
