"""Owners of launches (forge_core.launch.owner) and the launcher's SIGTERM escalation, with real processes.

The end-to-end case (a flow process SIGKILLed mid-SFT, its torchrun tree ending itself) is
tests/faults/test_owner_watchdog.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
from launch_helpers import processes_of, still_running, wait_for_pid_files

from forge_core.launch.owner import (
    FLOW_OWNER_ENV,
    OWNER_ENV,
    Owner,
    OwnerGone,
    check_owner_alive,
    owners_from_environment,
)
from forge_core.launch.spec import LaunchSpec, build_env
from forge_core.storage import ObjectStore, writer


def dead_owner() -> Owner:
    """A process that has exited (pid and start time recorded while it ran)."""
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    owner = Owner(proc.pid, psutil.Process(proc.pid).create_time())
    proc.stdin.close()
    proc.wait()
    return owner


def test_an_owner_is_a_pid_and_a_start_time():
    this = Owner.this_process()
    assert this.alive() and Owner.parse(str(this)) == this
    assert not dead_owner().alive()
    assert not Owner(os.getpid(), this.create_time - 100.0).alive()  # same pid, another process
    assert Owner(os.getpid(), this.create_time + 1.0).alive()  # read after the boot time moved by a second
    with pytest.raises(ValueError, match=rf"{OWNER_ENV}='123': expected <pid>:<create time>"):
        Owner.parse("123")
    env = build_env(LaunchSpec("m", torchrun=False), "launch-x", "/tmp/error.json")
    assert Owner.parse(env[OWNER_ENV]) == this  # every launch names its launcher
    with pytest.raises(ValueError, match=rf"env keys \['{OWNER_ENV}'\]: set by the launcher"):
        LaunchSpec("m", torchrun=False, env={OWNER_ENV: str(this)})


def test_a_worker_whose_owner_is_gone_commits_nothing(tmp_path, monkeypatch):
    """The pre-commit check a launched worker installs (forge_core.run): refused once the owner died."""
    store = ObjectStore(f"file://{tmp_path}/store")
    monkeypatch.setattr(writer, "_pre_commit_checks", [])
    writer.add_pre_commit_check(check_owner_alive)
    monkeypatch.setenv(OWNER_ENV, str(dead_owner()))
    orphan = store.writer(store.artifact_uri("data", "orphan"), kind="data", stage="prepare")
    orphan.write_bytes("rows.txt", b"computed for a flow that is gone")
    with pytest.raises(OwnerGone, match=r"not committing .*orphan: the launch's owner \(pid \d+"):
        orphan.commit(config={}, inputs={}, metrics={})
    assert not store.is_committed(orphan.uri)

    monkeypatch.setenv(OWNER_ENV, str(Owner.this_process()))
    orphan.commit(config={}, inputs={}, metrics={})
    assert store.is_committed(orphan.uri)


def test_a_dead_flow_process_stops_commits_on_its_machine_only(tmp_path, monkeypatch):
    """A launch a flow placed on the Ray cluster also names the flow process, with its machine: on that machine
    its death refuses the commit though the launcher lives; a flow process of another machine is not watched."""
    store = ObjectStore(f"file://{tmp_path}/store")
    monkeypatch.setattr(writer, "_pre_commit_checks", [])
    writer.add_pre_commit_check(check_owner_alive)
    launcher = Owner.this_process()
    monkeypatch.setenv(OWNER_ENV, str(launcher))
    gone = dead_owner()
    here = Owner(gone.pid, gone.create_time, Owner.this_process(with_machine=True).boot_id)
    assert here.boot_id and Owner.parse(str(here), source=FLOW_OWNER_ENV) == here
    monkeypatch.setenv(FLOW_OWNER_ENV, str(here))
    assert owners_from_environment() == [launcher, here]
    orphan = store.writer(store.artifact_uri("data", "orphan"), kind="data", stage="prepare")
    orphan.write_bytes("rows.txt", b"computed for a flow that is gone")
    with pytest.raises(OwnerGone, match=rf"the launch's owner \(pid {gone.pid}: the flow process"):
        orphan.commit(config={}, inputs={}, metrics={})

    monkeypatch.setenv(FLOW_OWNER_ENV, f"{gone.pid}:{gone.create_time!r}@another-machine")
    assert owners_from_environment() == [launcher]
    orphan.commit(config={}, inputs={}, metrics={})
    assert store.is_committed(orphan.uri)


LAUNCHER = textwrap.dedent(
    """
    import time
    from forge_core.launch import LaunchSpec, start
    start(LaunchSpec("stubborn_worker", torchrun=False, kill_grace_s=600.0), log=lambda line: None)
    time.sleep(600)
    """
)


def test_a_second_sigterm_kills_every_launch_at_once(workers_env, tmp_path):
    """The first SIGTERM to the launching process starts the graceful end of its launch; the worker ignores
    it (a grace of 600 s would follow); the second SIGTERM SIGKILLs the tree and the launcher dies."""
    pid_file = tmp_path / "worker.pid"
    env = {**os.environ, **workers_env, "PLAIN_WORKER_PID_FILE": str(pid_file)}
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], env=env)
    worker: list[psutil.Process] = []
    try:
        worker = processes_of([wait_for_pid_files(tmp_path, ["worker"], timeout_s=60)["worker"]])
        launcher.send_signal(signal.SIGTERM)
        noted = pid_file.with_name(pid_file.name + ".sigterm")
        deadline = time.monotonic() + 60
        while not noted.exists():  # the launcher is now in terminate_all_live, waiting out the grace
            assert time.monotonic() < deadline, "the worker never got the launcher's SIGTERM"
            time.sleep(0.02)
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(60) == -signal.SIGTERM
        deadline = time.monotonic() + 30
        while still_running(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert still_running(worker) == [], "the worker outlived the second SIGTERM"
    finally:
        launcher.kill()
        launcher.wait()
        for proc in still_running(worker):
            proc.kill()
