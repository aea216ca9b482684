"""Fixtures of the security tests. The secret-leak test reads the S3 outage run of the fault suite
(tests/faults/scenarios.py): one run, with fake credentials planted, serves both folders."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "faults"))

from fault_kit import PREFECT_API, forbidden_modules_loaded, prefect_environment

prefect_environment(Path(tempfile.mkdtemp(prefix="forge-security-prefect-home-")))


@pytest.fixture(scope="session")
def prefect_api():
    url = PREFECT_API.acquire()
    try:
        yield url
    finally:
        PREFECT_API.release()


@pytest.fixture(scope="session")
def outage_run(prefect_api, fake_aws_credentials, fake_aws_env, tmp_path_factory):
    """The fault suite's S3 run (moto server killed mid checkpoint commit), run once per session."""
    from scenarios import FAKE_WANDB_API_KEY, s3_outage

    secrets = {**fake_aws_credentials, "WANDB_API_KEY": FAKE_WANDB_API_KEY}
    return s3_outage(tmp_path_factory.mktemp("s3-outage"), secrets)


@pytest.fixture(autouse=True)
def _keeps_flask_out_of_the_test_process(request):
    """After each test: no moto server / Flask in this process (see tests/faults/conftest.py)."""
    yield
    loaded = forbidden_modules_loaded()
    assert not loaded, f"{request.node.nodeid} left {loaded} in sys.modules of the pytest process"
