"""Credentials embedded in URLs: redacted wherever a URL is recorded, revealed only where it is read.

A data source may be a presigned or tokenised URL (`https://user:token@host/train.jsonl`,
`https://host/train.jsonl?X-Amz-Signature=...`). The config never holds such a URL in the clear:
`hide_credentials` (called when a config section is built) replaces userinfo and secret-looking query values
with `***` and remembers the real URL in this process. Everything derived from the config (specs, manifests,
wandb config, Prefect parameters, logs, error messages) therefore carries only the redacted form. The code
that opens the URL asks `reveal_url(redacted)` for the real one; a launched worker gets the map through its
environment (`secret_urls_env()`, variable FORGE_SECRET_URLS), the way AWS keys reach it.

    cfg.data.source                      # 'https://***@host/train.jsonl' (after hide_credentials)
    fsspec.open(reveal_url(cfg.data.source))
    redact_url("http://u:p@h:9000")      # 'http://***@h:9000'
    scrub_text(str(exc))                 # any URL credentials in free text redacted

stdlib only: the config layer imports it.
"""

from __future__ import annotations

import json
import os
import re
from urllib.parse import urlsplit, urlunsplit

REDACTED = "***"
SECRET_URLS_ENV = "FORGE_SECRET_URLS"
# Query parameters whose value is a secret: presigned S3/GCS/Azure URLs, API tokens, passwords.
_SECRET_PARAM_RE = re.compile(
    r"token|secret|signature|sig$|^sig|passw|pwd|credential|key|auth|session", re.IGNORECASE
)
_URL_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
# A URL inside free text (an exception message, a log line): scheme://, then anything but whitespace/quotes.
_URL_IN_TEXT_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]+")

_known: dict[str, str] = {}  # redacted -> real, for the URLs this process was given


def redact_url(url: str) -> str:
    """`url` with its userinfo (`user:password@`) and secret-looking query values replaced by `***`.

    Anything that is not a `scheme://` URL (a local path) and any URL without credentials comes back
    unchanged, character for character.
    """
    if not isinstance(url, str) or not _URL_RE.match(url):
        return url
    parts = urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        netloc = f"{REDACTED}@{netloc.rsplit('@', 1)[1]}"
    query = "&".join(_redact_param(p) for p in parts.query.split("&")) if parts.query else parts.query
    if netloc == parts.netloc and query == parts.query:
        return url
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def _redact_param(param: str) -> str:
    name, sep, value = param.partition("=")
    if sep and value and _SECRET_PARAM_RE.search(name):
        return f"{name}={REDACTED}"
    return param


def has_credentials(url: str) -> bool:
    """True if `url` carries userinfo or a secret-looking query value (redacted ones included)."""
    return redact_url(url) != url or is_redacted(url)


def is_redacted(url: str) -> bool:
    """True if `url` is the redacted form of a URL with credentials (made by `redact_url`)."""
    if not isinstance(url, str) or not _URL_RE.match(url):
        return False
    parts = urlsplit(url)
    userinfo = parts.netloc.rsplit("@", 1)[0] if "@" in parts.netloc else None
    values = [p.partition("=")[2] for p in parts.query.split("&")] if parts.query else []
    return userinfo == REDACTED or REDACTED in values


def hide_credentials(url: str) -> str:
    """The redacted form of `url`; the real URL is remembered in this process for `reveal_url`.

    Non-strings and URLs without credentials come back unchanged (a redacted URL stays as it is)."""
    redacted = redact_url(url)
    if redacted != url:
        _known[redacted] = url
    return redacted


def hide_credentials_in_overrides(overrides: list[str]) -> list[str]:
    """`key=value` overrides with every URL in them passed through `hide_credentials`: what a flow is called
    with is recorded by Prefect as the flow run's parameters, so the caller hands it the redacted form (the real
    URL stays known to this process, where the flow runs)."""
    return [_URL_IN_TEXT_RE.sub(lambda m: hide_credentials(m.group(0)), o) for o in overrides]


def reveal_url(url: str, what: str = "URL") -> str:
    """The real URL behind a redacted one: from this process's memory, else from FORGE_SECRET_URLS.

    A URL that was never redacted comes back unchanged. A redacted URL whose credentials this process was
    not given is a ValueError naming `what` and the fix (a stage run by hand, outside its task).
    """
    if url in _known:
        return _known[url]
    inherited = _inherited().get(url)
    if inherited is not None:
        return inherited
    if is_redacted(url):
        raise ValueError(
            f"{what}={url}: its credentials were redacted from the config and this process was not given "
            f"them; run the stage from its task (which passes them in {SECRET_URLS_ENV}), or set "
            f"{SECRET_URLS_ENV}='{{\"<redacted url>\": \"<real url>\"}}' in the environment"
        )
    return url


def secret_urls_env() -> dict[str, str]:
    """Environment for a launched worker: FORGE_SECRET_URLS with every real URL this process knows."""
    known = {**_inherited(), **_known}
    return {SECRET_URLS_ENV: json.dumps(known, sort_keys=True)} if known else {}


def scrub_text(text: str) -> str:
    """`text` with the credentials of every URL in it redacted, and every known real URL replaced."""
    for redacted, real in {**_inherited(), **_known}.items():
        text = text.replace(real, redacted)
    return _URL_IN_TEXT_RE.sub(lambda m: redact_url(m.group(0)), text)


def _inherited() -> dict[str, str]:
    raw = os.environ.get(SECRET_URLS_ENV)
    if not raw:
        return {}
    try:
        known = json.loads(raw)
    except ValueError:
        return {}
    if not isinstance(known, dict):
        return {}
    return {k: v for k, v in known.items() if isinstance(k, str) and isinstance(v, str)}
