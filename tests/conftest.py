"""Fixtures shared by every test area.

- `s3_endpoint` (session): a real moto S3 server on 127.0.0.1 (a child process), with fake AWS
  credentials in the environment for the whole session; yields its endpoint URL.
- `s3_store`: an ObjectStore on a fresh bucket of that server, one bucket per test.
- `file_store`: an ObjectStore on a fresh local folder.
- `ray_cluster` (session): a real Ray cluster of several raylets on 127.0.0.1 (tests/ray_cluster.py), started
  after the fake AWS credentials are in the environment, so that every Ray worker has them. The suites that run
  stages (STAGE_SUITES) join it before each test, so every stage this process runs computes on it (a flow
  run joins the cluster its process is connected to) instead of starting an embedded Ray of its own.

Areas add their own fixtures in tests/<area>/conftest.py.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

# Recognisable fake secrets: tests assert they never show up in manifests, logs or messages.
FAKE_AWS_ACCESS_KEY_ID = "FORGETESTKEYID0000001"
FAKE_AWS_SECRET_ACCESS_KEY = "forge-test-secret-value-do-not-leak-7f3a9c"
# What a process talking to the moto server sets (fake credentials, no metadata lookups) and removes (anything
# that would point boto elsewhere): the session fixture `fake_aws_env` and bench/stage_dispatch.py.
FAKE_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": FAKE_AWS_ACCESS_KEY_ID,
    "AWS_SECRET_ACCESS_KEY": FAKE_AWS_SECRET_ACCESS_KEY,
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}
AWS_ENV_UNSET = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "FORGE_S3_ENDPOINT_URL")
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
    """A moto S3 server on 127.0.0.1:<port> in a child process; it can go away and come back on the same port
    with its data intact (fault tests). See tests/moto_server_process.py for why it is not in this process."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.endpoint_url = f"http://127.0.0.1:{port}"
        self._process: subprocess.Popen | None = None

    def start(self) -> None:
        if self._process is None:
            script = Path(__file__).with_name("moto_server_process.py")
            self._process = subprocess.Popen(
                [sys.executable, str(script), str(self.port)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            self._expect("up")
        else:
            self._command("start", "up")

    def stop(self) -> None:
        """Stop serving and close the listening socket, so that new connections are refused."""
        if self._process is not None:
            self._command("stop", "down")

    def close(self) -> None:
        if self._process is None:
            return
        self._process.stdin.close()
        try:
            self._process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._process = None

    def _command(self, command: str, answer: str) -> None:
        self._process.stdin.write(command + "\n")
        self._process.stdin.flush()
        self._expect(answer)

    def _expect(self, answer: str) -> None:
        line = self._process.stdout.readline().strip()
        assert line == answer, f"moto server process answered {line!r}, expected {answer!r}"


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
        server.close()


@pytest.fixture(scope="session")
def fake_aws_credentials() -> dict[str, str]:
    """The fake secrets set for the session, for tests asserting that they never leak."""
    return {"AWS_ACCESS_KEY_ID": FAKE_AWS_ACCESS_KEY_ID, "AWS_SECRET_ACCESS_KEY": FAKE_AWS_SECRET_ACCESS_KEY}


@pytest.fixture(scope="session")
def fake_aws_env():
    """Fake credentials for the session; no profile or instance metadata lookups."""
    with pytest.MonkeyPatch.context() as mp:
        for name, value in FAKE_AWS_ENV.items():
            mp.setenv(name, value)
        for name in AWS_ENV_UNSET:
            mp.delenv(name, raising=False)
        yield


@pytest.fixture(scope="session")
def s3_endpoint(fake_aws_env):
    """URL of a moto S3 server (a child process) running for the whole session."""
    server = RestartableMotoServer(free_port())
    server.start()
    try:
        yield server.endpoint_url
    finally:
        server.close()


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


# Suites whose tests run stages, which run on a Ray cluster: the test run's (module docstring).
STAGE_SUITES = tuple(
    f"tests/{area}/"
    for area in ("bench", "deploy", "envs", "faults", "flows", "gpu", "integration", "models", "rollout", "run",
                 "security", "trainers")
)  # fmt: skip


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory, fake_aws_env):
    from tests.ray_cluster import start_ray_cluster

    yield from start_ray_cluster(tmp_path_factory)


@pytest.fixture(autouse=True)
def _stages_on_the_session_cluster(request) -> None:
    root = str(request.config.rootpath)
    rel = str(request.node.path)[len(root) + 1 :]
    if rel.startswith(STAGE_SUITES):
        request.getfixturevalue("ray_cluster")
