"""Real launches of failures the one classification decides (forge_core.launch.errors): a collective that
times out on a rank whose peer stalled (retryable, the stalled rank named from the heartbeats), a full disk
in a worker (fatal at once, the fix in the reason), and the deadline reaching the worker's collectives.

~5-15 s per torchrun launch on 2 CPU cores (mostly torch imports), ~3 s per plain one."""

from __future__ import annotations

import re

import pytest

from forge_core.launch import LaunchSpec, Outcome, launch

pytestmark = pytest.mark.integration


def test_a_collective_timeout_is_retryable_and_names_the_rank_that_stalled(workers_env, recorder):
    # rank 1 stops after its step-1 heartbeats; rank 0 waits for it in an all-reduce that times out after 5 s
    # (an explicit timeout: with the derived one the deadline would come first, see the next test).
    spec = LaunchSpec(
        "dist_worker",
        ["--mode", "stall", "--target-rank", "1", "--pg-timeout-s", "5"],
        nproc_per_node=2,
        env=workers_env,
        deadline_s=600.0,
        kill_grace_s=2.0,
    )
    result = launch(spec, log=recorder)
    assert result.outcome is Outcome.RETRYABLE, result.reason
    assert re.search(r"rank 0: RuntimeError: .*Timed out waiting 5000ms", result.reason), result.reason
    assert result.rank_errors[0].category == "retryable"  # recorded by the rank itself
    assert result.stall.startswith("rank 1 made no progress since step 1 (last heartbeat 'step 1 done' ")
    assert result.stall.endswith("; rank 0 had reached 'step 2'") and result.stall in result.reason


def test_the_deadline_reaches_the_workers_collectives(workers_env, recorder):
    spec = LaunchSpec("plain_worker", ["pg-timeout"], env=workers_env, torchrun=False, deadline_s=1234.0)
    result = launch(spec, log=recorder)
    assert result.outcome is Outcome.SUCCESS, result.reason
    timeouts = [
        float(line.split()[-1]) for line in recorder.lines if line.startswith("process group timeout")
    ]
    assert timeouts and timeouts[0] > 1234.0, recorder.lines


def test_a_full_disk_in_a_worker_is_fatal_with_the_fix(workers_env, recorder):
    spec = LaunchSpec("plain_worker", ["disk-full"], env=workers_env, torchrun=False, deadline_s=600.0)
    result = launch(spec, log=recorder)
    assert result.outcome is Outcome.FATAL, result.reason  # an OSError, yet not retried: ENOSPC
    assert "rank 0: OSError: [Errno 28] No space left on device" in result.reason
    assert "Fix: the disk or quota holding /data/store/sft/abc/_attempts/x/model.bin is full" in result.reason
    assert "storage.keep_checkpoints" in result.reason and result.stall == ""
