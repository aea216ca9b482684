"""One retry policy for every storage call: exponential backoff on transient errors, fail fast otherwise.

The store builds its s3fs client with botocore's and s3fs's own retries turned off, so `storage.retries`
and `storage.retry_backoff_s` are the only knobs and a test can count what happens.
"""

from __future__ import annotations

import errno
import functools
import logging
import time
from collections.abc import Callable
from typing import TypeVar

from forge_core.faults import maybe_fail_storage_call
from forge_core.storage.errors import StorageAccessError, StorageUnavailable

log = logging.getLogger(__name__)
T = TypeVar("T")

# S3 error codes (and the errnos s3fs maps them to) that mean "try again later".
_TRANSIENT_S3_CODES = frozenset(
    {
        "InternalError",
        "ServiceUnavailable",
        "SlowDown",
        "RequestTimeout",
        "Throttling",
        "ThrottlingException",
        "OperationAborted",
        "500",
        "502",
        "503",
        "504",
    }
)
_TRANSIENT_ERRNOS = frozenset({errno.EBUSY, getattr(errno, "EREMOTEIO", errno.EIO), errno.ETIMEDOUT})
_ACCESS_S3_CODES = frozenset(
    {
        "AccessDenied",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "AllAccessDisabled",
        "403",
    }
)


def _exception_chain(exc: BaseException) -> list[BaseException]:
    chain, seen = [], set()
    while exc is not None and id(exc) not in seen:
        chain.append(exc)
        seen.add(id(exc))
        exc = exc.__cause__
    return chain


def _s3_error_code(exc: BaseException) -> str | None:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        return str(response.get("Error", {}).get("Code", "")) or None
    return None


@functools.cache
def _transient_types() -> tuple[type[BaseException], ...]:
    # Imported on first use: a file:// run never pays for loading botocore and aiohttp.
    from aiohttp import ClientConnectionError, ClientPayloadError, ServerTimeoutError
    from botocore.exceptions import ConnectionError as BotoConnectionError
    from botocore.exceptions import HTTPClientError, IncompleteReadError
    from botocore.parsers import ResponseParserError

    return (
        ConnectionError,  # builtin: refused, reset, aborted
        TimeoutError,  # builtin; s3fs maps RequestTimeout to it
        BotoConnectionError,  # EndpointConnectionError, ConnectTimeoutError
        HTTPClientError,  # ConnectionClosedError, ReadTimeoutError
        IncompleteReadError,
        ResponseParserError,  # throttling responses with invalid XML
        ClientConnectionError,
        ClientPayloadError,
        ServerTimeoutError,
    )


def _is_transient_one(exc: BaseException) -> bool:
    if isinstance(exc, _transient_types()):
        return True
    if _s3_error_code(exc) in _TRANSIENT_S3_CODES:
        return True
    return type(exc) is OSError and exc.errno in _TRANSIENT_ERRNOS


def is_transient(exc: BaseException) -> bool:
    """True when `exc` (or what caused it) is a network/throttling/5xx failure worth retrying."""
    return any(_is_transient_one(e) for e in _exception_chain(exc))


def is_access_denied(exc: BaseException) -> bool:
    """True for authorization failures (PermissionError from s3fs, or the raw S3 codes)."""
    return any(
        isinstance(e, PermissionError) or _s3_error_code(e) in _ACCESS_S3_CODES for e in _exception_chain(exc)
    )


class Retrier:
    """Calls a function, retrying transient failures `retries` times with backoff `backoff_s * 2**attempt`.

    Usage: `Retrier(retries=5, backoff_s=0.5).call("put s3://b/k", fs.pipe_file, path, data)`.
    `what` names the operation and URI in logs and errors; it must never contain credentials.
    """

    def __init__(self, retries: int, backoff_s: float, max_sleep_s: float = 30.0) -> None:
        if retries < 0:
            raise ValueError(f"storage.retries={retries}: must be >= 0")
        if backoff_s < 0:
            raise ValueError(f"storage.retry_backoff_s={backoff_s}: must be >= 0")
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_sleep_s = max_sleep_s
        self.retried = 0  # total retries done by this retrier, for logs and tests

    def call(self, what: str, fn: Callable[..., T], *args, **kwargs) -> T:
        for attempt in range(self.retries + 1):
            try:
                maybe_fail_storage_call(what)  # FORGE_FAULT=storage_outage:... (off unless set)
                return fn(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - classified below, re-raised unless transient
                self._raise_unless_retryable(what, exc, attempt)
                delay = min(self.backoff_s * 2**attempt, self.max_sleep_s)
                log.warning(
                    "storage: %s failed (%s: %s); retry %d/%d in %.2fs",
                    what,
                    type(exc).__name__,
                    exc,
                    attempt + 1,
                    self.retries,
                    delay,
                )
                self.retried += 1
                time.sleep(delay)
        raise AssertionError("unreachable: the last attempt either returns or raises")

    def _raise_unless_retryable(self, what: str, exc: Exception, attempt: int) -> None:
        if is_access_denied(exc):
            raise StorageAccessError(
                f"{what}: access denied ({type(exc).__name__}: {exc}); check the AWS credentials "
                "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY/AWS_PROFILE or the instance role) and the bucket policy"
            ) from exc
        if not is_transient(exc):
            raise exc
        if attempt >= self.retries:
            raise StorageUnavailable(
                f"{what}: still failing after {self.retries} retries ({type(exc).__name__}: {exc}); "
                "check that the storage endpoint is reachable, or raise storage.retries"
            ) from exc
