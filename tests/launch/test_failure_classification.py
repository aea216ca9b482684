"""The one classification of a failure (forge_core.launch.errors.classify_exception) and what it drives:
error files, the stage tasks' retry condition, the storage retry horizon, the collectives' timeout and the
hung-rank note. Cheap: no launch, no server."""

from __future__ import annotations

import errno
import os
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from forge_core.config.schema import ResourceConfig, StorageConfig
from forge_core.engine.distributed import process_group_timeout_s
from forge_core.launch import (
    LaunchFailed,
    LaunchResult,
    LaunchSpec,
    Outcome,
    RetryableStageError,
    record_errors,
)
from forge_core.launch.classify import exception_result, read_error_file
from forge_core.launch.errors import OUT_OF_MEMORY_FIX, Category, classification_of_name, classify_exception
from forge_core.launch.heartbeat import HEARTBEAT_DIR_ENV, beat, read_heartbeats, stall_note
from forge_core.launch.spec import DEADLINE_ENV, build_env
from forge_core.storage import (
    ArtifactCorrupted,
    ArtifactNotCommitted,
    Retrier,
    StorageAccessError,
    StorageUnavailable,
)

FATAL, RETRYABLE, UNCLASSIFIED = Category.FATAL, Category.RETRYABLE, Category.UNCLASSIFIED


def disk_full(path="/data/store/x.bin", code=errno.ENOSPC) -> OSError:
    return OSError(code, os.strerror(code), path)


@pytest.mark.parametrize(
    ("exc", "category", "fix_names"),
    [
        (disk_full(), FATAL, ["/data/store/x.bin", "storage.keep_checkpoints", "policy cache"]),
        (disk_full(code=errno.EDQUOT), FATAL, ["storage.keep_checkpoints"]),
        (PermissionError(errno.EACCES, "Permission denied", "/data/ro"), FATAL, ["/data/ro", "permissions"]),
        (OSError(errno.EPERM, "Operation not permitted", "/x"), FATAL, ["permissions"]),
        (OSError(errno.EROFS, "Read-only file system", "/mnt"), FATAL, ["read-only"]),
        (OSError(errno.EIO, "Input/output error"), RETRYABLE, []),
        (ConnectionResetError("reset by peer"), RETRYABLE, []),
        (TimeoutError("read timed out"), RETRYABLE, []),
    ],
)
def test_oserrors_are_classified_by_their_errno_not_just_their_class(exc, category, fix_names):
    found = classify_exception(exc)
    assert found.category is category
    for name in fix_names:
        assert name in found.fix
    assert (found.fix is None) == (not fix_names)


@pytest.mark.parametrize(
    "exc", [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), MemoryError()]
)
def test_out_of_memory_is_fatal_and_names_the_memory_settings(exc):
    found = classify_exception(exc)
    assert found.category is FATAL
    for setting in (
        "micro_batch_size",
        "max_seq_len",
        "activation_checkpoint",
        "kv_cache_gib",
        "max_num_seqs",
    ):
        assert setting in found.fix
    # An error file of plain torch `record` names the class only: the same verdict.
    assert classification_of_name("OutOfMemoryError").fix == OUT_OF_MEMORY_FIX


def test_storage_errors():
    corrupted = ArtifactCorrupted("sha256 mismatch in sft.parquet", "s3://b/run/data/k", "sft.parquet")
    assert classify_exception(StorageUnavailable("get s3://b/k: still failing")).category is RETRYABLE
    assert classify_exception(StorageAccessError("access denied; check the credentials")) == (
        classify_exception(StorageAccessError("bucket 'b' does not exist; create it"))
    )
    assert classify_exception(StorageAccessError("x")).category is FATAL
    assert (
        classify_exception(ArtifactNotCommitted("not committed; run the stage", "s3://b/k")).category is FATAL
    )
    found = classify_exception(corrupted)
    assert found.category is FATAL and "delete the prefix s3://b/run/data/k" in found.fix
    # A stage wraps an unreadable input in a ValueError naming the input: fatal, with the cause's fix.
    try:
        try:
            raise corrupted
        except ArtifactCorrupted as exc:
            raise ValueError("inputs.data=s3://b/run/data/k: cannot read the data artifact") from exc
    except ValueError as wrapped:
        assert classify_exception(wrapped) == found


@pytest.mark.parametrize(
    ("exc", "category"),
    [
        # What torch 2.13's gloo raises on the waiting rank, then on its next collective (measured).
        (RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation"), RETRYABLE),
        (RuntimeError("Application timeout caused pair closure"), RETRYABLE),
        (RuntimeError("Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE)"), RETRYABLE),
        (dist.DistBackendError("NCCL communicator was aborted"), RETRYABLE),
        (RuntimeError("something unclassified"), UNCLASSIFIED),
        (ValueError("sft.steps=0: must be >= 1"), FATAL),
    ],
)  # fmt: skip
def test_collective_timeouts_are_retryable(exc, category):
    assert classify_exception(exc).category is category


def test_exceptions_that_say_so_and_aggregates():
    retryable = LaunchResult(outcome=Outcome.RETRYABLE, returncode=-9, reason="rank 1: killed by SIGKILL")
    assert classify_exception(LaunchFailed(retryable)).category is RETRYABLE
    assert classify_exception(LaunchFailed(retryable.__class__(Outcome.FATAL, 1, "x"))).category is FATAL
    assert classify_exception(RetryableStageError("writing shards failed")).category is RETRYABLE
    # DCP reports each rank's failure inside one CheckpointException.
    dcp_disk_full = CheckpointException("save", {0: (disk_full(), "traceback"), 1: (ConnectionError(), "tb")})
    assert classify_exception(dcp_disk_full).category is FATAL
    assert (
        classify_exception(CheckpointException("save", {1: (ConnectionError(), "tb")})).category is RETRYABLE
    )


def test_the_category_recorded_by_the_rank_is_what_the_launcher_reads(tmp_path, monkeypatch):
    """An OSError is retryable by class, but ENOSPC is not: the rank records its own verdict and fix."""
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    monkeypatch.setenv("RANK", "1")

    @record_errors
    def main():
        raise disk_full("/scratch/ckpt/__1_0.distcp")

    with pytest.raises(OSError):
        main()
    recorded = read_error_file(str(tmp_path / "error.json"))
    assert recorded.category is FATAL and recorded.rank == 1
    assert "/scratch/ckpt/__1_0.distcp" in recorded.fix and "storage.keep_checkpoints" in recorded.fix


def test_exception_result_carries_the_fix():
    try:
        raise torch.OutOfMemoryError("CUDA out of memory")
    except torch.OutOfMemoryError as exc:
        result = exception_result("rollout (in the task's process)", exc, 2.0)
    assert result.outcome is Outcome.FATAL and result.duration_s == 2.0
    assert result.reason.startswith(
        "rollout (in the task's process): OutOfMemoryError: CUDA out of memory. Fix: "
    )
    assert "rollout.kv_cache_gib" in result.rank_errors[0].summary
    assert result.rank_errors[0].exc_type == "torch.OutOfMemoryError"


def test_the_stage_tasks_retry_the_same_classification():
    from prefect.states import Failed

    from tasks.stages import is_retryable

    def retried(exc: BaseException) -> bool:
        return is_retryable(None, None, Failed(data=exc))

    assert retried(StorageUnavailable("check bucket s3://b: still failing after 2 retries"))
    assert retried(LaunchFailed(LaunchResult(Outcome.RETRYABLE, -9, "rank 1: killed by SIGKILL")))
    assert not retried(LaunchFailed(LaunchResult(Outcome.FATAL, 1, "rank 0: ValueError: x")))
    assert not retried(ValueError("sft.steps=0: must be >= 1"))
    assert not retried(StorageAccessError("access denied"))
    assert not retried(RuntimeError("worker exited cleanly without committing"))


# ---- storage retry horizon ------------------------------------------------------------------------------


class FailsThenWorks:
    """A storage call that is refused `failures` times, then answers."""

    def __init__(self, failures: int, exc: Exception | None = None):
        self.failures = failures
        self.calls = 0
        self.exc = exc or ConnectionRefusedError(111, "Connection refused")

    def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.exc
        return "ok"


def test_an_outage_longer_than_the_retry_count_is_ridden_out_within_the_horizon():
    retrier = Retrier(retries=1, backoff_s=0.01, horizon_s=600)
    call = FailsThenWorks(failures=6)  # more than `retries`; about 0.6 s of backoff, far inside the horizon
    assert retrier.call("get s3://b/k", call) == "ok"
    assert retrier.retried == 6 and call.calls == 7


def test_without_a_horizon_the_count_decides():
    retrier = Retrier(retries=1, backoff_s=0.0, horizon_s=0)
    with pytest.raises(StorageUnavailable, match="get s3://b/k: still failing after 1 retries"):
        retrier.call("get s3://b/k", FailsThenWorks(failures=5))


def test_the_horizon_is_a_floor_in_time_then_storage_unavailable():
    retrier = Retrier(retries=0, backoff_s=0.01, horizon_s=0.3)
    started = time.monotonic()
    with pytest.raises(StorageUnavailable, match=r"storage\.retry_horizon_s \(now 0\.3 s\)"):
        retrier.call("put s3://b/k", FailsThenWorks(failures=10**9))
    assert time.monotonic() - started >= 0.3
    assert retrier.retried >= 2


def test_access_denied_and_other_errors_are_never_retried_whatever_the_horizon():
    retrier = Retrier(retries=5, backoff_s=10.0, horizon_s=3600)
    with pytest.raises(StorageAccessError, match="access denied"):
        retrier.call("get s3://b/k", FailsThenWorks(1, PermissionError(errno.EACCES, "Access Denied")))
    with pytest.raises(OSError, match="No space left"):
        retrier.call("put file:///x", FailsThenWorks(1, disk_full()))
    assert retrier.retried == 0


def test_retry_horizon_setting():
    assert StorageConfig().retry_horizon_s >= 300  # long enough for an S3 brown-out
    assert Retrier.from_config(StorageConfig(retries=2, retry_horizon_s=42)).horizon_s == 42
    errors = StorageConfig(retry_horizon_s=-1).check()
    assert any("storage.retry_horizon_s=-1" in e for e in errors)


def test_stores_from_config_ride_out_outages_for_the_configured_horizon(tmp_path):
    from forge_core.storage import ObjectStore

    store = ObjectStore.from_config(StorageConfig(root=f"file://{tmp_path}/s", retry_horizon_s=123))
    assert store.retrier.horizon_s == 123


# ---- collectives' timeout and heartbeats ----------------------------------------------------------------


def test_collectives_time_out_after_the_launch_deadline(monkeypatch):
    default_deadline = ResourceConfig().deadline_s
    env = build_env(LaunchSpec("m", deadline_s=default_deadline), "id", "/tmp/e.json", "/tmp/hb")
    assert env[DEADLINE_ENV] == f"{default_deadline:g}" and env[HEARTBEAT_DIR_ENV] == "/tmp/hb"
    monkeypatch.setenv(DEADLINE_ENV, env[DEADLINE_ENV])
    assert process_group_timeout_s() > default_deadline  # the launcher's deadline always comes first
    monkeypatch.setenv(DEADLINE_ENV, "60")
    assert process_group_timeout_s() > 60
    monkeypatch.delenv(DEADLINE_ENV)
    assert process_group_timeout_s() == 600.0  # outside a launch
    with pytest.raises(ValueError, match="reserved|set by the launcher"):
        LaunchSpec("m", env={DEADLINE_ENV: "5"})


def test_heartbeats_name_the_rank_that_fell_behind(tmp_path, monkeypatch):
    monkeypatch.setenv(HEARTBEAT_DIR_ENV, str(tmp_path))
    beat(0, 1, "checkpoint at step 1")  # written by "rank 0", then rank 1's older beats appear
    (tmp_path / "rank-1.json").write_text(
        '{"rank": 1, "seq": 0, "step": 1, "phase": "step 1 done", "time": 0}'
    )
    beats = read_heartbeats(tmp_path)
    assert set(beats) == {0, 1}
    note = stall_note(beats, range(2), at=beats[0].time + 5, event="the deadline")
    assert note.startswith("rank 1 made no progress since step 1 (last heartbeat 'step 1 done' ")
    assert note.endswith("; rank 0 had reached 'checkpoint at step 1'")
    assert "rank 2 sent no heartbeat" in stall_note(beats, range(3), at=0.0, event="the deadline")
    level = {0: beats[0]}
    assert stall_note(level, [0], at=beats[0].time + 3, event="the deadline").startswith(
        "no rank made progress"
    )
    assert stall_note(level, [0], at=0.0, event="the failure", when_level=False) == ""
    assert stall_note({}, range(2), at=0.0, event="the deadline") == ""
