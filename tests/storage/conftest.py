"""`store`: the same test body against memory://, file:// and s3:// (moto) stores."""

from __future__ import annotations

import uuid

import pytest

from forge_core.storage import ObjectStore


@pytest.fixture(params=["memory", "file", pytest.param("s3", marks=pytest.mark.integration)])
def store(request):
    if request.param == "memory":
        memory_store = ObjectStore(f"memory://forge-test-{uuid.uuid4().hex[:12]}")
        yield memory_store
        root = memory_store.path_of(memory_store.root)
        if memory_store.fs.exists(root):
            memory_store.fs.rm(root, recursive=True)
    elif request.param == "file":
        yield request.getfixturevalue("file_store")
    else:
        yield request.getfixturevalue("s3_store")


@pytest.fixture
def overwrite_object():
    """Overwrite (or with data=None delete) a stored object behind the store's back, as bit rot or a
    buggy tool would."""

    def overwrite(store: ObjectStore, uri: str, data: bytes | None) -> None:
        path = store.path_of(uri)
        if data is None:
            store.fs.rm_file(path)
        else:
            store.fs.pipe_file(path, data)

    return overwrite


@pytest.fixture(scope="session")
def atomic_s3_endpoint(fake_aws_env):
    """A moto S3 server (a child process) whose PutObject is atomic like S3's (atomic_moto_process.py)."""
    import socket
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    script = Path(__file__).with_name("atomic_moto_process.py")
    server = subprocess.Popen(
        [sys.executable, str(script), str(port)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout.readline().strip() == "up", "the atomic moto server did not start"
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stdin.close()
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
