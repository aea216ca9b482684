"""The plain-python path (torchrun=False): same API and classification, plus the process-ownership
guarantees that do not need torchrun: the false-success trap, cancel_event, terminate_all_live, and the
atexit/SIGTERM hooks of the launching process."""

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest
from launch_helpers import processes_of, still_running, wait_for_pid_files

from forge_core.launch import LaunchSpec, Outcome, launch, live_handles, start, terminate_all_live
from forge_core.launch.process_tree import STATUS_LOST, peek_exit_status

pytestmark = pytest.mark.integration


def plain(args, env, **kwargs):
    return LaunchSpec("plain_worker", args, torchrun=False, env=env, kill_grace_s=1.0, **kwargs)


def hang_spec(workers_env, tmp_path, **kwargs):
    env = {**workers_env, "PLAIN_WORKER_PID_FILE": str(tmp_path / "worker.pid")}
    return plain(["hang"], env, **kwargs)


def test_plain_success_streams_lines_in_order_with_launch_id(workers_env, recorder):
    result = launch(plain(["success", "50"], workers_env), log=recorder)
    assert result.outcome is Outcome.SUCCESS and result.returncode == 0
    assert recorder.lines[:50] == [f"plain line {i}" for i in range(50)]
    assert f"launch id {result.launch_id}" in recorder.lines
    assert list(result.tail) == recorder.lines
    assert result.rank_errors == {}


def test_plain_logs_reach_a_logging_logger(workers_env):
    records = []
    logger = logging.getLogger("forge.test.launch.plain")
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        launch(plain(["success", "3"], workers_env), log=logger)
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in records][:3] == ["plain line 0", "plain line 1", "plain line 2"]


def test_plain_value_error_is_fatal_with_message(workers_env, recorder):
    result = launch(plain(["raise-value"], workers_env), log=recorder)
    assert result.outcome is Outcome.FATAL
    assert result.reason == (
        "rank 0: ValueError: data.path='missing.parquet': file not found; point data.path at a Parquet file"
    )
    assert result.returncode == 1
    assert "plain_worker.py" in result.rank_errors[0].traceback
    assert any("ValueError: data.path=" in line for line in recorder.lines)


def test_popen_reports_success_when_another_waiter_reaped_the_child():
    """The trap the launcher guards against: Popen turns ECHILD into returncode 0."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    os.kill(proc.pid, signal.SIGKILL)
    psutil.Process(proc.pid).wait(timeout=10)  # another waiter reaps the killed child
    assert proc.wait(timeout=10) == 0


def test_peek_reads_status_without_reaping_and_detects_a_stolen_status():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    assert peek_exit_status(proc.pid) is None
    os.kill(proc.pid, signal.SIGKILL)
    while (status := peek_exit_status(proc.pid)) is None:
        time.sleep(0.01)
    assert status.returncode == -signal.SIGKILL
    assert proc.wait(timeout=10) == -signal.SIGKILL  # still reapable by Popen: peek did not reap

    stolen = subprocess.Popen([sys.executable, "-c", "pass"])
    os.waitpid(stolen.pid, 0)
    assert peek_exit_status(stolen.pid) is STATUS_LOST


def test_killed_child_reaped_by_someone_else_is_not_success(workers_env, tmp_path, recorder):
    handle = start(hang_spec(workers_env, tmp_path), log=recorder)
    wait_for_pid_files(tmp_path, ["worker"])
    root = psutil.Process(handle.pid)
    reaper = threading.Thread(target=root.wait)  # blocks in waitpid: reaps the moment the child dies
    reaper.start()
    time.sleep(0.2)
    os.kill(handle.pid, signal.SIGKILL)
    reaper.join(10)
    result = handle.wait(30)
    assert result.outcome is Outcome.RETRYABLE
    if result.returncode is None:  # the usual interleaving: the reaper won, the status was lost
        assert "reaped by another waiter" in result.reason
    else:  # the launcher peeked first (WNOWAIT) and kept the real status
        assert result.returncode == -signal.SIGKILL


def test_cancel_event_cancels_and_ends_the_process(workers_env, tmp_path, recorder):
    cancel = threading.Event()
    handle = start(hang_spec(workers_env, tmp_path), log=recorder, cancel_event=cancel)
    pid = wait_for_pid_files(tmp_path, ["worker"])["worker"]
    worker = processes_of([pid])
    threading.Timer(0.1, cancel.set).start()
    result = handle.wait(30)
    assert result.outcome is Outcome.CANCELLED
    assert result.reason == "cancelled"
    assert still_running(worker) == []


def test_deadline_ends_a_hanging_plain_worker(workers_env, tmp_path, recorder):
    handle = start(hang_spec(workers_env, tmp_path, deadline_s=1.5), log=recorder)
    result = handle.wait(30)
    assert result.outcome is Outcome.RETRYABLE
    assert result.reason == "deadline of 1.5 s exceeded"
    assert still_running(processes_of([handle.pid])) == []


def test_terminate_all_live_cancels_every_live_launch(workers_env, tmp_path, recorder):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    handles = [start(hang_spec(workers_env, tmp_path / d), log=recorder) for d in ("a", "b")]
    pids = [wait_for_pid_files(tmp_path / d, ["worker"])["worker"] for d in ("a", "b")]
    assert {h.launch_id for h in handles} <= {h.launch_id for h in live_handles()}
    workers = processes_of(pids)
    results = terminate_all_live(reason="flow cancelled")
    assert {r.launch_id for r in results} >= {h.launch_id for h in handles}
    assert all(h.wait(0).outcome is Outcome.CANCELLED for h in handles)
    assert all(h.wait(0).reason == "flow cancelled" for h in handles)
    assert still_running(workers) == []
    assert not {h.launch_id for h in handles} & {h.launch_id for h in live_handles()}


LAUNCHING_PROCESS = textwrap.dedent(
    """
    import os, sys, time
    from forge_core.launch import LaunchSpec, start
    spec = LaunchSpec("plain_worker", ["hang"], torchrun=False, kill_grace_s=1.0)
    handle = start(spec, log=lambda line: None)
    while not os.path.exists(os.environ["PLAIN_WORKER_PID_FILE"]):
        time.sleep(0.05)
    if sys.argv[1] == "wait-for-sigterm":
        time.sleep(120)
    # Return only once the test holds the worker's process handle: exiting at once could end the worker
    # before the test looked at it.
    while not os.path.exists(os.environ["PLAIN_WORKER_PID_FILE"] + ".seen"):
        time.sleep(0.05)
    """
)


@pytest.mark.parametrize("how", ["sigterm", "normal-exit"])
def test_launching_process_ends_its_launches_on_sigterm_and_at_exit(how, workers_env, tmp_path):
    env = {**os.environ, **workers_env, "PLAIN_WORKER_PID_FILE": str(tmp_path / "worker.pid")}
    mode = "wait-for-sigterm" if how == "sigterm" else "return"
    parent = subprocess.Popen([sys.executable, "-c", LAUNCHING_PROCESS, mode], env=env)
    try:
        worker = processes_of([wait_for_pid_files(tmp_path, ["worker"], timeout_s=60)["worker"]])
        (tmp_path / "worker.pid.seen").touch()
        if how == "sigterm":
            parent.send_signal(signal.SIGTERM)
            assert parent.wait(30) == -signal.SIGTERM  # the default action still runs after cleanup
        else:
            assert parent.wait(30) == 0
        assert worker and still_running(worker) == []
    finally:
        parent.kill()
        parent.wait()
