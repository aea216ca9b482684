"""Exceptions raised by forge_core.storage.

Messages name the URI (and the file inside an artifact) but never credentials or storage options: the
store only knows the endpoint, and secrets stay inside botocore's credential chain.
"""

from __future__ import annotations


class StorageError(OSError):
    """Base class of every storage failure."""


class StorageAccessError(StorageError):
    """A non-transient failure that retrying cannot fix: missing bucket, access denied, bad credentials."""


class StorageUnavailable(StorageError):
    """A transient failure (connection lost, throttling, 5xx) that persisted through every retry; the whole
    stage may be retried later (`retryable`)."""

    retryable = True


class ArtifactError(StorageError):
    """Base class of artifact-level failures; `uri` is the artifact's prefix URI."""

    def __init__(self, message: str, uri: str) -> None:
        super().__init__(message)
        self.uri = uri

    def __str__(self) -> str:
        return str(self.args[0])

    def __reduce__(self):
        # OSError pickles as cls(*args); keep `uri` so the error survives a process boundary (Prefect).
        return (type(self), (self.args[0], self.uri))


class ArtifactNotCommitted(ArtifactError):
    """The artifact has no `_MANIFEST.json`: it was never written, or its writer crashed before commit."""


class ArtifactAlreadyCommitted(ArtifactError):
    """A writer was opened on (or tried to commit over) an artifact that is already committed; `attempt` names
    the attempt that owns it (None when not known). Artifacts are content-addressed, so a stage that loses
    the commit race can use the winner's artifact at the same `uri`."""

    def __init__(self, message: str, uri: str, attempt: str | None = None) -> None:
        super().__init__(message, uri)
        self.attempt = attempt

    def __reduce__(self):
        return (type(self), (self.args[0], self.uri, self.attempt))


class ArtifactCorrupted(ArtifactError):
    """A file of a committed artifact is missing, truncated, or does not match its manifest sha256; `file` is
    its path in the artifact ("_MANIFEST.json" when the manifest itself is unreadable)."""

    def __init__(self, message: str, uri: str, file: str) -> None:
        super().__init__(message, uri)
        self.file = file

    def __reduce__(self):
        return (type(self), (self.args[0], self.uri, self.file))


class PointerConflict(StorageError):
    """A compare-and-swap pointer write lost: the pointer moved since the caller read it. `current` is its
    `PointerState` now: re-read, decide again, and retry with its version."""

    def __init__(self, message: str, current) -> None:
        super().__init__(message)
        self.current = current

    def __str__(self) -> str:
        return str(self.args[0])

    def __reduce__(self):
        return (type(self), (self.args[0], self.current))


class LeaseLost(StorageError):
    """The holder of a stage lease found on renewal that another run took the stale lease over; exclusive
    commits keep the artifact whole. `retryable`: a retry finds the other run's commit or waits for its lease."""

    retryable = True
