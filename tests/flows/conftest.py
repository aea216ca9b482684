"""A real Prefect API for flow tests: the test harness (SQLite, in-process server) in a temp PREFECT_HOME."""

from __future__ import annotations

import os
import tempfile

import pytest

# Before Prefect reads its settings: isolate its home and give a cold SQLite database time to start.
os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="forge-prefect-home-"))
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "INFO")


@pytest.fixture(scope="session")
def prefect_api():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture
def tiny_overrides(tmp_path):
    """Overrides that point the tiny test config at a fresh local store and run dir."""
    return [
        f"storage.root=file://{tmp_path}/store",
        f"logging.dir={tmp_path}/runs",
    ]
