"""The whole post-training flow on the tiny config, under a real Prefect API, and cancellation by SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from forge_core.config import load_config
from forge_core.storage import ObjectStore

pytestmark = pytest.mark.integration


def test_post_train_commits_every_stage(prefect_api, tiny_overrides):
    from flows.post_train import post_train

    summary = post_train("configs/tiny_test.yaml", tiny_overrides)

    cfg = load_config("configs/tiny_test.yaml", tiny_overrides)
    store = ObjectStore.from_config(cfg.storage)
    assert [point["label"] for point in summary["evals"]] == ["sft"] + [
        f"grpo-{i + 1}" for i in range(cfg.grpo.iterations)
    ]
    expected_kinds = {"data": 1, "sft": 1, "rollouts": cfg.grpo.iterations, "grpo": cfg.grpo.iterations}
    for kind, count in expected_kinds.items():
        assert len(store.list_committed(kind)) == count, kind
    assert len(store.list_committed("eval")) == 1 + cfg.grpo.iterations
    final = store.read_manifest(summary["final_policy_uri"])
    assert final.kind == "grpo"
    # Lineage: the final policy names the rollouts it learned from, which name the policy that made them.
    rollouts_uri = final.inputs["rollouts"].uri
    assert rollouts_uri == summary["rollouts"][-1]
    assert store.read_manifest(rollouts_uri).inputs["policy"].uri == summary["sft_uri"]
    for point in summary["evals"]:
        assert 0.0 <= point["accuracy"] <= 1.0


def test_sigterm_during_sft_leaves_no_process_alive(tmp_path):
    """What a Prefect process worker does on cancel: SIGTERM the flow-run process. Nothing may survive it."""
    env = {
        **os.environ,
        "PREFECT_HOME": str(tmp_path / "prefect-home"),
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "FORGE_FAULT": "hang_rank:1:1",  # SFT hangs at step 1 until it is killed
    }
    overrides = [
        f"storage.root=file://{tmp_path}/store",
        f"logging.dir={tmp_path}/runs",
        "launch.sft.deadline_s=600",
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "flows.post_train", "configs/tiny_test.yaml", *overrides],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    flow_proc = psutil.Process(proc.pid)
    seen: set[int] = set()
    deadline = time.monotonic() + 400
    sft_started = False
    while time.monotonic() < deadline and proc.poll() is None:
        seen |= {p.pid for p in flow_proc.children(recursive=True)}
        for child in flow_proc.children(recursive=True):
            try:
                if "torch.distributed.run" in " ".join(child.cmdline()):
                    sft_started = True
            except psutil.NoSuchProcess:
                continue
        if sft_started and len(seen) >= 4:  # torchrun + 2 ranks at least
            break
        time.sleep(0.5)
    assert sft_started, "SFT never started"
    time.sleep(3)
    seen |= {p.pid for p in flow_proc.children(recursive=True)}

    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    time.sleep(1)
    alive = [
        pid for pid in seen if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    ]
    assert alive == [], f"processes left alive after SIGTERM: {alive}"
