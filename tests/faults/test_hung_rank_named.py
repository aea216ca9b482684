"""A hung rank under the production relationship of the deadline and the collectives' timeout is retried, and
the reason names it (scenario 3 in scenarios.py: its first SFT attempt hangs; no extra run)."""

from __future__ import annotations

import re

import pytest
from fault_kit import attempts

from forge_core.timings import LAUNCHER_BACKSTOP_S, PROCESS_GROUP_TIMEOUT_MARGIN_S

pytestmark = pytest.mark.integration


@pytest.mark.fault(
    fault="SFT rank 1 hangs after step 1 (`hang_rank:1:1@sft`) while rank 0 waits in the step-1 checkpoint's "
    "collectives; the collectives' timeout is derived from the stage deadline as for every launch "
    f"(deadline + kill grace + {LAUNCHER_BACKSTOP_S:g} s: the launch's own backstop deadline; "
    f"+ {PROCESS_GROUP_TIMEOUT_MARGIN_S:g} s)",
    where="train_sft task (torchrun, 2 ranks), launch.sft.deadline_s sized from the uninterrupted SFT",
    checked="the stage's deadline (its runner's) comes first (no collective timed out): the attempt is "
    "RETRYABLE and retried; its reason names rank 1 as the rank that made no progress since step 1, from the ranks' "
    "heartbeats",
)
def test_a_hung_rank_is_stopped_by_the_deadline_retried_and_named(faulted_run, fault_row):
    named = [line for line in faulted_run.logs if "rank 1 made no progress since step 1" in line]
    assert named, "no log line names rank 1 as the rank that hung"
    assert not any("rank 0 made no progress" in line for line in faulted_run.logs)
    assert not any("Timed out waiting" in line for line in faulted_run.logs)  # the deadline came first
    sft_attempts = attempts(faulted_run.logs, "sft")
    assert sft_attempts[0].startswith("RETRYABLE"), sft_attempts
    assert faulted_run.task_runs["train_sft"].run_count >= 2
    # Prefect logs the exception's repr, quotes escaped; LaunchFailed's message ends with " [retryable; launch ...]".
    note = named[0][named[0].index("rank 1 made no progress") :].split("\\n")[0].replace("\\'", "'")
    note = note.split(" [retryable;")[0]
    assert re.fullmatch(
        r"rank 1 made no progress since step 1 \([^)]*\); rank 0 had reached '[^']*'", note
    ), note
    fault_row.fact(f"deadline {faulted_run.deadline_s:.0f} s; the reason ends: {note}")
