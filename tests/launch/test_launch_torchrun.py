"""Real 2-rank gloo launches under torchrun: success, fatal, signal death, deadline and cancel.

Each test is one torchrun launch (~5-10 s on 2 CPU cores, mostly torch imports)."""

import re
import threading

import pytest
from launch_helpers import PidCollector, processes_of, still_running, wait_for_pid_files

from forge_core.launch import LaunchFailed, LaunchSpec, Outcome, launch, start

pytestmark = pytest.mark.integration

LINE = re.compile(r"^\[rank(\d)\]:line (\d+) of rank (\d)$")


def two_ranks(args, env, **kwargs):
    kwargs.setdefault("deadline_s", 300.0)
    return LaunchSpec("dist_worker", args, nproc_per_node=2, env=env, **kwargs)


def numbered_lines(lines):
    per_rank = {0: [], 1: []}
    for line in lines:
        if m := LINE.match(line):
            assert m.group(1) == m.group(3), line  # the prefix names the rank that printed the line
            per_rank[int(m.group(1))].append(int(m.group(2)))
    return per_rank


def test_success_streams_every_rank_line_by_line_in_order(workers_env, recorder):
    result = launch(two_ranks(["--lines", "40"], workers_env), log=recorder)
    assert result.outcome is Outcome.SUCCESS, result.reason
    assert result.returncode == 0 and result.rank_errors == {}
    assert numbered_lines(recorder.lines) == {0: list(range(40)), 1: list(range(40))}
    assert "[rank0]:all_reduce ok rank=0 sum=3" in recorder.lines
    assert "[rank1]:all_reduce ok rank=1 sum=3" in recorder.lines
    assert result.raise_for_outcome() is result


def test_value_error_in_one_rank_is_fatal_and_rank0_filter_holds(workers_env, recorder):
    spec = two_ranks(
        ["--mode", "raise-value", "--target-rank", "1", "--lines", "5"], workers_env, rank0_only_logs=True
    )
    result = launch(spec, log=recorder)
    assert result.outcome is Outcome.FATAL
    assert (
        result.reason
        == "rank 1: ValueError: optimizer.lr=-1.0 on rank 1: must be > 0; set optimizer.lr to e.g. 3e-4"
    )
    assert result.returncode == 1
    assert "raise ValueError" in result.rank_errors[1].traceback
    assert result.rank_errors[1].category == "fatal"
    # Only rank 0's lines reach the log; the tail still has rank 1's for the error message.
    assert not [line for line in recorder.lines if line.startswith("[rank1]:")]
    assert numbered_lines(recorder.lines) == {0: list(range(5)), 1: []}
    assert numbered_lines(result.tail)[1] == list(range(5))
    with pytest.raises(LaunchFailed) as info:
        result.raise_for_outcome()
    assert not info.value.retryable


def test_rank_killed_by_sigkill_is_retryable(workers_env, recorder):
    result = launch(two_ranks(["--mode", "sigkill", "--target-rank", "1"], workers_env), log=recorder)
    diagnosis = (result.reason, result.rank_errors, result.tail[-40:])  # printed if an assertion fails
    assert result.outcome is Outcome.RETRYABLE, diagnosis
    assert result.reason == "rank 1: killed by SIGKILL (exit -9)", diagnosis
    assert result.rank_errors[1].exitcode == -9
    with pytest.raises(LaunchFailed) as info:
        result.raise_for_outcome()
    assert info.value.retryable


def test_hang_hits_the_deadline_and_nothing_survives(workers_env, recorder, tmp_path):
    spec = two_ranks(
        ["--mode", "hang", "--pid-dir", str(tmp_path)], workers_env, kill_grace_s=2.0, deadline_s=15.0
    )
    handle = start(spec, log=recorder)
    with PidCollector(handle, pid_dir=tmp_path) as collector:
        result = handle.wait(120)
    assert result.outcome is Outcome.RETRYABLE
    assert result.reason == "deadline of 15 s exceeded"
    assert handle.pid in {p.pid for p in collector.processes}
    assert still_running(collector.processes) == []


def test_cancel_from_another_thread_ends_the_whole_tree(workers_env, recorder, tmp_path):
    args = ["--mode", "hang", "--pid-dir", str(tmp_path), "--ignore-sigterm"]
    handle = start(two_ranks(args, workers_env, kill_grace_s=1.0), log=recorder)
    names = [f"rank{r}{suffix}" for r in (0, 1) for suffix in ("", "-child", "-orphan")]
    pids = wait_for_pid_files(tmp_path, names)
    tree = processes_of({*handle.pids(), *pids.values()})
    # All six worker-side processes plus torchrun are alive before the cancel.
    assert len(still_running(tree)) == len(tree) >= 7
    canceller = threading.Thread(target=handle.cancel, args=("stage cancelled by flow",))
    canceller.start()
    canceller.join()
    result = handle.wait(60)
    assert result.outcome is Outcome.CANCELLED
    assert result.reason == "stage cancelled by flow"
    assert still_running(tree) == []
