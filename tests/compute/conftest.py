"""The compute tests' worker module on PYTHONPATH (the Ray cluster is the session's: tests/ray_cluster.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

WORKERS_DIR = Path(__file__).parent


@pytest.fixture
def workers_env() -> dict[str, str]:
    existing = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(WORKERS_DIR), existing]))}
