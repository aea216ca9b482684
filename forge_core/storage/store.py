"""ObjectStore: forgeflow's artifact store over fsspec (file://, s3://, memory://).

    store = ObjectStore.from_config(cfg.storage)          # or ObjectStore("s3://bucket/prefix")
    uri = store.artifact_uri("data", key)
    w = store.writer(uri, kind="data", stage="prepare")
    w.write_table("sft.parquet", table)
    w.commit(config=cfg_dict, inputs={}, metrics={"rows": 1000})
    table = store.reader(uri).read_table("sft.parquet")     # verified against the manifest

Credentials are never passed in: s3fs/botocore take them from the standard AWS environment variables,
profile or instance role, so they cannot end up in manifests, logs or error messages.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import uuid

import fsspec

from forge_core.storage.errors import (
    ArtifactAlreadyCommitted,
    ArtifactCorrupted,
    ArtifactNotCommitted,
    StorageAccessError,
)
from forge_core.storage.manifest import MANIFEST_NAME, TEMP_MARKER, Manifest, utc_now_iso
from forge_core.storage.retry import Retrier
from forge_core.storage.streams import FsFileSink, PartSink, S3MultipartSink
from forge_core.storage.uris import check_name, normalize_root_uri, safe_join, split_scheme

log = logging.getLogger(__name__)

POINTERS_DIR = "_pointers"
ENDPOINT_ENV_VARS = ("FORGE_S3_ENDPOINT_URL", "AWS_ENDPOINT_URL")


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
    # fsspec caches the instance per (options, thread), so stores on one endpoint share one client: creating
    # an aiobotocore client costs about a second.
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
    ) -> None:
        self.root = normalize_root_uri(root_uri)
        self.scheme = split_scheme(self.root)[0]
        self.endpoint_url = (endpoint_url or endpoint_from_env()) if self.scheme == "s3" else None
        client_kwargs = _s3_client_kwargs(self.endpoint_url, region) if self.scheme == "s3" else {}
        # What DCP's FsspecWriter/Reader (and any fsspec call) needs to reach the same store: endpoint and
        # region only, never secrets.
        self.storage_options: dict = {"client_kwargs": client_kwargs} if client_kwargs else {}
        self.retrier = Retrier(retries, retry_backoff_s)
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
        )

    def __repr__(self) -> str:
        endpoint = f", endpoint_url={self.endpoint_url!r}" if self.endpoint_url else ""
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
        where = f"at endpoint {self.endpoint_url}" if self.endpoint_url else "on AWS"
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
        """Write one small object atomically: a reader sees the old object, nothing, or all of `data`.

        S3 and memory puts are atomic by nature; on local disk it is a temp file + os.replace.
        """
        path = self.path_of(uri)
        if self.scheme == "file":
            self._replace_local_file(path, data)
        else:
            self.call(f"put {uri}", self.fs.pipe_file, path, data)
            self.fs.invalidate_cache(path)

    @staticmethod
    def _replace_local_file(path: str, data: bytes) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        temp = f"{path}{TEMP_MARKER}{uuid.uuid4().hex}"
        try:
            with open(temp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temp, path)
        finally:
            if os.path.exists(temp):
                os.remove(temp)

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

    def writer(self, uri: str, kind: str, stage: str):
        """Start writing the artifact at `uri`; refuses an already committed one (nothing is overwritten).

        Leftovers of an earlier crashed attempt under `uri` are simply overwritten or ignored: only files
        written (or adopted) through this writer are listed in its manifest.
        """
        from forge_core.storage.writer import ArtifactWriter

        self.path_of(uri)
        if self.is_committed(uri):
            raise ArtifactAlreadyCommitted(
                f"artifact {uri} is already committed; artifacts are immutable, write to a new key instead",
                uri,
            )
        return ArtifactWriter(self, uri, kind=kind, stage=stage)

    def reader(self, uri: str):
        """Open a committed artifact for verified reads; raises ArtifactNotCommitted otherwise."""
        from forge_core.storage.reader import ArtifactReader

        data = self.manifest_bytes(uri)
        return ArtifactReader(self, uri, self.parse_manifest(uri, data), data)

    def list_committed(self, kind: str, under: str | None = None) -> list[str]:
        """URIs of committed artifacts of `kind` under `under` (default: the root), oldest commit first.

        Uncommitted prefixes are invisible; a manifest that cannot be parsed is skipped with a warning.
        """
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

    # ---- pointers ---------------------------------------------------------------------------------------

    def pointer_uri(self, name: str) -> str:
        return self.join(self.root, POINTERS_DIR, check_name(name, "pointer name") + ".json")

    def pointer_write(self, name: str, uri: str) -> None:
        """Point `name` (e.g. "promoted-policy") at a committed artifact, atomically replacing the old target."""
        sha = self.manifest_sha256(uri)  # raises ArtifactNotCommitted: never point at a half-written artifact
        record = {"name": name, "uri": uri, "manifest_sha256": sha, "updated_at": utc_now_iso()}
        self.put_bytes(self.pointer_uri(name), json.dumps(record, sort_keys=True).encode("utf-8"))

    def pointer_read(self, name: str) -> str | None:
        """The artifact URI that `name` points at, or None when the pointer was never written."""
        try:
            data = self.get_bytes(self.pointer_uri(name))
        except FileNotFoundError:
            return None
        try:
            return json.loads(data)["uri"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(
                f"pointer {self.pointer_uri(name)} is not a valid pointer record: {exc}"
            ) from exc
