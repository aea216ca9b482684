"""SFT under Prefect with a hung rank, a killed rank and a corrupted checkpoint (scenario 3 in scenarios.py),
compared with the uninterrupted SFT of scenario 1 (same config, same seed, CPU)."""

from __future__ import annotations

import pytest
import torch
from fault_kit import attempts, policy_weights, step_metrics, wait_until_gone

pytestmark = pytest.mark.integration


@pytest.mark.fault(
    fault="SFT rank 1 hangs after step 1 (`hang_rank:1:1@sft`)",
    where="train_sft task (torchrun, 2 ranks)",
    checked="the stage's deadline fires (its runner ends the launch; the launcher's own deadline is a backstop "
    "behind it); every process of the hung attempt is gone; the task is retried and the stage completes",
)
def test_hung_rank_hits_the_stage_deadline_and_the_retry_succeeds(faulted_run, fault_row):
    assert faulted_run.state.is_completed(), faulted_run.state.message
    deadline_lines = [line for line in faulted_run.logs if "deadline of" in line and "exceeded" in line]
    assert deadline_lines, "no deadline line in the train_sft logs"
    assert faulted_run.task_runs["train_sft"].run_count == 3  # hung, killed, completed
    sft_launches = [
        launch
        for launch in faulted_run.launch_ids
        if any(p.launch_id == launch and "forge_core.run sft" in p.cmdline for p in faulted_run.processes)
    ]
    hung = [p for p in faulted_run.processes if p.launch_id == sft_launches[0]]
    assert len(hung) >= 3, hung  # torchrun and both ranks were seen
    assert wait_until_gone(faulted_run.processes, timeout_s=10) == []
    fault_row.fact(
        f"deadline {faulted_run.deadline_s:.0f} s; {len(hung)} processes of the hung attempt ended; "
        f"scenario {faulted_run.wall_s:.0f} s, sft attempts: {', '.join(attempts(faulted_run.logs, 'sft'))}"
    )


@pytest.mark.fault(
    fault="SFT rank 1 SIGKILLed after step 3 (`kill_rank:1:3@sft`)",
    where="train_sft task (torchrun, 2 ranks)",
    checked="the task is retried; the stage resumes from a committed checkpoint, not step 0; every step's "
    "loss and grad norm and the exported weights equal the uninterrupted run's bitwise",
)
def test_killed_rank_is_retried_resumes_and_ends_like_an_uninterrupted_run(
    faulted_run, killed_flow, fault_row, tmp_path
):
    assert faulted_run.state.is_completed(), faulted_run.state.message
    store, ref_store = faulted_run.store, killed_flow.store
    manifest = store.read_manifest(faulted_run.uris["sft"])
    assert manifest.metrics["resumed_from_step"] >= 1
    (ref_sft,) = ref_store.list_committed("sft")
    faulted = step_metrics(faulted_run.root / "runs" / "tiny-test-sft")
    reference = step_metrics(killed_flow.root / "runs" / "tiny-test-sft")
    steps = sorted(reference)
    assert steps == sorted(faulted) and len(steps) == manifest.metrics["steps"]
    for key in ("loss", "grad_norm"):
        assert [faulted[s][key] for s in steps] == [reference[s][key] for s in steps], key
    mine = policy_weights(store, faulted_run.uris["sft"], tmp_path / "faulted")
    theirs = policy_weights(ref_store, ref_sft, tmp_path / "reference")
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    fault_row.fact(
        f"resumed from step {manifest.metrics['resumed_from_step']}; {len(steps)} losses and "
        f"{len(mine)} tensors equal"
    )


@pytest.mark.fault(
    fault="bytes of the committed step-2 checkpoint overwritten after commit (same size)",
    where="SFT resume (rank 0 verifies before DCP loads)",
    checked="the manifest sha256 check names the corrupt file; resume falls back to the step-1 checkpoint; "
    "the corrupt checkpoint is refused with ArtifactCorrupted when read directly",
)
def test_corrupted_checkpoint_is_detected_and_resume_falls_back(faulted_run, fault_row):
    from forge_core.engine import committed_checkpoints
    from forge_core.engine.checkpoint import verify_checkpoint
    from forge_core.storage import ArtifactCorrupted

    assert faulted_run.corrupted, "the kill at step 3 never fired, so nothing was corrupted"
    corrupt_file = faulted_run.corrupted[0].rsplit("/", 1)[1]
    warnings = [line for line in faulted_run.logs if "is corrupt, falling back" in line]
    assert warnings and corrupt_file in warnings[0], warnings
    store = faulted_run.store
    assert store.read_manifest(faulted_run.uris["sft"]).metrics["resumed_from_step"] == 1
    step2 = next(c for c in committed_checkpoints(store, faulted_run.uris["sft"]) if c.step == 2)
    with pytest.raises(ArtifactCorrupted, match=corrupt_file):
        verify_checkpoint(store, step2)
    fault_row.fact(f"corrupted {corrupt_file}; resumed from step 1")
