"""A SIGTERM to a running post-train flow process ends every process it launched.

The whole flow on real stages runs in tests/flows/test_demo.py (every stage committed, lineage, report) and,
through a deployment and a worker, in tests/deploy; Prefect's own cancellation of a deployed run is checked
there too.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

pytestmark = pytest.mark.integration

FLOW_START_TIMEOUT_S = 400.0


def _descendants(proc: psutil.Process) -> dict[int, str]:
    found = {}
    for child in proc.children(recursive=True):
        try:
            found[child.pid] = " ".join(child.cmdline())
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return found


def _sft_ranks(processes: dict[int, str]) -> list[int]:
    return [
        pid
        for pid, cmd in processes.items()
        if "forge_core.run sft" in cmd and "torch.distributed.run" not in cmd
    ]


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_sigterm_during_sft_leaves_no_process_alive(prefect_api, tiny_overrides, tmp_path):
    """What a Prefect process worker does on cancel: SIGTERM the flow-run process. Nothing may survive it."""
    env = {
        **os.environ,
        # The session's API, as a worker's flow run has one: no ephemeral server in the flow process.
        "PREFECT_API_URL": prefect_api,
        "FORGE_FAULT": "hang_rank:1:1@sft",  # SFT hangs at step 1 until it is killed
    }
    # An SFT step count no other test commits, so this SFT really starts (the data prep is shared).
    overrides = [*tiny_overrides, "sft.steps=2"]
    log_path = tmp_path / "flow.log"
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "flows.post_train", "configs/tiny_test.yaml", *overrides],
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    try:
        flow_proc = psutil.Process(proc.pid)
        seen: dict[int, str] = {}
        deadline = time.monotonic() + FLOW_START_TIMEOUT_S
        while time.monotonic() < deadline and proc.poll() is None and len(_sft_ranks(seen)) < 2:
            seen |= _descendants(flow_proc)
            time.sleep(0.5)
        assert len(_sft_ranks(seen)) == 2, f"SFT's two ranks never started:\n{log_path.read_text()[-3000:]}"
        assert any("torch.distributed.run" in cmd for cmd in seen.values()), seen

        proc.send_signal(signal.SIGTERM)
        # Keep recording until the flow process is gone: whatever starts meanwhile must end too.
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            seen |= _descendants(flow_proc)
            time.sleep(0.2)
        assert proc.poll() is not None, "the flow process did not exit within 120 s of SIGTERM"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    alive = {pid: cmd for pid, cmd in seen.items() if _alive(pid)}
    assert alive == {}, f"processes left alive after SIGTERM: {alive}"
