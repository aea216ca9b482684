"""ObjectStore: forgeflow's artifact store over fsspec (file://, s3://, memory://).

    store = ObjectStore.from_config(cfg.storage)          # or ObjectStore("s3://bucket/prefix")
    uri = store.artifact_uri("data", key)
    w = store.writer(uri, kind="data", stage="prepare")
    w.write_table("sft.parquet", table)
    w.commit(config=cfg_dict, inputs={}, metrics={"rows": 1000})
    table = store.reader(uri).read_table("sft.parquet")     # verified against the manifest

Credentials are never passed in: s3fs/botocore take them from the standard AWS environment variables,
profile or instance role, so they cannot end up in manifests, logs or error messages.

Exclusive creation (`create_exclusive`) is the one primitive that decides races (manifests, pointer and
lease generations). Locally it is a temp file hard-linked to the final name; on S3 a conditional `PutObject`
with `If-None-Match: *`, which the endpoint must honour (`conditional_write_problem`); on memory:// a
process-wide lock.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime

import fsspec

from forge_core.credentials import redact_url
from forge_core.storage.errors import (
    ArtifactAlreadyCommitted,
    ArtifactCorrupted,
    ArtifactNotCommitted,
    PointerConflict,
    StorageAccessError,
)
from forge_core.storage.generations import GenerationLog
from forge_core.storage.manifest import (
    ATTEMPTS_DIR,
    MANIFEST_NAME,
    TEMP_MARKER,
    Manifest,
    attempt_created_at,
    utc_now_iso,
)
from forge_core.storage.retry import Retrier, is_already_there
from forge_core.storage.streams import FsFileSink, PartSink, S3MultipartSink
from forge_core.storage.uris import check_name, normalize_root_uri, safe_join, split_scheme

log = logging.getLogger(__name__)

POINTERS_DIR = "_pointers"
ENDPOINT_ENV_VARS = ("FORGE_S3_ENDPOINT_URL", "AWS_ENDPOINT_URL")
# memory:// is one dict per process: a lock makes check-then-create atomic there.
_MEMORY_CREATE_LOCK = threading.Lock()


@dataclass(frozen=True)
class PointerState:
    """What a pointer says now: `uri` (None before the first write) at `version` (0 before the first write).
    Pass `version` back to `pointer_write` to swap the pointer only if nobody moved it meanwhile."""

    name: str
    uri: str | None
    version: int
    manifest_sha256: str | None = None


def endpoint_from_env() -> str | None:
    """The S3 endpoint named by FORGE_S3_ENDPOINT_URL, else AWS_ENDPOINT_URL, else None (AWS itself)."""
    for name in ENDPOINT_ENV_VARS:
        if os.environ.get(name):
            return os.environ[name]
    return None


def _s3_client_kwargs(endpoint_url: str | None, region: str | None) -> dict:
    kwargs = {}
    if endpoint_url:
        kwargs["endpoint_url"] = endpoint_url
    if region:
        kwargs["region_name"] = region
    return kwargs


def _make_filesystem(scheme: str, client_kwargs: dict):
    if scheme == "file":
        return fsspec.filesystem("file", auto_mkdir=True)
    if scheme == "memory":
        return fsspec.filesystem("memory")
    import s3fs

    # Retries are ours alone (Retrier): botocore's and s3fs's would multiply with them and hide failures.
    # No listing cache: other processes (DCP ranks, other stages) write under our prefixes.
    # fsspec caches the instance per (options, thread), so stores on one endpoint share one costly client.
    fs = s3fs.S3FileSystem(
        client_kwargs=client_kwargs,
        config_kwargs={"retries": {"total_max_attempts": 1}},
        use_listings_cache=False,
    )
    fs.retries = 1
    return fs


class ObjectStore:
    """Artifacts under one root URI. See the module docstring for a usage example."""

    def __init__(
        self,
        root_uri: str,
        endpoint_url: str | None = None,
        region: str | None = None,
        retries: int = 5,
        retry_backoff_s: float = 0.5,
        retry_horizon_s: float = 0.0,
        keep_checkpoints: int = 2,
        lease_ttl_s: float = 300.0,
        lease_renew_s: float = 30.0,
    ) -> None:
        if keep_checkpoints < 1:
            raise ValueError(f"storage.keep_checkpoints={keep_checkpoints}: must be >= 1 (resume needs one)")
        if not 0 < lease_renew_s <= lease_ttl_s / 2:
            raise ValueError(
                f"storage.lease_renew_s={lease_renew_s}, storage.lease_ttl_s={lease_ttl_s}: need "
                "0 < lease_renew_s <= lease_ttl_s / 2, so a live holder renews well before its lease goes stale"
            )
        self.keep_checkpoints = keep_checkpoints
        self.lease_ttl_s = lease_ttl_s
        self.lease_renew_s = lease_renew_s
        self.root = normalize_root_uri(root_uri)
        self.scheme = split_scheme(self.root)[0]
        self.endpoint_url = (endpoint_url or endpoint_from_env()) if self.scheme == "s3" else None
        client_kwargs = _s3_client_kwargs(self.endpoint_url, region) if self.scheme == "s3" else {}
        # What DCP's FsspecWriter/Reader (and any fsspec call) needs to reach the same store: endpoint and
        # region only, never secrets.
        self.storage_options: dict = {"client_kwargs": client_kwargs} if client_kwargs else {}
        self.retrier = Retrier(retries, retry_backoff_s, horizon_s=retry_horizon_s)
        self.fs = _make_filesystem(self.scheme, client_kwargs)
        self._root_checked = self.scheme != "s3"

    @classmethod
    def from_config(cls, storage_cfg) -> ObjectStore:
        """Build from a `StorageConfig` (cfg.storage)."""
        return cls(
            storage_cfg.root,
            endpoint_url=storage_cfg.endpoint_url,
            region=storage_cfg.region,
            retries=storage_cfg.retries,
            retry_backoff_s=storage_cfg.retry_backoff_s,
            retry_horizon_s=storage_cfg.retry_horizon_s,
            keep_checkpoints=storage_cfg.keep_checkpoints,
            lease_ttl_s=storage_cfg.lease_ttl_s,
            lease_renew_s=storage_cfg.lease_renew_s,
        )

    def __repr__(self) -> str:
        endpoint = f", endpoint_url={redact_url(self.endpoint_url)!r}" if self.endpoint_url else ""
        return f"ObjectStore({self.root!r}{endpoint})"

    # ---- URIs -------------------------------------------------------------------------------------------

    def join(self, uri: str, *parts: str) -> str:
        """`uri/part/...`; raises ValueError for parts that would escape `uri` (see `safe_join`)."""
        return safe_join(uri, *parts)

    def artifact_uri(self, kind: str, key: str) -> str:
        """`<root>/<kind>/<key>`; kind and key must be single path segments."""
        return self.join(self.root, check_name(kind, "artifact kind"), check_name(key, "artifact key"))

    def fsspec_path(self, uri: str) -> str:
        """The path to give fsspec-based tools (DCP's FsspecWriter/Reader) together with
        `**store.storage_options`: `FsspecWriter(store.fsspec_path(ckpt_uri), **store.storage_options)`."""
        self.path_of(uri)  # validates the scheme
        return uri

    def local_path(self, uri: str) -> str | None:
        """The local filesystem path of a file:// URI, or None on remote stores."""
        return self.path_of(uri) if self.scheme == "file" else None

    def path_of(self, uri: str) -> str:
        """The fsspec path (protocol stripped) of a URI of this store's scheme."""
        scheme, _ = split_scheme(uri)
        if scheme != self.scheme:
            raise ValueError(
                f"URI {uri!r} has scheme {scheme!r}, but this store ({self.root}) is {self.scheme}://"
            )
        return self.fs._strip_protocol(uri)

    def uri_of(self, path: str) -> str:
        """Inverse of `path_of`."""
        if self.scheme == "file":
            return "file://" + path
        return f"{self.scheme}://{path.lstrip('/')}"

    # ---- low-level object operations, retried -----------------------------------------------------------

    def call(self, what: str, fn, *args, **kwargs):
        """Run one fsspec call under the store's retry policy (after a one-time check that the root exists)."""
        self._check_root_once()
        return self.retrier.call(what, fn, *args, **kwargs)

    def _check_root_once(self) -> None:
        """Fail fast on a missing bucket: without this check s3fs reports "no such object" for every key,
        so a typo in storage.root would look like an empty store."""
        if self._root_checked:
            return
        bucket = self.root.removeprefix("s3://").split("/", 1)[0]
        where = f"at endpoint {redact_url(self.endpoint_url)}" if self.endpoint_url else "on AWS"
        try:
            self.retrier.call(f"check bucket s3://{bucket}", self.fs.call_s3, "head_bucket", Bucket=bucket)
        except FileNotFoundError as exc:
            raise StorageAccessError(
                f"storage.root={self.root}: bucket {bucket!r} does not exist {where}; create it "
                f"(e.g. `aws s3 mb s3://{bucket}`) or point storage.root at an existing bucket"
            ) from exc
        except StorageAccessError as exc:
            # HeadBucket needs s3:ListBucket; a role limited to object get/put may still do all we need,
            # and a real denial surfaces (as StorageAccessError) on the first object operation.
            log.info("storage: cannot check bucket %s (%s); continuing", bucket, exc)
        self._root_checked = True

    def exists(self, uri: str) -> bool:
        return self.call(f"exists {uri}", self.fs.exists, self.path_of(uri))

    def size_of(self, uri: str) -> int:
        """Size in bytes of the object at `uri`; FileNotFoundError if absent."""
        return int(self.call(f"stat {uri}", self.fs.info, self.path_of(uri))["size"])

    def get_bytes(self, uri: str) -> bytes:
        """Raw bytes of one object, unverified (for manifests, pointers and specs; artifacts use reader())."""
        return self.call(f"get {uri}", self.fs.cat_file, self.path_of(uri))

    def get_range(self, uri: str, start: int, end: int) -> bytes:
        return self.call(
            f"get {uri} [{start}:{end}]", self.fs.cat_file, self.path_of(uri), start=start, end=end
        )

    def put_bytes(self, uri: str, data: bytes) -> None:
        """Write one small object atomically: a reader sees the old object, nothing, or all of `data`."""
        path = self.path_of(uri)
        if self.scheme == "file":
            self._publish_local_file(path, data, os.replace)
        else:
            self.call(f"put {uri}", self.fs.pipe_file, path, data)
            self.fs.invalidate_cache(path)

    @staticmethod
    def _publish_local_file(path: str, data: bytes, publish) -> None:
        """Write `data` to a temp file beside `path` (fsynced), then `publish(temp, path)`: `os.replace`
        (replaces atomically) or `os.link` (FileExistsError when the name is taken: never replaces)."""
        temp = f"{path}{TEMP_MARKER}{uuid.uuid4().hex}"
        try:
            for tries_left in reversed(range(3)):
                os.makedirs(os.path.dirname(path), exist_ok=True)
                try:
                    with open(temp, "wb") as f:
                        f.write(data)
                        f.flush()
                        os.fsync(f.fileno())
                    break
                except FileNotFoundError:
                    if not tries_left:  # the folder went away again (a lease purged meanwhile): retry
                        raise
            publish(temp, path)
        finally:
            if os.path.exists(temp):
                os.remove(temp)

    def create_exclusive(self, uri: str, data: bytes) -> bool:
        """Create the object at `uri` holding `data` unless it exists; True when this call created it, False
        when another writer's object is there (a retried create that finds its own bytes counts as created)."""
        path = self.path_of(uri)
        what = f"create {uri}"
        try:
            if self.scheme == "file":
                self.call(what, self._publish_local_file, path, data, os.link)
            elif self.scheme == "memory":
                self.call(what, self._create_memory_object, path, data)
            else:
                bucket, key, _ = self.fs.split_path(path)
                self.call(
                    what, self.fs.call_s3, "put_object", Bucket=bucket, Key=key, Body=data, IfNoneMatch="*"
                )
                self.fs.invalidate_cache(path)
        except OSError as exc:
            if not is_already_there(exc):
                raise
            try:
                return self.get_bytes(uri) == data
            except FileNotFoundError:
                return False  # deleted again since: still not ours
        return True

    def conditional_write_problem(self) -> str | None:
        """Why this store cannot commit exclusively, None when it can. On S3 a probe object is created twice
        with `If-None-Match: *` and the second create must be refused; local and memory stores always can."""
        if self.scheme in ("file", "memory"):
            return None
        probe = self.join(self.root, "_probes", f"conditional-write-{uuid.uuid4().hex}")
        try:
            first, second = self.create_exclusive(probe, b"first"), self.create_exclusive(probe, b"second")
        finally:
            self.delete(probe)
        if first and not second:
            return None
        endpoint = redact_url(self.endpoint_url) if self.endpoint_url else "of AWS"
        return (
            f"storage.root={self.root}: the S3 endpoint {endpoint} ignored If-None-Match (a second conditional PUT "
            "of one key was accepted), so two attempts of a stage could both commit; use an endpoint that answers "
            "412 to it (AWS S3 since 2024-08, MinIO since mid-2024)"
        )

    def _create_memory_object(self, path: str, data: bytes) -> None:
        with _MEMORY_CREATE_LOCK:
            if self.fs.exists(path):
                raise FileExistsError(path)
            self.fs.pipe_file(path, data)

    def delete(self, uri: str) -> None:
        """Delete one object; nothing happens when it is already gone."""
        try:
            self.call(f"delete {uri}", self.fs.rm_file, self.path_of(uri))
        except FileNotFoundError:
            pass
        self.fs.invalidate_cache(self.path_of(uri))

    def delete_prefix(self, uri: str) -> int:
        """Delete every object under the prefix `uri`; returns how many there were."""
        files = self.list_files(uri)
        if files:
            self.call(
                f"delete {len(files)} objects under {uri}", self.fs.rm, [self.path_of(u) for u in files]
            )
        if self.scheme == "file":
            _remove_empty_dirs(self.path_of(uri))
        self.fs.invalidate_cache(self.path_of(uri))
        return len(files)

    def list_files(self, uri: str) -> dict[str, int]:
        """All objects under the prefix `uri` (recursively): {uri: size}; {} when there are none."""
        found = self.call(f"list {uri}", self.fs.find, self.path_of(uri), detail=True)
        return {
            self.uri_of(path): int(info["size"]) for path, info in found.items() if info.get("type") == "file"
        }

    def open_part_sink(self, uri: str) -> PartSink:
        """Where a streaming artifact file goes: S3 multipart with per-part retries, or an fsspec file."""
        path = self.path_of(uri)
        if self.scheme == "s3":
            self._check_root_once()
            return S3MultipartSink(self.fs, path, self.retrier, what=uri)
        return FsFileSink(self.fs, path)

    # ---- artifacts --------------------------------------------------------------------------------------

    def manifest_uri(self, uri: str) -> str:
        return self.join(uri, MANIFEST_NAME)

    def is_committed(self, uri: str) -> bool:
        """True when `uri` has a `_MANIFEST.json`, i.e. its writer finished `commit()`."""
        return self.exists(self.manifest_uri(uri))

    def manifest_bytes(self, uri: str) -> bytes:
        """The exact bytes of the artifact's manifest; ArtifactNotCommitted when it has none."""
        try:
            return self.get_bytes(self.manifest_uri(uri))
        except FileNotFoundError as exc:
            raise ArtifactNotCommitted(
                f"artifact {uri} is not committed (no {MANIFEST_NAME}): it was never written, or its writer "
                "stopped before commit(); run the stage that produces it",
                uri,
            ) from exc

    def parse_manifest(self, uri: str, data: bytes) -> Manifest:
        try:
            return Manifest.from_json_bytes(data)
        except (ValueError, TypeError, KeyError) as exc:
            raise ArtifactCorrupted(
                f"artifact {uri}: {MANIFEST_NAME} is unreadable: {exc}", uri, MANIFEST_NAME
            ) from exc

    def read_manifest(self, uri: str) -> Manifest:
        return self.parse_manifest(uri, self.manifest_bytes(uri))

    def manifest_sha256(self, uri: str) -> str:
        """sha256 of the committed manifest's bytes: the identity of an artifact for content keys/lineage."""
        return hashlib.sha256(self.manifest_bytes(uri)).hexdigest()

    def writer(self, uri: str, kind: str, stage: str, attempt: str | None = None):
        """Start writing the artifact at `uri` as one attempt (`attempt`, default a new unique id);
        ArtifactAlreadyCommitted when it is committed already (nothing is overwritten). See ArtifactWriter."""
        from forge_core.storage.writer import ArtifactWriter

        self.path_of(uri)
        if self.is_committed(uri):
            raise ArtifactAlreadyCommitted(
                f"artifact {uri} is already committed; artifacts are immutable, write to a new key instead",
                uri,
            )
        return ArtifactWriter(self, uri, kind=kind, stage=stage, attempt=attempt)

    def reader(self, uri: str):
        """Open a committed artifact for verified reads; raises ArtifactNotCommitted otherwise."""
        from forge_core.storage.reader import ArtifactReader

        data = self.manifest_bytes(uri)
        return ArtifactReader(self, uri, self.parse_manifest(uri, data), data)

    def files_uri(self, uri: str, attempt: str | None) -> str:
        """Where the files of `attempt` of the artifact at `uri` live (format 1, attempt None: `uri` itself)."""
        return self.join(uri, ATTEMPTS_DIR, attempt) if attempt else uri.rstrip("/")

    def list_committed(self, kind: str, under: str | None = None) -> list[str]:
        """URIs of committed artifacts of `kind` under `under` (default: the root), oldest commit first; a
        manifest that cannot be parsed is skipped with a warning."""
        base = under or self.root
        found = []
        for file_uri in self.list_files(base):
            if not file_uri.endswith("/" + MANIFEST_NAME):
                continue
            uri = file_uri[: -len(MANIFEST_NAME) - 1]
            try:
                manifest = self.read_manifest(uri)
            except (ArtifactCorrupted, ArtifactNotCommitted) as exc:
                log.warning("storage: skipping %s while listing: %s", uri, exc)
                continue
            if manifest.kind == kind:
                found.append((manifest.committed_at, uri))
        return [uri for _, uri in sorted(found)]

    def delete_artifact(self, uri: str) -> None:
        """Un-commit, then delete, the committed artifact at `uri`: the manifest first, so nothing half-deleted
        ever looks committed, then the committed attempt's files. Other attempts' files (one may still be
        writing; crashed ones are `sweep_stale_attempts`') and nested artifacts under `uri` are left alone."""
        manifest = self.read_manifest(uri)
        self.delete(self.manifest_uri(uri))
        if manifest.attempt is None:
            for rel in manifest.files:
                self.delete(self.join(uri, rel))
        else:
            self.delete_prefix(self.files_uri(uri, manifest.attempt))
        if self.scheme == "file":
            _remove_empty_dirs(self.path_of(uri))

    def sweep_stale_attempts(self, older_than_s: float, under: str | None = None, limit: int | None = None) -> list[str]:
        """Delete the files of uncommitted attempts older than `older_than_s` under `under` (default: the whole
        store), at most `limit` of them, oldest first; returns the attempt prefixes deleted. An attempt younger
        than that may still be writing: choose `older_than_s` above the longest stage's run time."""
        now = datetime.now(UTC)
        marker = f"/{ATTEMPTS_DIR}/"
        prefixes: set[tuple[str, str]] = set()
        for file_uri in self.list_files(under or self.root):
            if marker in file_uri:
                artifact, rest = file_uri.split(marker, 1)
                prefixes.add((artifact, rest.split("/", 1)[0]))
        deleted = []
        for artifact, attempt in sorted(prefixes, key=lambda found: found[1]):
            if limit is not None and len(deleted) >= limit:
                break
            created = attempt_created_at(attempt)
            if created is None or (now - created).total_seconds() < older_than_s:
                continue
            if self.is_committed(artifact) and self.read_manifest(artifact).attempt == attempt:
                continue
            attempt_uri = self.files_uri(artifact, attempt)
            self.delete_prefix(attempt_uri)
            deleted.append(attempt_uri)
        return deleted

    # ---- pointers ---------------------------------------------------------------------------------------

    def pointer_uri(self, name: str) -> str:
        """Where a format-1 pointer (one object, replaced in place) lives; read while no generation exists."""
        return self.join(self.root, POINTERS_DIR, check_name(name, "pointer name") + ".json")

    def _pointer_log(self, name: str) -> GenerationLog:
        return GenerationLog(self, self.join(self.root, POINTERS_DIR, check_name(name, "pointer name")))

    def pointer_state(self, name: str) -> PointerState:
        """The pointer's target and version (PointerState(name, None, 0) when it was never written)."""
        version, record = self._pointer_log(name).latest()
        if record is not None:
            return PointerState(name, record["uri"], version, record.get("manifest_sha256"))
        try:
            legacy = json.loads(self.get_bytes(self.pointer_uri(name)))
        except FileNotFoundError:
            return PointerState(name, None, 0)
        except ValueError as exc:
            raise ValueError(
                f"pointer {self.pointer_uri(name)} is not a valid pointer record: {exc}"
            ) from exc
        return PointerState(name, legacy["uri"], 0, legacy.get("manifest_sha256"))

    def pointer_read(self, name: str) -> str | None:
        """The artifact URI that `name` points at, or None when the pointer was never written."""
        return self.pointer_state(name).uri

    def pointer_write(self, name: str, uri: str, expected_version: int) -> PointerState:
        """Point `name` at the committed artifact `uri` if the pointer is still at `expected_version` (the
        `version` of the PointerState the caller decided on); returns the new state. PointerConflict (with the
        current state) when anyone moved it since: re-read, decide again and retry."""
        sha = self.manifest_sha256(uri)  # raises ArtifactNotCommitted: never point at a half-written artifact
        pointer_log = self._pointer_log(name)
        current = self.pointer_state(name)
        if current.version == expected_version:
            record = {"name": name, "uri": uri, "manifest_sha256": sha, "updated_at": utc_now_iso()}
            if pointer_log.append(expected_version, record):
                return PointerState(name, uri, expected_version + 1, sha)
            current = self.pointer_state(name)
        raise PointerConflict(
            f"pointer {name!r}: expected version {expected_version}, but it is at version {current.version} "
            f"({current.uri}); re-read it, decide again against its target, and write with that version",
            current,
        )

    # ---- leases -----------------------------------------------------------------------------------------

    def acquire_lease(self, key_uri: str, holder: str, is_done, on_wait=lambda record: None, owner=None):
        """A lease on `key_uri` with this store's TTL and renewal interval (forge_core.storage.lease)."""
        from forge_core.storage.lease import acquire_lease

        return acquire_lease(self, key_uri, holder, is_done, on_wait, owner=owner)


def _remove_empty_dirs(path: str) -> None:
    """Local stores: remove the folders left empty under (and including) `path` after a delete."""
    if not os.path.isdir(path):
        return
    for folder, _, _ in os.walk(path, topdown=False):
        try:
            os.rmdir(folder)
        except OSError:
            pass  # not empty
