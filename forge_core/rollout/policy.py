"""A committed policy (an HF folder artifact) made local for vLLM, cached by its manifest hash.

    policy = fetch_policy(store, stage_uri)          # stage_uri: a committed sft/grpo artifact
    policy.local_dir, policy.uri                     # HF folder, <stage_uri>/policy
    policy.version                                   # the policy version: checksum of its weights
    policy.manifest_sha256                           # identity of the policy artifact (cache key)

The policy version is what a generator serves and every rollout row records: a sha256 over the committed
manifest's hashes of the weights (`*.safetensors`) and `config.json` (`weights_version`), so it is computed
without reading the weights again, and two exports of the same weights (a retried stage) share it while any
change of weights changes it.

vLLM loads from a local folder. The download goes through the artifact reader, which checks every file's size
and sha256. Folders are kept under `$FORGE_POLICY_CACHE` (default `~/.cache/forgeflow/policies`), named by
the policy's manifest hash, so a stage that runs again on the same policy (a retry, an evaluation after a
rollout) does not download it again. A folder becomes visible under its final name only once complete.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

from forge_core.storage import ArtifactError, ObjectStore
from forge_core.storage.manifest import Manifest

# The policy inside a training stage's artifact (forge_core.trainers.stage.POLICY_DIR; not imported from there
# so the rollout worker does not import the trainer stack).
POLICY_DIR = "policy"
POLICY_STAGE_KINDS = ("sft", "grpo")
CACHE_ENV = "FORGE_POLICY_CACHE"
_COMPLETE_MARKER = ".forge-complete"


WEIGHTS_SUFFIX = ".safetensors"
MODEL_CONFIG_FILE = "config.json"


@dataclass(frozen=True)
class PolicyRef:
    uri: str  # the policy artifact: <stage_uri>/policy
    version: str  # weights_version of its manifest: what the engine serves and rollout rows record
    local_dir: Path
    manifest_sha256: str = ""  # sha256 of its manifest: the artifact's identity, names the local copy


def weights_version(manifest: Manifest, source: str = "policy") -> str:
    """sha256 over the manifest's (name, size, sha256) of every `*.safetensors` file and `config.json`.

    ValueError naming `source` when the manifest lists no weights (not an HF policy export).
    """
    names = sorted(rel for rel in manifest.files if rel.endswith(WEIGHTS_SUFFIX) or rel == MODEL_CONFIG_FILE)
    if not any(rel.endswith(WEIGHTS_SUFFIX) for rel in names):
        raise ValueError(
            f"{source}: its manifest lists no *{WEIGHTS_SUFFIX} file (files: {sorted(manifest.files)[:8]}); "
            "a policy is an HF folder export with safetensors weights"
        )
    digest = hashlib.sha256()
    for rel in names:
        entry = manifest.files[rel]
        digest.update(f"{rel}\x00{entry.size}\x00{entry.sha256}\n".encode())
    return digest.hexdigest()


def policy_cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "forgeflow" / "policies").expanduser()


def fetch_policy(
    store: ObjectStore, stage_uri: str, input_name: str = "policy", cache_root: Path | None = None
) -> PolicyRef:
    """The verified local copy of `<stage_uri>/policy` (see module docstring).

    ValueError naming `inputs.<input_name>` when the stage artifact or its policy is missing, uncommitted,
    of the wrong kind or corrupted.
    """
    policy_uri = store.join(stage_uri, POLICY_DIR)
    try:
        kind = store.read_manifest(stage_uri).kind
    except (ArtifactError, FileNotFoundError) as exc:
        raise ValueError(
            f"inputs.{input_name}={stage_uri}: not a committed artifact ({exc}); pass the URI of a "
            "finished sft or grpo stage"
        ) from exc
    if kind not in POLICY_STAGE_KINDS:
        raise ValueError(
            f"inputs.{input_name}={stage_uri}: a {kind!r} artifact; expected one of "
            f"{list(POLICY_STAGE_KINDS)} "
            f"(the output of an SFT or GRPO stage, which holds {POLICY_DIR}/)"
        )
    try:
        manifest_bytes = store.manifest_bytes(policy_uri)
        manifest = store.parse_manifest(policy_uri, manifest_bytes)
    except (ArtifactError, FileNotFoundError) as exc:
        raise ValueError(
            f"inputs.{input_name}={stage_uri}: its {POLICY_DIR}/ is not committed ({exc})"
        ) from exc
    manifest_sha256 = hashlib.sha256(manifest_bytes).hexdigest()  # == store.manifest_sha256(policy_uri)
    version = weights_version(manifest, f"inputs.{input_name}={stage_uri}/{POLICY_DIR}")
    root = cache_root or policy_cache_root()
    local_dir = root / manifest_sha256
    if not (local_dir / _COMPLETE_MARKER).is_file():
        _download(store, policy_uri, local_dir, input_name)
    return PolicyRef(uri=policy_uri, version=version, local_dir=local_dir, manifest_sha256=manifest_sha256)


def _download(store: ObjectStore, policy_uri: str, local_dir: Path, input_name: str) -> None:
    staging = local_dir.with_name(f".{local_dir.name}.{uuid.uuid4().hex[:8]}.partial")
    try:
        store.reader(policy_uri).download_dir("", staging)
        (staging / _COMPLETE_MARKER).write_text(policy_uri + "\n")
        if local_dir.exists():
            shutil.rmtree(local_dir)  # an incomplete copy from a crashed process (no marker)
        os.replace(staging, local_dir)
    except (ArtifactError, FileNotFoundError) as exc:
        raise ValueError(f"inputs.{input_name}: cannot read the policy at {policy_uri}: {exc}") from exc
    except OSError:
        if (local_dir / _COMPLETE_MARKER).is_file():
            return  # another process finished the same download first
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
