"""One retry policy for every storage call: exponential backoff on transient errors, fail fast otherwise.

A transient failure (connection refused or reset, timeouts, throttling, 5xx) is retried with backoff
`storage.retry_backoff_s * 2**n` (at most `STORAGE_RETRY_MAX_SLEEP_S` between tries) until BOTH budgets are
spent: at least `storage.retries` retries, and at least `storage.retry_horizon_s` seconds since the call
first failed. The horizon rides out an S3 brown-out or a restarting MinIO; the count keeps a few quick
retries when the horizon is 0. What still fails raises `StorageUnavailable` (retryable for a stage); access
denied raises `StorageAccessError` at once; anything else is re-raised as it is.

botocore's and s3fs's own retries are off (ObjectStore), so these settings are the only knobs.
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
from forge_core.timings import STORAGE_RETRY_MAX_SLEEP_S

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
        # AWS answers a conditional PUT that raced another write of the key in flight with 409: try again.
        "ConditionalRequestConflict",
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


def is_transient(exc: BaseException, causes: bool = True) -> bool:
    """True when `exc` (or, with `causes`, what caused it) is a network/throttling/5xx failure worth retrying."""
    return any(_is_transient_one(e) for e in (_exception_chain(exc) if causes else [exc]))


def is_access_denied(exc: BaseException) -> bool:
    """True for authorization failures (PermissionError from s3fs, or the raw S3 codes)."""
    return any(
        isinstance(e, PermissionError) or _s3_error_code(e) in _ACCESS_S3_CODES for e in _exception_chain(exc)
    )


def is_already_there(exc: BaseException) -> bool:
    """True when an exclusive create found its target taken: FileExistsError (local link, memory, s3fs's
    mapping of a 412 to `If-None-Match`) or S3's PreconditionFailed/412 itself."""
    return any(
        isinstance(e, FileExistsError) or _s3_error_code(e) in ("PreconditionFailed", "412")
        for e in _exception_chain(exc)
    )




class Retrier:
    """Calls a function under the module's retry policy:
    `Retrier(retries=5, backoff_s=0.5, horizon_s=300).call("put s3://b/k", fs.pipe_file, path, data)`.
    `what` names the operation and URI in logs and errors; it must never contain credentials."""

    def __init__(
        self, retries: int, backoff_s: float, max_sleep_s: float = STORAGE_RETRY_MAX_SLEEP_S, horizon_s: float = 0.0
    ) -> None:
        if retries < 0:
            raise ValueError(f"storage.retries={retries}: must be >= 0")
        if backoff_s < 0:
            raise ValueError(f"storage.retry_backoff_s={backoff_s}: must be >= 0")
        if horizon_s < 0:
            raise ValueError(f"storage.retry_horizon_s={horizon_s}: must be >= 0")
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_sleep_s = max_sleep_s
        self.horizon_s = horizon_s
        self.retried = 0  # total retries done by this retrier, for logs and tests

    @classmethod
    def from_config(cls, storage_cfg) -> Retrier:
        """The policy of a `StorageConfig` (cfg.storage)."""
        return cls(storage_cfg.retries, storage_cfg.retry_backoff_s, horizon_s=storage_cfg.retry_horizon_s)

    def call(self, what: str, fn: Callable[..., T], *args, **kwargs) -> T:
        first_failure: float | None = None
        attempt = 0
        while True:
            try:
                maybe_fail_storage_call(what)  # FORGE_FAULT=storage_outage:... (off unless set)
                return fn(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - classified below, re-raised unless transient
                now = time.monotonic()
                first_failure = now if first_failure is None else first_failure
                self._raise_unless_retryable(what, exc, attempt, now - first_failure)
                delay = min(self.backoff_s * 2**attempt, self.max_sleep_s)
                # "retry 7/5": past the count, retries go on until the horizon has passed.
                log.warning(
                    "storage: %s failed (%s: %s); retry %d/%d in %.2fs (failing for %.1f s; storage.retry_horizon_s=%g)",
                    what,
                    type(exc).__name__,
                    exc,
                    attempt + 1,
                    self.retries,
                    delay,
                    now - first_failure,
                    self.horizon_s,
                )
                self.retried += 1
                attempt += 1
                time.sleep(delay)

    def _raise_unless_retryable(self, what: str, exc: Exception, attempt: int, failing_s: float) -> None:
        if is_access_denied(exc):
            raise StorageAccessError(
                f"{what}: access denied ({type(exc).__name__}: {exc}); check the AWS credentials "
                "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY/AWS_PROFILE or the instance role) and the bucket policy"
            ) from exc
        if not is_transient(exc):
            raise exc
        if attempt >= self.retries and failing_s >= self.horizon_s:
            raise StorageUnavailable(
                f"{what}: still failing after {attempt} retries over {failing_s:.1f} s "
                f"({type(exc).__name__}: {exc}); check that the storage endpoint is reachable, or raise "
                f"storage.retry_horizon_s (now {self.horizon_s:g} s) to wait out longer outages"
            ) from exc
