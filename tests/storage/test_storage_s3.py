"""S3 specifics against a real moto server: endpoint resolution, fail-fast and retried errors, secrets."""

from __future__ import annotations

import logging
import threading
import time

import pytest
from botocore.exceptions import ClientError

from forge_core.storage import (
    ObjectStore,
    Retrier,
    StorageAccessError,
    StorageUnavailable,
)

pytestmark = pytest.mark.integration


def test_endpoint_comes_from_config_then_env(s3_endpoint, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")
    monkeypatch.setenv("FORGE_S3_ENDPOINT_URL", s3_endpoint)
    assert ObjectStore("s3://bucket/root").storage_options == {"client_kwargs": {"endpoint_url": s3_endpoint}}
    configured = ObjectStore("s3://bucket/root", endpoint_url="http://127.0.0.1:2", region="eu-west-1")
    assert configured.storage_options == {
        "client_kwargs": {"endpoint_url": "http://127.0.0.1:2", "region_name": "eu-west-1"}
    }
    assert ObjectStore("memory://x").storage_options == {}


def test_missing_bucket_fails_fast_with_a_clear_message(s3_endpoint):
    store = ObjectStore("s3://forge-no-such-bucket/root", endpoint_url=s3_endpoint, retries=3)
    with pytest.raises(
        StorageAccessError,
        match=r"storage.root=s3://forge-no-such-bucket/root: bucket "
        r"'forge-no-such-bucket' does not exist",
    ):
        store.is_committed(store.artifact_uri("data", "k"))
    assert store.retrier.retried == 0


def _raise(exc):
    def fail():
        raise exc

    return fail


def test_retrier_classifies_s3_errors():
    def client_error(code):
        return ClientError({"Error": {"Code": code, "Message": code}}, "GetObject")

    denied = Retrier(retries=3, backoff_s=0.0)
    with pytest.raises(StorageAccessError, match="access denied"):
        denied.call("get s3://b/k", _raise(client_error("AccessDenied")))
    assert denied.retried == 0

    throttled = Retrier(retries=2, backoff_s=0.0)
    with pytest.raises(StorageUnavailable, match="still failing after 2 retries"):
        throttled.call("get s3://b/k", _raise(client_error("SlowDown")))
    assert throttled.retried == 2

    missing = Retrier(retries=3, backoff_s=0.0)
    with pytest.raises(FileNotFoundError):
        missing.call("get s3://b/k", _raise(FileNotFoundError("s3://b/k")))
    assert missing.retried == 0


def test_write_during_an_outage_succeeds_after_the_server_returns(
    moto_server_factory, fake_aws_credentials, caplog
):
    """A real fault: the S3 server goes away (connections refused) and comes back on the same port."""
    server = moto_server_factory()
    endpoint = server.endpoint_url
    bucket = "forge-outage-bucket"
    ObjectStore(f"s3://{bucket}", endpoint_url=endpoint).fs.call_s3("create_bucket", Bucket=bucket)
    server.stop()
    # The stores below use other client options (region) than the one above, so they share no pooled
    # keep-alive connection with the old server: every request of theirs meets the outage.
    restarter = None
    try:
        impatient = ObjectStore(
            f"s3://{bucket}/root", endpoint_url=endpoint, region="us-east-1", retries=1, retry_backoff_s=0.01
        )
        with pytest.raises(StorageUnavailable, match="still failing after 1 retries") as info:
            impatient.is_committed(impatient.artifact_uri("data", "k"))
        assert fake_aws_credentials["AWS_SECRET_ACCESS_KEY"] not in str(info.value)

        restarter = threading.Thread(target=lambda: (time.sleep(1.0), server.start()))
        restarter.start()
        store = ObjectStore(
            f"s3://{bucket}/root", endpoint_url=endpoint, region="us-east-1", retries=8, retry_backoff_s=0.1
        )
        uri = store.artifact_uri("data", "during-outage")
        with caplog.at_level(logging.WARNING, logger="forge_core.storage.retry"):
            w = store.writer(uri, kind="data", stage="prepare")  # issued while the server is down
            w.write_bytes("a.bin", b"survived")
            w.commit(config={}, inputs={}, metrics={})
        assert store.retrier.retried >= 1
        assert any("retry 1/8" in record.getMessage() for record in caplog.records)
        assert store.reader(uri).read_bytes("a.bin") == b"survived"
    finally:
        if restarter is not None:
            restarter.join()


def test_credentials_never_reach_manifests_or_options(s3_store, s3_endpoint, fake_aws_credentials):
    config = {"storage": {"root": s3_store.root, "endpoint_url": s3_endpoint, "region": None}, "lr": 0.1}
    uri = s3_store.artifact_uri("data", "secrets")
    w = s3_store.writer(uri, kind="data", stage="prepare")
    w.write_bytes("a.bin", b"a")
    w.commit(config=config, inputs={}, metrics={})
    text = s3_store.manifest_bytes(uri).decode()
    for secret in fake_aws_credentials.values():
        assert secret not in text
        assert secret not in repr(s3_store.storage_options)
        assert secret not in repr(s3_store)
    assert s3_endpoint in text  # the endpoint is configuration, not a secret
