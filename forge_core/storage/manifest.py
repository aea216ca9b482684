"""`_MANIFEST.json`: the commit record of an artifact, written last as a single object.

Fields: format_version, kind, stage, key, files {rel: {size, sha256}}, schema {table_rel: arrow schema
string}, config, inputs {name: {uri, manifest_sha256}}, code_version, host, created_at, committed_at, metrics.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from datetime import UTC, datetime

MANIFEST_NAME = "_MANIFEST.json"
CHECKPOINTS_DIR = "_checkpoints"
FORMAT_VERSION = 1
# Part of every temporary object name (atomic local replaces, downloads); never adopted or listed as data.
TEMP_MARKER = ".forge-tmp-"


def utc_now_iso() -> str:
    """UTC timestamp with fixed width (microseconds, +00:00), so string order is time order."""
    return datetime.now(UTC).isoformat(timespec="microseconds")


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
    format_version: int = FORMAT_VERSION

    def to_json_bytes(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), sort_keys=True, indent=1, allow_nan=False).encode("utf-8")

    @classmethod
    def from_json_bytes(cls, data: bytes) -> Manifest:
        """Parse a manifest; raises ValueError (with the reason) when it is not one this code can read."""
        raw = json.loads(data.decode("utf-8"))
        if not isinstance(raw, dict):
            raise ValueError(f"manifest is a JSON {type(raw).__name__}, expected an object")  # noqa: TRY004
        version = raw.get("format_version")
        if version != FORMAT_VERSION:
            raise ValueError(f"manifest format_version={version!r}; this forgeflow reads {FORMAT_VERSION}")
        missing = sorted({f.name for f in dataclasses.fields(cls)} - set(raw))
        if missing:
            raise ValueError(f"manifest lacks fields {missing}")
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
            format_version=version,
        )
