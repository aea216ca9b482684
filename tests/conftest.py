"""Fixtures shared by every test area.

- `s3_endpoint` (session): a real moto S3 server on 127.0.0.1 (ThreadedMotoServer), with fake AWS
  credentials in the environment for the whole session; yields its endpoint URL.
- `s3_store`: an ObjectStore on a fresh bucket of that server, one bucket per test.
- `file_store`: an ObjectStore on a fresh local folder.

Areas add their own fixtures in tests/<area>/conftest.py.
"""

from __future__ import annotations

import socket
import uuid

import pytest

# Recognisable fake secrets: tests assert they never show up in manifests, logs or messages.
FAKE_AWS_ACCESS_KEY_ID = "FORGETESTKEYID0000001"
FAKE_AWS_SECRET_ACCESS_KEY = "forge-test-secret-value-do-not-leak-7f3a9c"
# Small retry settings keep failing-path tests fast; the retry test sets its own.
TEST_RETRIES = 3
TEST_RETRY_BACKOFF_S = 0.05


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "integration: starts real servers or processes (moto, torchrun, vLLM)")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RestartableMotoServer:
    """A moto S3 server on 127.0.0.1:<port> that can go away and come back on the same port (fault tests)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.endpoint_url = f"http://127.0.0.1:{port}"
        self._server = None

    def start(self) -> None:
        from moto.server import ThreadedMotoServer

        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()

    def stop(self) -> None:
        """Stop serving and close the listening socket, so that new connections are refused."""
        if self._server is None:
            return
        self._server.stop()
        # ThreadedMotoServer.stop() only ends serve_forever(); the still-open listening socket would queue new
        # connections (clients hang until their read timeout) instead of refusing them like a dead server.
        self._server._server.server_close()
        self._server = None


@pytest.fixture
def moto_server_factory(fake_aws_env):
    """`start(port) -> RestartableMotoServer`: extra moto servers for fault tests, stopped at teardown."""
    servers: list[RestartableMotoServer] = []

    def start(port: int | None = None) -> RestartableMotoServer:
        server = RestartableMotoServer(port or free_port())
        server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="session")
def fake_aws_credentials() -> dict[str, str]:
    """The fake secrets set for the session, for tests asserting that they never leak."""
    return {"AWS_ACCESS_KEY_ID": FAKE_AWS_ACCESS_KEY_ID, "AWS_SECRET_ACCESS_KEY": FAKE_AWS_SECRET_ACCESS_KEY}


@pytest.fixture(scope="session")
def fake_aws_env():
    """Fake credentials for the session; no profile or instance metadata lookups."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AWS_ACCESS_KEY_ID", FAKE_AWS_ACCESS_KEY_ID)
        mp.setenv("AWS_SECRET_ACCESS_KEY", FAKE_AWS_SECRET_ACCESS_KEY)
        mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
        mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
        for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "FORGE_S3_ENDPOINT_URL"):
            mp.delenv(name, raising=False)
        yield


@pytest.fixture(scope="session")
def s3_endpoint(fake_aws_env):
    """URL of a moto S3 server running in this process for the whole session."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


def new_s3_store(
    endpoint_url: str, retries: int = TEST_RETRIES, retry_backoff_s: float = TEST_RETRY_BACKOFF_S
):
    """An ObjectStore on a newly created bucket at `endpoint_url` (root s3://<bucket>/root)."""
    from forge_core.storage import ObjectStore

    bucket = f"forge-test-{uuid.uuid4().hex[:12]}"
    store = ObjectStore(
        f"s3://{bucket}/root", endpoint_url=endpoint_url, retries=retries, retry_backoff_s=retry_backoff_s
    )
    # Through the store's own client: a separate boto3 client would cost a second to create.
    store.fs.call_s3("create_bucket", Bucket=bucket)
    return store


@pytest.fixture
def s3_store(s3_endpoint):
    """An ObjectStore rooted at s3://<fresh bucket>/root on the moto server."""
    return new_s3_store(s3_endpoint)


@pytest.fixture
def file_store(tmp_path):
    """An ObjectStore rooted at a fresh local folder."""
    from forge_core.storage import ObjectStore

    return ObjectStore(f"file://{tmp_path}/store", retries=TEST_RETRIES, retry_backoff_s=TEST_RETRY_BACKOFF_S)


# Suites written in the last hours of session 1 whose full runs were not yet verified end to end (Prefect
# flows, deployment path, fault injection, security). `make test` leaves them out until a session has seen
# them pass from a fresh clone; `make test-all` runs them. Remove a folder from this list once verified.
UNVERIFIED_SUITES = ("tests/flows/", "tests/deploy/", "tests/faults/", "tests/security/")


def pytest_collection_modifyitems(config, items) -> None:
    root = str(config.rootpath)
    for item in items:
        rel = str(item.path)[len(root) + 1 :] if str(item.path).startswith(root) else str(item.path)
        if rel.startswith(UNVERIFIED_SUITES):
            item.add_marker(pytest.mark.unverified)
