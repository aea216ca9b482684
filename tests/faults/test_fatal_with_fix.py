"""Failures no retry can fix fail at once (run_count 1) with the fix in the message that reaches the flow:
access denied and a missing bucket (real moto S3), a full disk (a real tmpfs) and a corrupted input artifact.
They are classified by forge_core.launch.errors.classify_exception, in the worker or in the task process.

Costs: the S3 cases fail in the task's first storage calls (~2 s each); the full disk costs one prepare
launch (~5 s); the corrupted input one prepare and one SFT launch until the rank reads its input (~20 s)."""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from pathlib import Path

import pytest
from fault_kit import TINY_CONFIG, OutageMotoServer, flip_bytes, flow_run, task_runs
from prefect import flow

from forge_core.config import config_from_dict, config_to_json, load_config
from forge_core.storage import ObjectStore
from tasks import stage_task

pytestmark = pytest.mark.integration


@flow(name="faults-fatal-prepare")
def prepare_only(config_json: str) -> str:
    cfg = config_from_dict(json.loads(config_json))
    return stage_task(cfg, "prepare").with_options(retries=2, retry_delay_seconds=0)(cfg, "prepare", {})


@flow(name="faults-fatal-sft")
def sft_only(config_json: str, data_uri: str) -> str:
    cfg = config_from_dict(json.loads(config_json))
    return stage_task(cfg, "sft").with_options(retries=2, retry_delay_seconds=0)(cfg, "sft", {"data": data_uri})


def _config(root: Path, storage: list[str], *more: str) -> str:
    return config_to_json(load_config(TINY_CONFIG, [*storage, f"logging.dir={root}/runs", *more]))


def _failed_once(state, task: str) -> str:
    """The flow run failed, its `task` ran once; returns the flow's failure message."""
    assert state.is_failed(), state
    flow_run_id = state.state_details.flow_run_id
    assert task_runs(flow_run_id)[task].run_count == 1  # fatal: not retried although 2 retries were allowed
    return str(flow_run(flow_run_id).state.message)


@pytest.mark.fault(
    fault="S3 credentials unknown to the server (moto with authentication on: 403 InvalidAccessKeyId / "
    "Forbidden); storage.root naming a bucket that does not exist",
    where="prepare_data task on s3:// (the task process's first storage calls), 2 retries allowed",
    checked="StorageAccessError, fatal: the task runs once, the flow's failure names the URI and the fix "
    "(check the AWS credentials and bucket policy / create the bucket)",
)
def test_access_denied_and_a_missing_bucket_fail_at_once_with_the_fix(
    prefect_api, fake_aws_env, s3_endpoint, tmp_path, fault_row
):
    # INITIAL_NO_AUTH_ACTION_COUNT=1: moto serves the first request (creating the bucket) without checking
    # credentials, then authenticates every request: the session's fake credentials are unknown to it.
    server = OutageMotoServer(env={"INITIAL_NO_AUTH_ACTION_COUNT": "1"}).start()
    try:
        bucket = f"forge-denied-{uuid.uuid4().hex[:8]}"
        ObjectStore(f"s3://{bucket}/run", endpoint_url=server.observer_url).fs.call_s3(
            "create_bucket", Bucket=bucket
        )
        denied = _failed_once(
            prepare_only(
                _config(
                    tmp_path,
                    [f"storage.root=s3://{bucket}/run", f"storage.endpoint_url={server.endpoint_url}"],
                ),
                return_state=True,
            ),
            "prepare_data",
        )
    finally:
        server.close()
    assert "access denied" in denied and f"s3://{bucket}/run" in denied, denied
    assert "check the AWS credentials" in denied and "bucket policy" in denied, denied

    missing_bucket = f"forge-missing-{uuid.uuid4().hex[:8]}"
    missing = _failed_once(
        prepare_only(
            _config(
                tmp_path, [f"storage.root=s3://{missing_bucket}/run", f"storage.endpoint_url={s3_endpoint}"]
            ),
            return_state=True,
        ),
        "prepare_data",
    )
    assert f"bucket '{missing_bucket}' does not exist" in missing and "create it" in missing, missing
    fault_row.fact("both: run_count=1, StorageAccessError with its fix in the flow's failure")


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real tmpfs of 4 MiB at tmp_path/"disk", filled up but for 128 KiB: room for the task's spec and lease
    objects, not for the data the prepare worker writes (~400 KB with the demo's default sizes)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], check=False, capture_output=True
    )
    if mount.returncode != 0:
        pytest.skip(
            f"cannot mount a tmpfs here ({mount.stderr.decode().strip()}); needs root or CAP_SYS_ADMIN"
        )
    try:
        stat = os.statvfs(disk)
        (disk / "filler").write_bytes(b"\0" * (stat.f_bavail * stat.f_frsize - 128 * 1024))
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


@pytest.mark.fault(
    fault="the store's disk is full: a real 4 MiB tmpfs with 128 KiB left, the prepare worker's data does not fit",
    where="prepare_data task (plain worker) on file:// on the tmpfs, 2 retries allowed",
    checked="ENOSPC is fatal although an OSError: the task runs once; the flow's failure names the file "
    "and the fix (free space, lower storage.keep_checkpoints / the policy cache)",
)
def test_a_full_disk_fails_at_once_with_the_fix(prefect_api, small_tmpfs, tmp_path, fault_row):
    demo_sizes = ("data.demo.num_sft=1500", "data.demo.num_rl=7000", "data.demo.num_eval=500")
    config = _config(tmp_path, [f"storage.root=file://{small_tmpfs}/store"], *demo_sizes)
    message = _failed_once(prepare_only(config, return_state=True), "prepare_data")
    assert "No space left on device" in message, message
    assert f"Fix: the disk or quota holding {small_tmpfs}/store/" in message, message
    assert "storage.keep_checkpoints" in message and "policy cache" in message, message
    fault_row.fact("run_count=1; the fix names the file on the full disk")


@pytest.mark.fault(
    fault="16 bytes of the committed data artifact's sft.parquet inverted between prepare and SFT",
    where="train_sft task (torchrun, 2 ranks) reading its input, 2 retries allowed",
    checked="ArtifactCorrupted (the sha256 check) is fatal: the task runs once; the flow's failure names the "
    "artifact, the file and the fix (delete the prefix so the producing stage runs again)",
)
def test_a_corrupted_input_artifact_fails_at_once_with_the_fix(prefect_api, tmp_path, fault_row):
    config = _config(tmp_path, [f"storage.root=file://{tmp_path}/store"])
    data_uri = prepare_only(config)
    (sft_table,) = Path(data_uri.removeprefix("file://")).rglob("sft.parquet")
    flip_bytes(sft_table)
    message = _failed_once(sft_only(config, data_uri, return_state=True), "train_sft")
    assert "sft.parquet" in message and data_uri in message, message
    assert f"Fix: the committed artifact {data_uri} no longer matches its manifest" in message, message
    assert f"delete the prefix {data_uri}" in message, message
    fault_row.fact("run_count=1; the fix names the artifact to delete")


@pytest.mark.fault(
    fault="data.source names a file that does not exist (FileNotFoundError), or a folder where a file is read "
    "(IsADirectoryError)",
    where="prepare_data task (file://), 2 retries allowed",
    checked="a missing path is fatal, not retried like a transient OSError: the task runs once and the flow's "
    "failure names the path",
)
def test_a_missing_input_path_fails_at_once_naming_it(prefect_api, tmp_path, fault_row):
    from forge_core.launch.errors import Category, classify_exception

    missing = tmp_path / "nowhere" / "rows.jsonl"
    storage = [f"storage.root=file://{tmp_path}/store"]
    config = _config(tmp_path, storage, f"data.source={missing}", "data.tokenizer.vocab_size=300")
    state = prepare_only(config, return_state=True)
    message = _failed_once(state, "prepare_data")
    assert str(missing) in message, message
    for error in (IsADirectoryError(21, "Is a directory", str(tmp_path)), FileNotFoundError(2, "No such", str(missing))):
        found = classify_exception(error)
        assert found.category is Category.FATAL and error.filename in found.fix, (error, found)
    fault_row.fact("run_count=1; the flow's failure names the missing file")
