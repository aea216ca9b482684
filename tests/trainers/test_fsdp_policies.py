"""FSDP's reshard-after-forward policy on two real gloo ranks (spawned processes): keeping the gathered
parameters through a step saves the backward's all-gathers and all reductions but one a step, and changes no
step beyond rounding."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from sft_helpers import reshard_policy_worker

from forge_core.config import load_config
from forge_core.engine.parallel import resolve_reshard_after_forward


def test_never_resharding_gathers_less_reduces_once_a_step_and_steps_as_the_default(tmp_path):
    """`never` keeps the gathered parameters through a step: its micro-batches accumulate their gradients
    unsharded and reduce them once (Engine.micro_batch_passes), where `default` gathers every block again for its
    backward and reduces after every micro-batch. The same steps, up to the rounding of the sums' order."""
    mp.start_processes(
        reshard_policy_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, start_method="spawn", join=True
    )
    results = torch.load(tmp_path / "policies.pt")
    default, never = results["default"], results["never"]
    assert (default["reported"], never["reported"]) == ("default", "never")
    flat = {policy: [value for step in results[policy]["steps"] for value in step] for policy in results}
    assert flat["never"] == pytest.approx(flat["default"], rel=1e-5)
    differ = [k for k in default["weights"] if not torch.allclose(never["weights"][k], default["weights"][k], atol=1e-6)]
    assert differ == [], differ
    print(
        "FSDP on rank 0 over 3 steps of 2 micro-batches: all-gathers default "
        f"{default['gathers']}, never {never['gathers']}; reductions default {default['reduces']}, never {never['reduces']}"
    )
    assert 0 < never["gathers"] < default["gathers"]
    assert 0 < never["reduces"] and 2 * never["reduces"] == default["reduces"]  # once a step, not per micro-batch


def test_auto_keeps_the_gathered_parameters_on_cpu_and_takes_torchtitan_s_default_on_gpu():
    assert load_config(None, []).training.parallelism.reshard_after_forward == "auto"
    assert resolve_reshard_after_forward("auto", "cpu") == "never"
    assert resolve_reshard_after_forward("auto", "cuda") == "default"
    assert resolve_reshard_after_forward("always", "cpu") == "always"
