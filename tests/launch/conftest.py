"""Fixtures for the launcher tests: worker scripts on PYTHONPATH and a line recorder."""

import os
from pathlib import Path

import pytest
from launch_helpers import LineRecorder

WORKERS_DIR = Path(__file__).parent / "workers"


@pytest.fixture
def workers_env() -> dict[str, str]:
    """Extra env for a LaunchSpec so `-m dist_worker` / `-m plain_worker` resolve."""
    existing = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(WORKERS_DIR), existing]))}


@pytest.fixture
def recorder() -> LineRecorder:
    return LineRecorder()
