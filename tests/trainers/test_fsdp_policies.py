"""FSDP's reshard-after-forward policy on two real gloo ranks (spawned processes): keeping a block's gathered
parameters until its backward saves that backward's all-gather and changes no step."""

from __future__ import annotations

import torch
import torch.multiprocessing as mp
from sft_helpers import reshard_policy_worker

from forge_core.config import load_config
from forge_core.engine.parallel import resolve_reshard_after_forward


def test_never_resharding_after_forward_gathers_less_and_steps_bitwise_as_the_default(tmp_path):
    mp.start_processes(
        reshard_policy_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, start_method="spawn", join=True
    )
    results = torch.load(tmp_path / "policies.pt")
    default, never = results["default"], results["never"]
    assert (default["reported"], never["reported"]) == ("default", "never")
    assert never["steps"] == default["steps"]
    assert all(torch.equal(never["weights"][k], default["weights"][k]) for k in default["weights"])
    # default gathers every block again for its backward; never gathers each unit once per micro-batch.
    print(f"FSDP all-gathers on rank 0 over 3 steps of 2 micro-batches: default {default['gathers']}, never {never['gathers']}")
    assert 0 < never["gathers"] < default["gathers"]


def test_auto_keeps_the_gathered_parameters_on_cpu_and_takes_torchtitan_s_default_on_gpu():
    assert load_config(None, []).training.parallelism.reshard_after_forward == "auto"
    assert resolve_reshard_after_forward("auto", "cpu") == "never"
    assert resolve_reshard_after_forward("auto", "cuda") == "default"
    assert resolve_reshard_after_forward("always", "cpu") == "always"
