"""`_MANIFEST.json`: the commit record of an artifact, written last as a single object, created exclusively.

Fields: format_version, kind, stage, key, attempt, files {rel: {size, sha256}}, schema {table_rel: arrow
schema string}, config, inputs {name: {uri, manifest_sha256}}, code_version, host, created_at, committed_at,
metrics, placement (where the writing process ran on the Ray cluster, see `current_placement`; null when
unknown; optional when read).

Layout (format 2): every writer (attempt) writes its files under its own prefix `<uri>/_attempts/<attempt>/`,
and the manifest names the attempt whose files it lists, so two writers of one key never touch each other's
bytes and the one whose manifest was created first owns the artifact. Format 1 manifests (no `attempt`, files
at the artifact root) are still read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import uuid
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import UTC, datetime

MANIFEST_NAME = "_MANIFEST.json"
CHECKPOINTS_DIR = "_checkpoints"
ATTEMPTS_DIR = "_attempts"
FORMAT_VERSION = 2
READABLE_FORMAT_VERSIONS = (1, 2)
_ATTEMPT_STAMP = "%Y%m%dT%H%M%SZ"
_ATTEMPT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# Part of every temporary object name (atomic local replaces, downloads); never adopted or listed as data.
TEMP_MARKER = ".forge-tmp-"
# A JSON object: where the process writing artifacts runs on the Ray cluster (pool, nodes with their Ray node
# ids, hosts and GPUs); recorded in every manifest it writes.
PLACEMENT_ENV = "FORGE_PLACEMENT"


# The placement of one stage's commits when it runs on a thread of a process serving several; it wins over
# FORGE_PLACEMENT.
_stage_placement: ContextVar[dict | None] = ContextVar("forge_stage_placement", default=None)


@contextlib.contextmanager
def placement_scope(record: dict) -> Iterator[None]:
    """Record `record` as the placement of what this thread (this context) commits inside the block."""
    token = _stage_placement.set(record)
    try:
        yield
    finally:
        _stage_placement.reset(token)


def current_placement() -> dict | None:
    """The placement record of what is committed now: the block's (`placement_scope`), else FORGE_PLACEMENT's;
    None when there is none; ValueError naming FORGE_PLACEMENT when it is not a JSON object."""
    scoped = _stage_placement.get()
    if scoped is not None:
        return scoped
    raw = os.environ.get(PLACEMENT_ENV)
    if not raw:
        return None
    try:
        record = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{PLACEMENT_ENV}: not JSON ({exc}); forge_core.run.cluster_runner writes it") from exc
    if not isinstance(record, dict):
        raise ValueError(f"{PLACEMENT_ENV}={raw[:80]!r}: expected a JSON object")  # noqa: TRY004
    return record


def utc_now_iso() -> str:
    """UTC timestamp with fixed width (microseconds, +00:00), so string order is time order."""
    return datetime.now(UTC).isoformat(timespec="microseconds")


def new_attempt_id() -> str:
    """A unique attempt id that starts with its UTC creation time (`20261201T101512Z-3fa2c9d1e0b4`), so a
    sweep of crashed attempts can tell their age from the name alone."""
    return f"{datetime.now(UTC).strftime(_ATTEMPT_STAMP)}-{uuid.uuid4().hex[:12]}"


def is_attempt_id(value) -> bool:
    """Whether `value` can name an attempt prefix (one path segment of letters, digits, `.`, `_`, `-`)."""
    return isinstance(value, str) and _ATTEMPT_ID.fullmatch(value) is not None


def attempt_created_at(attempt: str) -> datetime | None:
    """The creation time encoded in an attempt id, or None when the name is not one of ours."""
    try:
        return datetime.strptime(attempt.split("-", 1)[0], _ATTEMPT_STAMP).replace(tzinfo=UTC)
    except ValueError:
        return None


@dataclass(frozen=True)
class FileEntry:
    size: int
    sha256: str


@dataclass(frozen=True)
class InputRef:
    uri: str
    manifest_sha256: str


@dataclass(frozen=True)
class Manifest:
    kind: str
    stage: str
    key: str
    files: dict[str, FileEntry]
    schema: dict[str, str]
    config: dict
    inputs: dict[str, InputRef]
    code_version: str
    host: str
    created_at: str
    committed_at: str
    metrics: dict = field(default_factory=dict)
    # The writer whose files (under `_attempts/<attempt>/`) this manifest lists; None in format 1 (files at
    # the artifact root).
    attempt: str | None = None
    format_version: int = FORMAT_VERSION
    placement: dict | None = None

    def to_json_bytes(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), sort_keys=True, indent=1, allow_nan=False).encode("utf-8")

    @classmethod
    def from_json_bytes(cls, data: bytes) -> Manifest:
        """Parse a manifest; raises ValueError (with the reason) when it is not one this code can read."""
        raw = json.loads(data.decode("utf-8"))
        if not isinstance(raw, dict):
            raise ValueError(f"manifest is a JSON {type(raw).__name__}, expected an object")  # noqa: TRY004
        version = raw.get("format_version")
        if version not in READABLE_FORMAT_VERSIONS:
            raise ValueError(
                f"manifest format_version={version!r}; this forgeflow reads {list(READABLE_FORMAT_VERSIONS)}"
            )
        optional = {"attempt", "placement"} if version == 1 else {"placement"}
        missing = sorted({f.name for f in dataclasses.fields(cls)} - set(raw) - optional)
        if missing:
            raise ValueError(f"manifest lacks fields {missing}")
        attempt = raw.get("attempt")
        if version > 1 and not is_attempt_id(attempt):
            raise ValueError(f"manifest attempt={attempt!r}: expected the id of the attempt that wrote it")
        return cls(
            kind=raw["kind"],
            stage=raw["stage"],
            key=raw["key"],
            files={rel: FileEntry(**entry) for rel, entry in raw["files"].items()},
            schema=dict(raw["schema"]),
            config=raw["config"],
            inputs={name: InputRef(**ref) for name, ref in raw["inputs"].items()},
            code_version=raw["code_version"],
            host=raw["host"],
            created_at=raw["created_at"],
            committed_at=raw["committed_at"],
            metrics=raw["metrics"],
            attempt=attempt,
            format_version=version,
            placement=raw.get("placement"),
        )
