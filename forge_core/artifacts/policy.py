"""The policy artifact: the HF folder a training stage exports (`<stage>/policy`) and every later stage reads.

    policy_uri(store, stage_uri)                                     # <stage_uri>/policy
    local = download_policy(store, stage_uri, workdir / "policy")    # verified copy, uncached
    policy = fetch_policy(store, stage_uri)                          # verified, cached by manifest hash
    export_policy_folder(store, uri, "./my-model")                   # verified copy for a user
    policy.local_dir, policy.uri, policy.version, policy.manifest_sha256

A training stage's artifact (kinds `forge_core.stages.policy_kinds()`) holds `policy/`, a nested committed
artifact: safetensors weights, `config.json` and the tokenizer files. "Verified" means every file's size and
sha256 are checked against that manifest.

The policy version (`weights_version`) is what a generator serves and every rollout row records: computed from
the manifest without reading the weights, shared by two exports of the same weights, changed by any change.

The policy cache (`policy_cache_root`) keeps one folder per manifest hash, visible under its final name only
once complete, bounded by `$FORGE_POLICY_CACHE_MAX_POLICIES` folders (default 8) and `$FORGE_POLICY_CACHE_MAX_GB`
GB (default 50): after each download the least recently used folders are pruned until both bounds hold. A
process using a cached folder holds a shared lock on `<cache>/<hash>.lock` and pruning needs an exclusive one,
so a folder is never removed from under a reader. Processes fetching the same policy at once (engines of one
machine) take turns on `<cache>/<hash>.fetch`: the first downloads, the others find the folder complete. A
download that finds the disk full prunes every unused folder, tries once more, then fails fatally (a full disk
is not worth a retry).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from forge_core.artifacts.inputs import committed_kind
from forge_core.stages import policy_kinds
from forge_core.storage import ArtifactError, ObjectStore
from forge_core.storage.manifest import Manifest
from forge_core.timings import POLICY_CACHE_STALE_LEFTOVER_S

POLICY_DIR = "policy"  # the policy inside a training stage's artifact
POLICY_KIND = "policy"  # the kind of that nested artifact's manifest
# What a stage artifact passed as a policy must be (the messages of policy_kind).
POLICY_WHAT = f"the output of an SFT or GRPO stage, which holds {POLICY_DIR}/"
log = logging.getLogger(__name__)

CACHE_ENV = "FORGE_POLICY_CACHE"
MAX_POLICIES_ENV = "FORGE_POLICY_CACHE_MAX_POLICIES"
MAX_GB_ENV = "FORGE_POLICY_CACHE_MAX_GB"
DEFAULT_MAX_POLICIES = 8
DEFAULT_MAX_GB = 50.0
_COMPLETE_MARKER = ".forge-complete"  # written last into a cached folder; its mtime is the folder's last use
_LOCK_SUFFIX = ".lock"
_FETCH_SUFFIX = ".fetch"


WEIGHTS_SUFFIX = ".safetensors"
MODEL_CONFIG_FILE = "config.json"


@dataclass(frozen=True)
class PolicyRef:
    uri: str  # the policy artifact: <stage_uri>/policy
    version: str  # weights_version of its manifest: what the engine serves and rollout rows record
    local_dir: Path | None  # its verified local copy; None for a reference without one (`policy_ref`)
    manifest_sha256: str = ""  # sha256 of its manifest: the artifact's identity, names the local copy

    @property
    def stage_uri(self) -> str:
        """The training stage's artifact that holds this policy (what `fetch_policy` takes)."""
        stage_uri, _, name = self.uri.rstrip("/").rpartition("/")
        assert name == POLICY_DIR, f"{self.uri}: a policy artifact is <stage uri>/{POLICY_DIR}"
        return stage_uri


def weights_version(manifest: Manifest, source: str = "policy") -> str:
    """sha256 over the manifest's (name, size, sha256) of every `*.safetensors` file and `config.json`;
    ValueError naming `source` when the manifest lists no weights (not an HF policy export)."""
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


POLICY_CACHE_DIR = "policy-cache"  # under the run folder (logging.dir), so `make clean` removes it


def policy_cache_root(run_dir: str | os.PathLike | None = None) -> Path:
    """`$FORGE_POLICY_CACHE` when set, else `<run_dir>/policy-cache`, else `~/.cache/forgeflow/policies`."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    if run_dir is not None:
        return Path(run_dir).expanduser() / POLICY_CACHE_DIR
    return Path.home() / ".cache" / "forgeflow" / "policies"


@dataclass(frozen=True)
class CacheBounds:
    """How much the policy cache may hold (module docstring); `from_environment` reads the settings."""

    max_policies: int = DEFAULT_MAX_POLICIES
    max_bytes: int = int(DEFAULT_MAX_GB * 1e9)

    @classmethod
    def from_environment(cls) -> CacheBounds:
        return cls(
            max_policies=_positive_setting(MAX_POLICIES_ENV, int, DEFAULT_MAX_POLICIES),
            max_bytes=int(_positive_setting(MAX_GB_ENV, float, DEFAULT_MAX_GB) * 1e9),
        )


def _positive_setting(name: str, kind: type, default):
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        value = kind(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError(
            f"{name}={raw!r}: must be a {kind.__name__} > 0 (default {default}); fix or unset it"
        )
    return value


class PolicyLease:
    """A shared lock on a cached policy folder while this process uses it, so pruning skips the folder;
    holds nothing for a folder outside the policy cache (no completion marker)."""

    def __init__(self, local_dir: str | os.PathLike, in_cache: bool = False) -> None:
        self.local_dir = Path(local_dir).absolute()
        locks = in_cache or _is_cached(self.local_dir)
        self._fd = _lock(_lock_path(self.local_dir), fcntl.LOCK_SH) if locks else None

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing the descriptor drops its lock


_leases: dict[Path, PolicyLease] = {}
_leases_lock = threading.Lock()


def release_policy(policy: PolicyRef) -> None:
    """Let the policy cache prune `policy` again (fetch_policy leased it to this process)."""
    if policy.local_dir is None:
        return
    with _leases_lock:
        lease = _leases.pop(policy.local_dir.absolute(), None)
    if lease is not None:
        lease.release()


def _lease(local_dir: Path) -> None:
    with _leases_lock:
        if local_dir not in _leases:
            _leases[local_dir] = PolicyLease(local_dir, in_cache=True)


def _is_cached(local_dir: Path) -> bool:
    return (local_dir / _COMPLETE_MARKER).is_file()


def _lock_path(local_dir: Path, suffix: str = _LOCK_SUFFIX) -> Path:
    return local_dir.with_name(local_dir.name + suffix)


@contextlib.contextmanager
def _fetch_turn(local_dir: Path):
    """While the block runs, no other process fetches `local_dir`: a second download would replace the first's
    complete folder under its reader."""
    fd = _lock(_lock_path(local_dir, _FETCH_SUFFIX), fcntl.LOCK_EX)
    try:
        yield
    finally:
        os.close(fd)


def _lock(path: Path, mode: int) -> int | None:
    """A descriptor of `path` holding flock `mode` (None when LOCK_NB and someone holds a conflicting lock);
    re-opens when a pruner unlinked the path while we waited for the lock."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, mode)
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)


def prune_policy_cache(
    root: Path | None = None, bounds: CacheBounds | None = None, keep: Path | None = None
) -> list[Path]:
    """Remove least recently used policy folders until `bounds` hold, never `keep` nor a folder in use;
    returns the folders removed. Safe to call from any process at any time."""
    root = root or policy_cache_root()
    bounds = bounds or CacheBounds.from_environment()
    _clear_stale_leftovers(root)
    entries = sorted(
        (_last_used(folder), folder) for folder in root.iterdir() if folder.is_dir() and _is_cached(folder)
    )
    sizes = {folder: _folder_bytes(folder) for _, folder in entries}
    count, total = len(entries), sum(sizes.values())
    removed = []
    for _, folder in entries:
        if count <= bounds.max_policies and total <= bounds.max_bytes:
            break
        if keep is not None and folder == keep.absolute():
            continue
        if _remove_if_unused(folder):
            removed.append(folder)
            count, total = count - 1, total - sizes[folder]
    return removed


def _last_used(folder: Path) -> int:
    try:
        return (folder / _COMPLETE_MARKER).stat().st_mtime_ns
    except OSError:
        return 0


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _remove_if_unused(folder: Path) -> bool:
    lock = _lock_path(folder)
    fd = _lock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    if fd is None:
        return False  # a stage or an engine actor uses it
    try:
        trash = folder.with_name(f".{folder.name}.{uuid.uuid4().hex[:8]}.trash")
        os.replace(folder, trash)  # gone from its name at once: nobody fetches a half-removed folder
        lock.unlink(missing_ok=True)
        _lock_path(folder, _FETCH_SUFFIX).unlink(missing_ok=True)  # a waiter re-opens it (_lock)
    finally:
        os.close(fd)
    shutil.rmtree(trash, ignore_errors=True)
    return True


def _clear_stale_leftovers(root: Path) -> None:
    cutoff = time.time() - POLICY_CACHE_STALE_LEFTOVER_S
    for leftover in [*root.glob(".*.partial"), *root.glob(".*.trash")]:
        with contextlib.suppress(OSError):
            if leftover.stat().st_mtime < cutoff:
                shutil.rmtree(leftover, ignore_errors=True)


def policy_uri(store: ObjectStore, stage_uri: str) -> str:
    """URI of the policy (HF folder artifact) inside a training stage's artifact."""
    return store.join(stage_uri, POLICY_DIR)


def policy_kind(store: ObjectStore, stage_uri: str, input_name: str = "policy") -> str:
    """The kind of a committed stage artifact that holds a policy (sft or grpo); ValueError naming
    `inputs.<input_name>` when it is missing, uncommitted or of another kind."""
    return committed_kind(store, stage_uri, input_name, policy_kinds(), POLICY_WHAT)


def _policy_manifest(store: ObjectStore, stage_uri: str, input_name: str) -> tuple[bytes, Manifest]:
    uri = policy_uri(store, stage_uri)
    try:
        manifest_bytes = store.manifest_bytes(uri)
        return manifest_bytes, store.parse_manifest(uri, manifest_bytes)
    except (ArtifactError, FileNotFoundError) as exc:
        raise ValueError(f"inputs.{input_name}={stage_uri}: its {POLICY_DIR}/ is not committed ({exc})") from exc


def download_policy(
    store: ObjectStore,
    stage_uri: str,
    local_dir: str | Path,
    input_name: str = "policy",
    select: Callable[[str], bool] | None = None,
) -> Path:
    """Verified, uncached copy of `<stage_uri>/policy/` into `local_dir` (with `select`, of the files it accepts,
    e.g. `is_weights_file`); ValueError naming `inputs.<input_name>` when it cannot be read."""
    uri = policy_uri(store, stage_uri)
    try:
        return store.reader(uri).download_dir("", local_dir, select)
    except (ArtifactError, FileNotFoundError) as exc:
        raise ValueError(f"inputs.{input_name}={stage_uri}: cannot read its policy at {uri}: {exc}") from exc


def export_policy_folder(store: ObjectStore, uri: str, target: str | os.PathLike) -> str:
    """Verified copy of a committed policy into `target`, a plain HF folder that appears only once every file
    is verified (a refused copy leaves nothing there).

    Args:
        uri: a policy artifact (`<stage_uri>/policy`) or the committed `sft` / `grpo` artifact holding one.
        target: a folder that does not exist yet or is empty (created with its parents).

    Returns:
        The URI of the policy artifact copied.

    Raises:
        ValueError: `target` is not an empty folder; `uri` is not committed or holds no policy; a file of the
            policy does not match its manifest.
    """
    target = Path(target).expanduser().absolute()
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ValueError(f"export target {target} is not empty; name a new or an empty folder")
    source = _committed_policy_uri(store, uri)
    staging = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.partial")
    try:
        store.reader(source).download_dir("", staging)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staging, target)  # over an empty folder too: rename(2) replaces an empty directory
    except ArtifactError as exc:
        raise ValueError(
            f"refused to export {source}: {exc}; nothing was written to {target}. Delete the artifact's prefix so "
            "its stage runs again (or export another committed policy: forgeflow status lists them)"
        ) from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return source


def commit_policy(
    store: ObjectStore,
    uri: str,
    files: list[tuple[str, Callable[[BinaryIO], None]]],
    *,
    stage: str,
    config: dict,
    inputs: dict[str, str],
    metrics: dict,
) -> Manifest:
    """Commit the policy artifact at `uri` (`<stage_uri>/policy`) from `files`, the (name, write into a binary
    stream) pairs of `forge_core.models.hf_folder_files`: each is streamed into the store and hashed on the way,
    with no local copy. Returns its manifest.

    Raises:
        ArtifactAlreadyCommitted: another attempt committed `uri` first.
    """
    writer = store.writer(uri, kind=POLICY_KIND, stage=stage)
    for name, write in files:
        with writer.open(name) as f:
            write(f)
    return writer.commit(config=config, inputs=inputs, metrics=metrics)


def _committed_policy_uri(store: ObjectStore, uri: str) -> str:
    """The policy artifact `uri` names: itself (kind `policy`) or the `policy/` of a committed sft/grpo artifact."""
    uri = uri.rstrip("/")
    try:
        kind = store.read_manifest(uri).kind
    except ArtifactError as exc:
        raise ValueError(
            f"cannot export {uri}: {exc}. Export a committed policy: the final policy a run printed, or an sft or "
            "grpo artifact that `forgeflow status` lists"
        ) from exc
    if kind == POLICY_KIND:
        return uri
    if kind not in policy_kinds():
        raise ValueError(
            f"{uri} is a {kind!r} artifact, which holds no policy; export {POLICY_WHAT} (kinds {list(policy_kinds())}), "
            f"or its {POLICY_DIR}/"
        )
    return policy_uri(store, uri)


def policy_ref(store: ObjectStore, stage_uri: str, input_name: str = "policy") -> PolicyRef:
    """`<stage_uri>/policy` as `fetch_policy` names it, without a local copy; ValueError as `fetch_policy` when
    it is not a committed policy."""
    policy_kind(store, stage_uri, input_name)
    manifest_bytes, manifest = _policy_manifest(store, stage_uri, input_name)
    return PolicyRef(
        uri=policy_uri(store, stage_uri),
        version=weights_version(manifest, f"inputs.{input_name}={stage_uri}/{POLICY_DIR}"),
        local_dir=None,
        manifest_sha256=hashlib.sha256(manifest_bytes).hexdigest(),
    )


def committed_policy_version(store: ObjectStore, stage_uri: str, input_name: str = "policy") -> str:
    """The version of `<stage_uri>/policy` (its manifest's `weights_version`), read without downloading it."""
    return policy_ref(store, stage_uri, input_name).version


def fetch_policy(
    store: ObjectStore, stage_uri: str, input_name: str = "policy", cache_root: Path | None = None
) -> PolicyRef:
    """The verified, cached local copy of `<stage_uri>/policy`, leased to this process until `release_policy`;
    ValueError naming `inputs.<input_name>` when the stage artifact or its policy is missing, uncommitted, of
    the wrong kind or corrupted, or when the cache's disk is full."""
    policy_kind(store, stage_uri, input_name)
    manifest_bytes, manifest = _policy_manifest(store, stage_uri, input_name)
    manifest_sha256 = hashlib.sha256(manifest_bytes).hexdigest()  # == store.manifest_sha256(its uri)
    version = weights_version(manifest, f"inputs.{input_name}={stage_uri}/{POLICY_DIR}")
    root = (cache_root or policy_cache_root()).absolute()
    root.mkdir(parents=True, exist_ok=True)
    local_dir = root / manifest_sha256
    # Leased before looking: a pruner in another process cannot remove it between our check and our use.
    _lease(local_dir)
    if not _is_cached(local_dir):
        with _fetch_turn(local_dir):
            if not _is_cached(local_dir):  # else another process downloaded it while we waited for our turn
                size = sum(entry.size for entry in manifest.files.values())
                _download_or_make_room(store, policy_uri(store, stage_uri), local_dir, input_name, size)
                prune_policy_cache(root, keep=local_dir)
    log.info("policy %s at %s (policy cache %s: $%s moves it)", policy_uri(store, stage_uri), local_dir, root, CACHE_ENV)
    now = time.time_ns()  # explicit: the file system's own clock is too coarse to order quick fetches
    with contextlib.suppress(OSError):
        os.utime(local_dir / _COMPLETE_MARKER, ns=(now, now))  # the cache's least-recently-used order
    return PolicyRef(
        uri=policy_uri(store, stage_uri), version=version, local_dir=local_dir, manifest_sha256=manifest_sha256
    )


def _download_or_make_room(
    store: ObjectStore, uri: str, local_dir: Path, input_name: str, size: int
) -> None:
    try:
        _download(store, uri, local_dir, input_name)
        return
    except OSError as exc:
        if exc.errno not in _DISK_FULL:
            raise
    freed = prune_policy_cache(local_dir.parent, CacheBounds(max_policies=1, max_bytes=0), keep=local_dir)
    try:
        _download(store, uri, local_dir, input_name)
    except OSError as exc:
        if exc.errno not in _DISK_FULL:
            raise
        raise ValueError(
            f"inputs.{input_name}: no space left to download the policy {uri} ({size} bytes) into the "
            f"policy cache {local_dir.parent} (${CACHE_ENV}), even after removing {len(freed)} unused cached "
            f"policies; free space there, set {CACHE_ENV} to a folder on a larger disk, or lower "
            f"{MAX_GB_ENV} / {MAX_POLICIES_ENV} below what the disk holds"
        ) from exc


_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def _download(store: ObjectStore, uri: str, local_dir: Path, input_name: str) -> None:
    staging = local_dir.with_name(f".{local_dir.name}.{uuid.uuid4().hex[:8]}.partial")
    try:
        store.reader(uri).download_dir("", staging)
        (staging / _COMPLETE_MARKER).write_text(uri + "\n")
        if local_dir.exists():
            shutil.rmtree(local_dir)  # an incomplete copy from a crashed process (no marker)
        os.replace(staging, local_dir)
    except (ArtifactError, FileNotFoundError) as exc:
        raise ValueError(f"inputs.{input_name}: cannot read the policy at {uri}: {exc}") from exc
    except OSError:
        if _is_cached(local_dir):
            return  # another process finished the same download first
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
