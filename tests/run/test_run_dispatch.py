"""`python -m forge_core.run <stage> --spec <uri>`: argument checks, spec reading, error recording."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from forge_core.config import config_to_dict, load_config
from forge_core.run.__main__ import _error_recorder, _run_stage
from forge_core.run.spec import StageSpec, write_spec
from forge_core.stages import BUILTIN_STAGES


def test_unknown_stage_fails_fast_listing_the_stages():
    proc = subprocess.run(
        [sys.executable, "-m", "forge_core.run", "nosuchstage", "--spec", "x"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2
    assert "unknown stage 'nosuchstage'; valid stages: prepare, sft, rollout, grpo, evaluate" in proc.stderr
    assert all(stage.name in proc.stderr for stage in BUILTIN_STAGES)


def test_spec_is_required():
    proc = subprocess.run(
        [sys.executable, "-m", "forge_core.run", "sft"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2 and "--spec" in proc.stderr


def written_spec(store, stage: str) -> str:
    spec = StageSpec(
        stage=stage,
        config=config_to_dict(load_config(None, ["seed=5"])),
        inputs={},
        output_uri=store.artifact_uri("eval", "k"),
        params={"iteration": 1},
    )
    return write_spec(store, spec)


def test_stage_main_receives_the_spec(file_store):
    uri = written_spec(file_store, "evaluate")
    received = []
    _run_stage("evaluate", uri, None, received.append)
    (spec,) = received
    assert spec.stage == "evaluate" and spec.params == {"iteration": 1} and spec.run_config().seed == 5


def test_stage_mismatch_is_recorded_in_the_torchelastic_error_file(file_store, tmp_path, monkeypatch):
    uri = written_spec(file_store, "prepare")
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    never_called = []
    with pytest.raises(ValueError, match="is for stage 'prepare', but the worker was started as 'sft'"):
        _error_recorder()(_run_stage)("sft", uri, None, never_called.append)
    assert never_called == []
    recorded = json.loads(error_file.read_text())
    assert "is for stage 'prepare'" in json.dumps(recorded)
