"""A committed policy (an HF folder artifact) made local for vLLM, cached by its manifest hash.

    policy = fetch_policy(store, stage_uri)          # stage_uri: a committed sft/grpo artifact
    policy.local_dir, policy.uri, policy.version     # HF folder, <stage_uri>/policy, manifest sha256

vLLM loads from a local folder. The download goes through the artifact reader, which checks every file's size
and sha256. Folders are kept under `$FORGE_POLICY_CACHE` (default `~/.cache/forgeflow/policies`), named by
the policy's manifest hash, so a stage that runs again on the same policy (a retry, an evaluation after a
rollout) does not download it again. A folder becomes visible under its final name only once complete.
"""

from __future__ import annotations

import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

from forge_core.storage import ArtifactError, ObjectStore

# The policy inside a training stage's artifact (forge_core.trainers.stage.POLICY_DIR; not imported from there
# so the rollout worker does not import the trainer stack).
POLICY_DIR = "policy"
POLICY_STAGE_KINDS = ("sft", "grpo")
CACHE_ENV = "FORGE_POLICY_CACHE"
_COMPLETE_MARKER = ".forge-complete"


@dataclass(frozen=True)
class PolicyRef:
    uri: str  # the policy artifact: <stage_uri>/policy
    version: str  # sha256 of its manifest
    local_dir: Path


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
        version = store.manifest_sha256(policy_uri)
    except (ArtifactError, FileNotFoundError) as exc:
        raise ValueError(
            f"inputs.{input_name}={stage_uri}: its {POLICY_DIR}/ is not committed ({exc})"
        ) from exc
    root = cache_root or policy_cache_root()
    local_dir = root / version
    if not (local_dir / _COMPLETE_MARKER).is_file():
        _download(store, policy_uri, local_dir, input_name)
    return PolicyRef(uri=policy_uri, version=version, local_dir=local_dir)


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
