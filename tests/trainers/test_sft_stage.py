"""The SFT stage worker (`forge_core.run.sft:train` through the worker scaffold): bad inputs fail with clear errors; under real torchrun,
2 ranks follow the 1-rank loss curve, and a rank SIGKILLed mid-run resumes to identical losses and weights."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from sft_helpers import committed_data_artifact, one_intra_op_thread, sft_spec, sft_test_config  # noqa: F401 (fixture)

from forge_core.engine import committed_checkpoints
from forge_core.run.scaffold import run_spec
from forge_core.run.spec import StageSpec, read_spec
from forge_core.storage import ObjectStore
from tests.two_ranks import torchrun_two_ranks

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def test_missing_data_artifact_is_named(tmp_path):
    cfg = sft_test_config(tmp_path)
    store = ObjectStore.from_config(cfg.storage)
    missing = store.artifact_uri("data", "never-written")
    with pytest.raises(
        ValueError, match=rf"inputs.data={missing}: cannot read the data artifact: .*not committed"
    ):
        run_spec(read_spec(sft_spec(cfg, missing, "bad-data")))


def test_unknown_model_flavor_is_named(tmp_path):
    cfg = sft_test_config(tmp_path)
    spec = read_spec(sft_spec(cfg, committed_data_artifact(cfg), "bad-flavor"))
    config = {**spec.config, "model": {**spec.config["model"], "flavor": "huge"}}
    bad = StageSpec(stage="sft", config=config, inputs=spec.inputs, output_uri=spec.output_uri)
    with pytest.raises(ValueError, match=r"model.flavor='huge': unknown flavor .* valid flavors: \['tiny'"):
        run_spec(bad)


def _torchrun(spec_uri: str, env_extra: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    return torchrun_two_ranks("-m", "forge_core.run", "sft", "--spec", spec_uri, env=env_extra, timeout=timeout)


def _step_metrics(cfg, run_name: str) -> dict[int, dict]:
    path = Path(cfg.logging.dir) / run_name / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return {r["step"]: r for r in records if "loss" in r}


def _policy_weights(store: ObjectStore, key: str, tmp_path: Path) -> dict[str, torch.Tensor]:
    local = store.reader(store.join(store.artifact_uri("sft", key), "policy")).download_dir(
        "", tmp_path / key
    )
    return load_file(local / "model.safetensors")


@pytest.mark.integration
def test_two_ranks_match_one_rank_and_resume_exactly_after_sigkill(tmp_path):
    """Tolerances: 2 ranks vs 1 rank (FSDP over gloo vs one process, fp32): 1e-5 relative on every step's loss
    and gradient norm. Killed-and-resumed vs uninterrupted (both 2 ranks): bitwise equal."""
    names = {key: sft_test_config(tmp_path, f"name={key}") for key in ("one", "ref", "killed")}
    store = ObjectStore.from_config(names["ref"].storage)
    data_uri = committed_data_artifact(names["ref"])

    # 1 rank, in this process (world size 1 without torchrun).
    run_spec(read_spec(sft_spec(names["one"], data_uri, "one")))

    ref = _torchrun(sft_spec(names["ref"], data_uri, "ref"), {})
    assert ref.returncode == 0, ref.stderr[-3000:]

    killed_spec = sft_spec(names["killed"], data_uri, "killed")
    killed = _torchrun(killed_spec, {"FORGE_FAULT": "kill_rank:1:3"})
    assert killed.returncode != 0 and "kill_rank after step 3" in killed.stderr
    killed_uri = store.artifact_uri("sft", "killed")
    assert not store.is_committed(killed_uri)
    assert [c.step for c in committed_checkpoints(store, killed_uri)] == [2]

    resumed = _torchrun(killed_spec, {})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "SFT resumes after step 2" in resumed.stderr + resumed.stdout

    one, two = _step_metrics(names["one"], "one-sft"), _step_metrics(names["ref"], "ref-sft")
    worst = max(
        abs(one[s][k] - two[s][k]) / abs(one[s][k]) for s in range(1, 7) for k in ("loss", "grad_norm")
    )
    print(f"1 rank vs 2 ranks: max relative diff of loss/grad_norm over 6 steps {worst:.2e}")
    assert worst < 1e-5

    after_resume = _step_metrics(names["killed"], "killed-sft")  # steps 1-2, then 3-6 after the resume
    assert [after_resume[s]["loss"] for s in range(1, 7)] == [two[s]["loss"] for s in range(1, 7)]
    assert [after_resume[s]["grad_norm"] for s in range(1, 7)] == [two[s]["grad_norm"] for s in range(1, 7)]
    final_ref, final_resumed = (
        _policy_weights(store, "ref", tmp_path),
        _policy_weights(store, "killed", tmp_path),
    )
    assert all(torch.equal(final_ref[k], final_resumed[k]) for k in final_ref)

    manifest = store.read_manifest(killed_uri)
    assert manifest.kind == "sft" and manifest.inputs["data"].uri == data_uri
    assert manifest.metrics["resumed_from_step"] == 2 and manifest.metrics["steps"] == 6
    assert manifest.metrics["final_loss"] == two[6]["loss"] and manifest.metrics["eval_loss"] > 0
