"""The flow process SIGKILLed mid-GRPO, then run again (scenarios 1 and 2 in scenarios.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from fault_kit import attempts, wait_until_gone

pytestmark = pytest.mark.integration

SKIPPED_STAGES = ("prepare_data", "train_sft", "evaluate", "generate_rollouts")


@pytest.mark.fault(
    fault="flow process SIGKILLed mid-GRPO (GRPO rank 1 hung after step 2), then the flow re-run",
    where="`python -m flows.post_train` (own process), then run again as a new flow process",
    checked="the dead flow's GRPO launch (torchrun and both ranks, one of them hung) ends by itself (Ray ends "
    "the dead flow's node agents and with them their launches; the owner watchdog is the fallback); no launch "
    "record is left after the re-run; prepare/SFT/eval/rollout are skipped (manifests untouched); GRPO resumes "
    "from its committed step-1 checkpoint; the re-run completes",
)
def test_flow_killed_mid_grpo_rerun_skips_done_stages_resumes_grpo_and_ends_orphans(
    killed_flow, flow_rerun, fault_row
):
    # The premise: SIGKILL gave the flow no chance to clean up while its GRPO launch ran.
    assert killed_flow.workers, "the SIGKILLed flow had no worker process running: nothing to test"
    kinds = ", ".join(sorted({_kind(p) for p in killed_flow.workers}))
    fault_row.fact(
        f"{len(killed_flow.workers)} workers ({kinds}) at the kill, {len(killed_flow.orphans)} still alive 1 s later"
    )
    # They end by themselves (forge_core.launch.owner): a hung rank in a collective included.
    assert wait_until_gone(killed_flow.workers, timeout_s=60) == []

    assert flow_rerun.state.is_completed(), flow_rerun.state.message
    registry = Path(killed_flow.env["FORGE_LAUNCH_REGISTRY"])
    assert not list(registry.glob("*.json")), "launch records left in the registry after the re-run"

    store = killed_flow.store
    for uri, committed_at in flow_rerun.committed_before.items():
        assert store.read_manifest(uri).committed_at == committed_at, f"{uri} was rewritten by the re-run"
    skipped = [line for line in flow_rerun.logs if "output already committed" in line]
    assert len(skipped) == 4, skipped  # prepare, sft, eval of the SFT policy, rollout-1
    for name in SKIPPED_STAGES:
        assert flow_rerun.task_runs[name].state.is_completed()

    grpo = store.read_manifest(flow_rerun.summary["final_policy_uri"])
    assert grpo.kind == "grpo"
    assert grpo.metrics["resumed_from_step"] == 1
    fault_row.fact("GRPO resumed_from_step=1, 4 stages skipped")
    fault_row.fact(
        f"first flow {killed_flow.wall_s:.0f} s until killed, re-run {flow_rerun.wall_s:.0f} s "
        f"(grpo attempts: {', '.join(attempts(flow_rerun.logs, 'grpo'))})"
    )


def _kind(process) -> str:
    if "torch.distributed.run" in process.cmdline:
        return "torchrun"
    return "rank" if "forge_core.run" in process.cmdline else "other"
