"""The rollout engine actor's vLLM engine core SIGKILLed mid-generation (scenario 3 in scenarios.py)."""

from __future__ import annotations

import pytest
from fault_kit import attempts, rollout_rows
from scenarios import fired

pytestmark = pytest.mark.integration


@pytest.mark.fault(
    fault="vLLM engine core SIGKILLed once the requests are queued (`kill_vllm:0@rollout`)",
    where="generate_rollouts task (the task's process + an engine actor whose vLLM engine core is a process of its own)",
    checked="the stage fails with EngineDeadError instead of hanging; the task is retried; the rollouts "
    "(tokens, logprobs, rewards) equal an uninterrupted run's with the same seed; the dead engine's "
    "shared-memory queues are removed",
)
def test_vllm_engine_killed_mid_rollout_is_retried_and_gives_the_same_rollouts(
    faulted_run, killed_flow, fault_row
):
    assert faulted_run.state.is_completed(), faulted_run.state.message
    assert faulted_run.task_runs["generate_rollouts"].run_count == 2
    assert fired(faulted_run.root, 2)  # kill_vllm, the third fault (its line is in the engine actor's log)
    assert any("EngineDeadError" in line for line in faulted_run.logs)
    # The killed engine core's shared-memory queues were removed by the engine's death watch, not left in RAM.
    assert faulted_run.orphan_segments == []
    (reference_uri,) = killed_flow.store.list_committed("rollouts")
    mine = rollout_rows(faulted_run.store, faulted_run.uris["rollouts"])
    reference = rollout_rows(killed_flow.store, reference_uri)
    assert len(mine) == len(reference) > 0
    assert mine == reference
    fault_row.fact(
        f"{len(mine)} samples equal; rollout attempts: {', '.join(attempts(faulted_run.logs, 'rollout'))}"
    )
