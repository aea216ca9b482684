"""Outcome classification from real error files (written by record_errors / torch's record) and torchrun's
real failure-summary format."""

import json
import os

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure, record

from forge_core.launch import FatalStageError, Outcome, RetryableStageError, record_errors
from forge_core.launch.classify import (
    agent_error_reason,
    decide_failure,
    parse_failure_summary,
    plain_rank_errors,
    read_error_file,
    torchrun_rank_errors,
)
from forge_core.launch.errors import Category, category_of_name
from forge_core.launch.result import RankError


class ConfigError(ValueError):
    """A user error type the launcher has never heard of; fatal through its ValueError base."""


class StorageHiccup(OSError):
    pass


def raise_in_recorded_main(exc: BaseException, error_file, monkeypatch, decorator=record_errors):
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.setenv("RANK", "3")

    @decorator
    def main():
        raise exc

    with pytest.raises(type(exc)):
        main()
    return read_error_file(str(error_file))


@pytest.mark.parametrize(
    "exc, category",
    [
        (ConfigError("lr=-1: must be > 0"), Category.FATAL),
        (FatalStageError("data.path='x': missing"), Category.FATAL),
        (KeyError("tokenizer"), Category.FATAL),
        (StorageHiccup(5, "I/O error"), Category.RETRYABLE),
        (RetryableStageError("s3 throttled"), Category.RETRYABLE),
        (RuntimeError("something odd"), Category.UNCLASSIFIED),
    ],
)
def test_record_errors_file_classifies_by_class_hierarchy(exc, category, tmp_path, monkeypatch):
    recorded = raise_in_recorded_main(exc, tmp_path / "error.json", monkeypatch)
    assert recorded.category is category
    assert recorded.exc_type == type(exc).__name__
    assert recorded.rank == 3
    assert "raise exc" in recorded.traceback


def test_plain_torch_record_file_falls_back_to_the_type_name(tmp_path, monkeypatch):
    # Without the hierarchy a subclass unknown by name cannot be placed; builtins still can.
    unknown = raise_in_recorded_main(ConfigError("bad"), tmp_path / "a.json", monkeypatch, decorator=record)
    builtin = raise_in_recorded_main(ConnectionResetError("reset"), tmp_path / "b.json", monkeypatch, record)
    assert unknown.category is Category.FATAL  # "ConfigError" is a known fatal name
    assert builtin.category is Category.RETRYABLE  # ConnectionResetError -> OSError
    assert builtin.rank is None
    assert category_of_name("SomethingElseError") is Category.UNCLASSIFIED
    assert category_of_name("RendezvousTimeoutError") is Category.RETRYABLE


def test_torchrun_summary_is_parsed_from_torch_own_format(tmp_path):
    error_file = tmp_path / "1" / "error.json"
    error_file.parent.mkdir()
    error_file.write_text(
        json.dumps({"message": {"message": "ValueError: bad", "extraInfo": {"timestamp": "1"}}})
    )
    failures = {
        3: ProcessFailure(local_rank=1, pid=111, exitcode=1, error_file=str(error_file)),
        2: ProcessFailure(local_rank=0, pid=112, exitcode=-9, error_file="/nonexistent/error.json"),
    }
    lines = str(ChildFailedError("dist_worker", failures)).splitlines()
    entries = {e.rank: e for e in parse_failure_summary(lines)}
    assert set(entries) == {2, 3}
    assert (entries[3].local_rank, entries[3].exitcode, entries[3].error_file) == (1, 1, str(error_file))
    assert (entries[2].local_rank, entries[2].exitcode, entries[2].error_file) == (0, -9, None)


def test_torchrun_rank_errors_combine_files_and_summary(tmp_path, monkeypatch):
    rank_dir = tmp_path / "run_x" / "attempt_0"
    for local_rank in (0, 1):
        (rank_dir / str(local_rank)).mkdir(parents=True)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(rank_dir / "1" / "error.json"))
    monkeypatch.delenv("RANK", raising=False)

    @record_errors
    def main():
        raise ValueError("optimizer.lr=-1")

    with pytest.raises(ValueError):
        main()
    failures = {
        3: ProcessFailure(local_rank=1, pid=1, exitcode=1, error_file=str(rank_dir / "1" / "error.json")),
        2: ProcessFailure(local_rank=0, pid=2, exitcode=-9, error_file=str(rank_dir / "0" / "error.json")),
    }
    summary = str(ChildFailedError("w", failures)).splitlines()
    errors = torchrun_rank_errors(str(tmp_path), summary, {}, first_global_rank=2)
    assert set(errors) == {2, 3}
    assert errors[3].summary == "rank 3: ValueError: optimizer.lr=-1"  # rank from the summary's file path
    assert errors[2].summary == "rank 2: killed by SIGKILL (exit -9)"
    assert decide_failure(errors, "").outcome is Outcome.FATAL


def err(rank, category, exc_type=None, exitcode=1, timestamp=None):
    return RankError(
        rank=rank,
        category=category.value,
        summary=f"rank {rank}: {exc_type or exitcode}",
        exitcode=exitcode,
        exc_type=exc_type,
        timestamp=timestamp,
    )


def test_decide_failure_precedence():
    fatal = err(1, Category.FATAL, "ValueError")
    killed = err(1, Category.RETRYABLE, exitcode=-9)
    collateral = err(0, Category.UNCLASSIFIED, "RuntimeError", exitcode=-15)
    oserror = err(2, Category.RETRYABLE, "OSError", timestamp=5.0)
    bare_exit = err(0, Category.UNCLASSIFIED, exitcode=3)
    assert decide_failure({0: collateral, 1: fatal}, "").outcome is Outcome.FATAL
    assert decide_failure({0: collateral, 1: killed}, "") == decide_failure({1: killed}, "")
    assert decide_failure({0: collateral, 1: killed}, "").reason == "rank 1: -9"
    # The signal death is named as the cause even when a retryable exception came with it.
    assert decide_failure({1: killed, 2: oserror}, "").reason == "rank 1: -9"
    # A peer that torchrun SIGTERMed after another rank failed neither names the cause nor makes a Python
    # error retryable; a group that was only SIGTERMed (preempted) is retryable.
    terminated_peer = err(0, Category.RETRYABLE, exitcode=-15)
    python_error = err(1, Category.UNCLASSIFIED, "RuntimeError")
    assert decide_failure({0: terminated_peer, 1: killed}, "").reason == "rank 1: -9"
    assert decide_failure({0: terminated_peer, 1: python_error}, "") == decide_failure({1: python_error}, "")
    assert decide_failure({0: terminated_peer, 1: python_error}, "").outcome is Outcome.FATAL
    assert decide_failure({0: terminated_peer}, "").outcome is Outcome.RETRYABLE
    assert decide_failure({0: collateral}, "").outcome is Outcome.FATAL
    assert decide_failure({0: bare_exit}, "").outcome is Outcome.RETRYABLE
    assert decide_failure({}, "torchrun exited with code 1").reason == "torchrun exited with code 1"


def test_plain_exit_codes_without_error_file(tmp_path):
    missing = str(tmp_path / "none.json")
    assert plain_rank_errors(missing, 0, {}) == {}
    assert plain_rank_errors(missing, 78, {})[0].category == "fatal"
    assert plain_rank_errors(missing, 75, {})[0].category == "retryable"
    printed = plain_rank_errors(missing, 1, {0: ("ModuleNotFoundError", "No module named 'nope'")})[0]
    assert printed.category == "fatal" and printed.exc_type == "ModuleNotFoundError"


def test_agent_error_of_torchrun_itself(tmp_path):
    path = tmp_path / "root_error.json"
    path.write_text(
        json.dumps({"message": {"message": "RendezvousTimeoutError: timed out", "extraInfo": {}}})
    )
    category, reason = agent_error_reason(str(path))
    assert category is Category.RETRYABLE
    assert reason == "torchrun: RendezvousTimeoutError: timed out"
    assert agent_error_reason(os.path.join(tmp_path, "absent.json")) is None
