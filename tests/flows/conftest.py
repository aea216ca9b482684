"""A real Prefect API for flow tests: the test harness (SQLite, a server subprocess) in a temp PREFECT_HOME,
once per session, and one object store for the tiny-config tests of the session.

Stage outputs are content-addressed, so a stage another test already committed with the same config is skipped,
as a re-run would: the data prep of the tiny config runs once per session. A test that needs a stage to really
run (a fault inside it) gives that stage a config no other test uses, so it holds in any order.
"""

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
def prefect_api() -> str:
    """The harness's API URL (for flow processes the test starts itself)."""
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield PREFECT_API_URL.value()


@pytest.fixture(scope="session")
def tiny_overrides(tmp_path_factory) -> list[str]:
    """Overrides that point the tiny test config at this session's store and run dir."""
    root = tmp_path_factory.mktemp("tiny")
    return [
        f"storage.root=file://{root}/store",
        f"logging.dir={root}/runs",
    ]
