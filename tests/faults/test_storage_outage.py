"""The S3 server stops while the task process plans, waits for a commit and publishes, and while SFT ranks
write a checkpoint; each outage lasts until the process it hit outlasted the old retry budget (scenario 4 in
scenarios.py). Nothing here depends on how long an outage or a backoff takes."""

from __future__ import annotations

import re

import pytest
from fault_kit import attempts
from scenarios import OUTAGE_HORIZON_S, RETRY_THAT_OUTLASTS

pytestmark = pytest.mark.integration

# Which call of the task process each task-side outage must have hit (the retry warnings name the call).
TASK_SIDE_CALLS = {
    "commit-wait": r"/run/data/[^/ ]+/_MANIFEST\.json",
    "publishing": r"/run/data/[^/ ]+/_MANIFEST\.json",
    "planning": r"check bucket s3://",
}


def _outlasted(event) -> bool:
    return event.notes.get("outlasted_old_budget") is True


def _retries(event) -> str:
    """How far the task process's retries got during the outage, e.g. "4 retries of check bucket"."""
    lines = event.notes.get("task_retries", [])
    calls = sorted({m.group(1) for m in (re.search(r"storage: (\S+ \S+)", line) for line in lines) if m})
    return f"{len(lines)} task retries ({', '.join(calls)})"


@pytest.mark.fault(
    fault="moto S3 server stopped by a request of the task process itself, three times (no worker running): "
    "the commit check after the prepare worker, prepare's publishing read, the SFT task's planning (its bucket "
    f"check); each time kept down until one call had logged its retry {RETRY_THAT_OUTLASTS} (the old "
    "storage.retries=2 budget gave up before it)",
    where="prepare_data and train_sft tasks on s3:// (the flow/task process), "
    f"storage.retry_horizon_s={OUTAGE_HORIZON_S:g}",
    checked="each outage came from the task process and outlasted the old budget; the task process rode "
    "every one out in its own storage retries: prepare ran once, the run completed",
)
def test_s3_down_while_the_task_process_waits_for_a_commit_publishes_and_plans_is_ridden_out(
    outage_run, fault_row
):
    assert outage_run.state.is_completed(), outage_run.state.message
    for name, call in TASK_SIDE_CALLS.items():
        event = outage_run.outages.get(name)
        assert event is not None, f"the {name} outage never fired (its trigger request never came)"
        assert event.client_pid == outage_run.task_pid, (name, event.trigger, event.client_pid)
        assert _outlasted(event), (name, event.notes.get("task_retries"))
        assert event.restarted is not None and "on_up_error" not in event.notes, event.notes
        assert any(re.search(call, line) for line in event.notes["task_retries"]), (name, event.notes)
    assert outage_run.task_runs["prepare_data"].run_count == 1  # ridden out, not retried
    assert outage_run.violations == []
    outages = outage_run.outages
    fault_row.fact(
        "; ".join(
            f"{name}: {outages[name].trigger.split()[0]}, {_retries(outages[name])}"
            for name in TASK_SIDE_CALLS
        )
    )


@pytest.mark.fault(
    fault="moto S3 server stopped on the PUT of the step-4 checkpoint's DCP metadata (every shard written, "
    f"no manifest), kept down until the task process had logged a call's retry {RETRY_THAT_OUTLASTS}",
    where="train_sft task on s3:// (2 ranks write DCP shards; rank 0 commits the checkpoint)",
    checked="no artifact ever looked committed without all its files verifying (the bucket polled every "
    "0.2 s through a second port of the server that never goes down, before, during and after the outage; "
    "every listing succeeded and every new commit was read back and verified); the step-4 checkpoint was not committed; the attempt ended RETRYABLE, the task "
    "process rode the outage out and the retry completed, resuming from step 3; everything committed before "
    "the outage is still committed, unchanged",
)
def test_s3_down_during_checkpoint_commit_leaves_nothing_half_committed_and_the_retry_completes(
    outage_run, fault_row
):
    outage = outage_run.outage
    assert outage is not None, "the server never saw the step-4 checkpoint's metadata PUT"
    assert outage.restarted is not None
    assert "on_up_error" not in outage.notes, outage.notes
    assert _outlasted(outage), outage.notes.get("task_retries")
    assert outage.notes["step4_files"], "no step-4 shard was written before the outage"
    assert outage.notes["step4_committed"] is False
    assert outage_run.violations == []
    polls = outage_run.commits
    before = polls.listings_within(0.0, outage.started)
    during = polls.listings_within(outage.started, outage.restarted)
    after = polls.listings_within(outage.restarted, float("inf"))
    # The watcher's port stays up: a refused listing (False) would be a poll that checked nothing.
    assert before and all(before), f"listings before the outage (False: refused): {before}"
    assert during and all(during), f"listings during the outage (False: refused): {during}"
    assert after and all(after), f"listings after the outage (False: refused): {after}"
    assert outage_run.state.is_completed(), outage_run.state.message
    assert outage_run.task_runs["train_sft"].run_count >= 2
    assert attempts(outage_run.logs, "sft")[0].startswith("RETRYABLE"), attempts(outage_run.logs, "sft")
    assert any("writing shards failed" in line for line in outage_run.logs)
    assert outage_run.final_manifest_metrics["resumed_from_step"] == 3
    assert len(outage_run.committed_before_outage) >= 4  # the data artifact and checkpoints 1-3
    assert outage_run.committed_after == outage_run.committed_before_outage
    fault_row.fact(
        f"bucket listed {len(before)} times before the outage, {len(during)} during it, {len(after)} after it; "
        f"{len(polls.committed)} commits verified"
    )
    fault_row.fact(
        f"{len(outage.notes['step4_files'])} uncommitted step-4 objects; {outage.refused_requests} requests "
        f"dropped; {_retries(outage)}; "
        f"{len(outage_run.committed_before_outage)} earlier artifacts intact; scenario "
        f"{outage_run.wall_s:.0f} s, sft attempts: {', '.join(attempts(outage_run.logs, 'sft'))}"
    )
