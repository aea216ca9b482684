"""The S3 server dies in the middle of a checkpoint commit and comes back (scenario 4 in scenarios.py)."""

from __future__ import annotations

import pytest
from fault_kit import attempts
from scenarios import OUTAGE_S

pytestmark = pytest.mark.integration


@pytest.mark.fault(
    fault=f"moto S3 server stopped on the PUT of the step-4 checkpoint manifest, restarted {OUTAGE_S:g} s later",
    where="train_sft task on s3:// (DCP shards written, manifest not)",
    checked="no artifact ever looked committed without all its files verifying (polled throughout); the "
    "step-4 checkpoint was not committed after the outage; the task is retried and completes, "
    "resuming from step 3; everything committed before the outage is still committed, unchanged",
)
def test_s3_down_during_checkpoint_commit_leaves_nothing_half_committed_and_the_retry_completes(
    outage_run, fault_row
):
    outage = outage_run.outage
    assert outage is not None, "the server never saw the step-4 manifest PUT"
    assert outage.restarted is not None
    assert "on_up_error" not in outage.notes, outage.notes
    assert outage.notes["step4_files"], "no step-4 data was written before the outage"
    assert outage.notes["step4_committed"] is False
    assert outage_run.violations == []
    assert outage_run.state.is_completed(), outage_run.state.message
    assert outage_run.task_runs["train_sft"].run_count >= 2
    assert any("StorageUnavailable" in line for line in outage_run.logs)
    assert outage_run.final_manifest_metrics["resumed_from_step"] == 3
    assert len(outage_run.committed_before_outage) >= 4  # the data artifact and checkpoints 1-3
    assert outage_run.committed_after == outage_run.committed_before_outage
    fault_row.fact(
        f"{len(outage.notes['step4_files'])} uncommitted step-4 objects; {outage.refused_requests} requests "
        f"dropped; {len(outage_run.committed_before_outage)} earlier artifacts intact; scenario "
        f"{outage_run.wall_s:.0f} s, sft attempts: {', '.join(attempts(outage_run.logs, 'sft'))}"
    )
