"""The flow process SIGKILLed mid-SFT: the launch ends itself (forge_core.launch.owner), nobody reaps it.

A real flow process (`python -m flows.post_train`, on the session's Prefect API) runs the tiny pipeline with an
SFT far longer than the test; once the SFT's first in-stage checkpoint is committed the flow process is
SIGKILLed. Its torchrun agent and both ranks must then end by themselves (no later flow runs, no reaper; the
launch's node agent may outlive the flow by Ray's fate-sharing delay and drop its registry record when its
launch ends, so the check is that no process carries the launch's id), and nothing may be committed on the dead
flow's behalf: no manifest file (a file:// commit is its manifest's exclusive create) appears after the kill.
Measured on the files themselves, not on the manifests' `committed_at`, which is stamped before the pre-commit
owner check: the store's manifests listed right after the kill against those at the end, and every manifest's
mtime against the kill time (read from a file written right after it: the clock file times come from).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fault_kit import wait_until_gone, worker_processes_under
from scenarios import REPO, STAGE_WAIT_S, TINY_CONFIG, file_overrides

from forge_core.launch import reap_orphaned_launches
from forge_core.launch.process_tree import processes_with_launch_id
from forge_core.storage import ObjectStore

pytestmark = pytest.mark.integration

# Generous: the launch ends ~2 s after its owner (OWNER_POLL_S plus a process scan) on an idle machine.
GONE_WAIT_S = 120.0


def _manifests(store_dir: Path) -> dict[Path, int]:
    """Every manifest file in the store and its mtime (ns)."""
    return {path: path.stat().st_mtime_ns for path in store_dir.rglob("_MANIFEST.json")}


def _file_clock_now(folder: Path) -> int:
    """Now, on the clock the kernel stamps file times with (coarser than time.time_ns)."""
    marker = folder / "now"
    marker.write_bytes(b"")
    return marker.stat().st_mtime_ns


def _wait_for_first_checkpoint(store_dir: Path, flow: subprocess.Popen, log_path: Path) -> Path:
    deadline = time.monotonic() + STAGE_WAIT_S
    while time.monotonic() < deadline and flow.poll() is None:
        found = sorted(store_dir.glob("sft/*/_checkpoints/step-*/_MANIFEST.json"))
        if found:
            return found[0]
        time.sleep(0.1)
    raise AssertionError(
        f"no SFT checkpoint was committed (flow exit code {flow.poll()}); its output:\n"
        + log_path.read_text()[-4000:]
    )


@pytest.mark.fault(
    fault="flow process SIGKILLed mid-SFT (after its first in-stage checkpoint)",
    where="`python -m flows.post_train` (own process); no later flow and no reaper runs",
    checked="torchrun's agent and both ranks end by themselves (owner watchdog, or the node agent Ray ends), no "
    "process with the launch's id is left (what the registry's reaper would look for); no manifest was "
    "committed after the kill (pre-commit owner check: "
    "no manifest file appeared between the listing at the kill and the one at the end, none has an mtime "
    "after the kill), the SFT output is not committed",
)
def test_a_sigkilled_flow_s_sft_launch_ends_itself_and_commits_nothing(prefect_api, tmp_path, fault_row):
    registry = tmp_path / "launches"
    env = {**os.environ, "PREFECT_API_URL": prefect_api, "FORGE_LAUNCH_REGISTRY": str(registry)}
    overrides = file_overrides(tmp_path, "sft.steps=100000", "grpo.iterations=0")
    log_path = tmp_path / "flow.log"
    with log_path.open("w") as log:
        flow = subprocess.Popen(
            [sys.executable, "-m", "flows.post_train", TINY_CONFIG, *overrides],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )
    try:
        store_dir = tmp_path / "store"
        first_checkpoint = _wait_for_first_checkpoint(store_dir, flow, log_path)
        workers = worker_processes_under(flow.pid)
        flow.send_signal(signal.SIGKILL)
        flow.wait()
        killed_ns = _file_clock_now(tmp_path)
        killed = time.monotonic()
        at_kill = _manifests(store_dir)
        launch_ids = sorted(p.stem for p in registry.glob("*.json"))
        assert launch_ids, "the running SFT launch has no registry record"
        assert any("torch.distributed.run" in p.cmdline for p in workers), workers
        assert (
            sum(
                "forge_core.run sft" in p.cmdline and "torch.distributed.run" not in p.cmdline
                for p in workers
            )
            == 2
        )

        left = wait_until_gone(workers, timeout_s=GONE_WAIT_S)
        gone_s = time.monotonic() - killed
        assert left == [], f"still running {GONE_WAIT_S:g} s after the flow's SIGKILL: {left}"
        left_by_id = {i: processes_with_launch_id(i) for i in launch_ids}
        assert not any(left_by_id.values()), f"processes of the dead flow's launches still run: {left_by_id}"

        at_end = _manifests(store_dir)
        new_files = sorted(str(path.relative_to(store_dir)) for path in at_end.keys() - at_kill.keys())
        assert new_files == [], f"committed after the flow process was killed: {new_files}"
        written_late = sorted(str(path.relative_to(store_dir)) for path, ns in at_end.items() if ns > killed_ns)
        assert written_late == [], f"manifests written after the kill (mtime > {killed_ns} ns): {written_late}"
        assert ObjectStore(f"file://{store_dir}").list_committed("sft") == []
        manifests = [json.loads(path.read_text()) for path in at_end]
        checkpoints = sum(m["kind"] == "checkpoint" for m in manifests)
        assert checkpoints >= 1
        fault_row.fact(f"{len(workers)} processes ended {gone_s:.1f} s after the kill, unreaped")
        fault_row.fact(f"{checkpoints} checkpoints committed before the kill, none after ({len(at_end)} manifests)")
        print(
            f"first checkpoint {first_checkpoint.parent.name}; launch gone {gone_s:.2f} s after the SIGKILL"
        )
    finally:
        if flow.poll() is None:
            flow.kill()
            flow.wait()
        reap_orphaned_launches(registry, grace_s=2)  # only now: whatever a failed check left running
