"""Credentials never appear in manifests, logs, Prefect artifacts or exceptions.

The S3 run of the fault suite runs with recognisable fake secrets in the environment of every process
(AWS keys, a wandb key) and includes failures (a storage outage mid-commit, retried), so error paths are
covered too. Every output it produced is then searched for every secret, byte for byte. Credentials inside
URLs (a tokenised data source, an S3 endpoint with user:password@) are tested in test_credentials_in_urls.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from scenarios import prefect_text_everywhere

pytestmark = pytest.mark.integration


def _files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


def _leaks(data: bytes, secrets: dict[str, str]) -> list[str]:
    return [name for name, value in secrets.items() if value.encode() in data]


def test_fake_secrets_appear_in_no_output_of_a_failing_and_retried_s3_run(outage_run):
    secrets = outage_run.secrets
    assert set(secrets) == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "WANDB_API_KEY"}
    bucket_files = _files(outage_run.bucket_dump)
    run_files = _files(outage_run.run_dir)
    # What is searched must be there: manifests, specs, checkpoints, wandb's offline run, the retry's errors.
    assert any(p.name == "_MANIFEST.json" for p in bucket_files)
    assert any(p.parent.name == "_specs" for p in bucket_files)  # the task attempts' stage specs
    assert any("wandb" in p.parts for p in run_files), (
        "no wandb offline files: the wandb key was never in play"
    )
    prefect_text = prefect_text_everywhere()
    assert "writing shards failed" in prefect_text  # the failed SFT attempt's error (the S3 outage)

    found = {}
    for path in bucket_files + run_files:
        if leaked := _leaks(path.read_bytes(), secrets):
            found[str(path)] = leaked
    if leaked := _leaks(prefect_text.encode(), secrets):
        found["Prefect logs and artifacts"] = leaked
    if leaked := _leaks("\n".join(outage_run.state_messages).encode(), secrets):
        found["flow and task state messages"] = leaked
    assert found == {}, f"secrets found in outputs: {found}"


def test_what_the_store_hands_to_other_tools_carries_no_credentials(fake_aws_credentials, fake_aws_env):
    """storage_options travel into DCP, fsspec calls and specs; repr into logs and messages."""
    import json

    from forge_core.storage import ObjectStore

    store = ObjectStore("s3://some-bucket/run", endpoint_url="http://127.0.0.1:9", retries=0)
    exposed = json.dumps(store.storage_options) + repr(store) + store.fsspec_path(store.root)
    assert "127.0.0.1:9" in exposed  # the endpoint is there, so the options are what we think they are
    assert _leaks(exposed.encode(), fake_aws_credentials) == []
