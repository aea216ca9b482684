"""Storage URIs: normalizing a configured root and joining untrusted keys onto it safely.

Supported schemes: `file://` (a bare or relative path also means a local folder), `s3://bucket/prefix`,
`memory://name` (fsspec's in-process filesystem, for unit tests).
"""

from __future__ import annotations

import os
import re

SCHEMES = ("file", "s3", "memory")
_SCHEME_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def split_scheme(uri: str) -> tuple[str, str]:
    """`"s3://b/k"` -> `("s3", "b/k")`; a string without a scheme is a local path: `("file", path)`."""
    match = _SCHEME_RE.match(uri)
    if not match:
        return "file", uri
    return match.group(1).lower(), uri[match.end() :]


def normalize_root_uri(root: str) -> str:
    """Return the canonical absolute URI of a storage root (no trailing slash).

    `./store`, `store`, `file://./store` -> `file:///<cwd>/store`; `s3://bucket/prefix/` -> `s3://bucket/prefix`;
    `memory://name` stays. Raises ValueError naming `storage.root` for an empty root or unsupported scheme.
    """
    if not isinstance(root, str) or not root.strip():
        raise ValueError(f"storage.root={root!r}: empty; use a folder, file://<dir>, s3://<bucket>/<prefix>")
    scheme, rest = split_scheme(root.strip())
    if scheme == "file":
        return "file://" + os.path.abspath(os.path.expanduser(rest or "."))
    if scheme == "s3":
        bucket_and_prefix = _checked_segments(rest, what=f"storage.root={root!r}")
        if not bucket_and_prefix:
            raise ValueError(f"storage.root={root!r}: no bucket; use s3://<bucket>/<prefix>")
        return "s3://" + "/".join(bucket_and_prefix)
    if scheme == "memory":
        segments = _checked_segments(rest, what=f"storage.root={root!r}")
        if not segments:
            raise ValueError(f"storage.root={root!r}: no name; use memory://<name>")
        return "memory://" + "/".join(segments)
    raise ValueError(
        f"storage.root={root!r}: unsupported scheme {scheme!r}; use file://<dir>, s3://<bucket>/<prefix> "
        "or memory://<name>"
    )


def safe_join(base: str, *parts: str) -> str:
    """Join storage keys onto `base`, refusing any key that could escape it.

    Keys may contain `/` (several segments). Raises ValueError for `..` segments, absolute paths, URIs,
    backslashes and NUL bytes: keys can come from user input (artifact keys, pointer names, file names).
    Empty and `.` segments are dropped, so `safe_join("s3://b/r", "a//b/./c")` == `"s3://b/r/a/b/c"`.
    """
    segments: list[str] = []
    for part in parts:
        segments.extend(_checked_segments(part, what=f"storage key {part!r}", allow_absolute=False))
    if not segments:
        return base
    separator = "" if base.endswith("/") else "/"
    return base + separator + "/".join(segments)


def normalize_rel(rel: str) -> str:
    """Canonical relative file name inside an artifact (`a//b/./c` -> `a/b/c`); ValueError if it escapes."""
    segments = _checked_segments(rel, what=f"artifact file name {rel!r}", allow_absolute=False)
    return "/".join(segments)


def check_name(name: str, what: str) -> str:
    """Validate a single path segment (artifact kind, key, pointer name); returns it unchanged."""
    segments = _checked_segments(name, what=f"{what}={name!r}", allow_absolute=False)
    if len(segments) != 1 or segments[0] != name:
        raise ValueError(f"{what}={name!r}: must be one non-empty path segment without '/', '.' or '..'")
    return name


def _checked_segments(key: str, what: str, allow_absolute: bool = True) -> list[str]:
    if not isinstance(key, str):
        raise TypeError(f"{what}: storage keys must be str, got {type(key).__name__}")
    if "\x00" in key or "\\" in key:
        raise ValueError(f"{what}: NUL bytes and backslashes are not allowed in storage keys")
    if not allow_absolute and (key.startswith("/") or _SCHEME_RE.match(key)):
        raise ValueError(f"{what}: absolute paths and URIs are not allowed; give a key relative to the root")
    segments = [s for s in key.split("/") if s not in ("", ".")]
    if ".." in segments:
        raise ValueError(f"{what}: '..' would escape the storage root; remove it")
    return segments
