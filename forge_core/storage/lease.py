"""Leases on artifact keys, so that two runs of one config do not both compute the same stage.

    lease = acquire_lease(store, output_uri, holder=attempt_id, is_done=lambda: store.is_committed(output_uri))
    if lease is None:                      # the holder committed while we waited: use its artifact
        return output_uri
    with lease.kept_alive(on_lost=stop_the_work):
        ...compute and commit...           # renewed every storage.lease_renew_s on a background thread
        lease.check()                      # LeaseLost (retryable) if another run took it over meanwhile

A lease is a GenerationLog at `<root>/_leases/<kind>/<key>/`: every acquisition, renewal and release creates
the next generation exclusively, so of two runs that both try to move the lease on from generation n exactly
one wins (a holder that lost to a taker learns so on its next renewal).

Staleness is judged without trusting clocks across machines: a waiter takes a lease over when it has seen
the same generation for `storage.lease_ttl_s` of its own monotonic clock (the holder renews every
`storage.lease_renew_s`, well inside the TTL). A lease is free at once when released (its holder ended
without committing) or when its holder is known to be gone: an earlier attempt of the same `owner` (attempts
of one task run are sequential, so it has ended even if it could not release), or a process of this host,
PID namespace and boot that no longer runs (matched by pid and start time). After the key is committed its
lease objects are deleted.

The lease only avoids duplicate work; correctness never depends on its timing: exclusive manifest creation
(ArtifactWriter.commit) keeps an artifact whole even when two runs compute it at once.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

from forge_core.storage.errors import LeaseLost
from forge_core.storage.generations import GenerationLog
from forge_core.storage.manifest import utc_now_iso

log = logging.getLogger(__name__)

LEASES_DIR = "_leases"
HELD = "held"
RELEASED = "released"


def lease_prefix(store, key_uri: str) -> str:
    """`<root>/_leases/<key_uri relative to the root>`: leases live outside the artifact prefix."""
    key_uri = key_uri.rstrip("/")
    if not key_uri.startswith(store.root + "/"):
        raise ValueError(f"lease key {key_uri}: not under this store's root {store.root}")
    return store.join(store.root, LEASES_DIR, key_uri[len(store.root) + 1 :])


class Lease:
    """A held lease on one key: `renew()`, `release()`, `kept_alive()`, `check()`. Returned by acquire_lease."""

    def __init__(
        self,
        generations: GenerationLog,
        key_uri: str,
        holder: str,
        generation: int,
        ttl_s: float,
        renew_s: float,
        is_done: Callable[[], bool],
        owner: str | None = None,
    ) -> None:
        self._log = generations
        self.key_uri = key_uri
        self.holder = holder
        self.owner = owner
        self.generation = generation
        self.ttl_s = ttl_s
        self.renew_s = renew_s
        self._is_done = is_done
        self._lost: LeaseLost | None = None
        self._stop = threading.Event()

    @property
    def lost(self) -> bool:
        return self._lost is not None

    def record(self, state: str) -> dict:
        return {
            "holder": self.holder,
            "owner": self.owner,
            "state": state,
            "host": socket.gethostname(),
            "process": _PROCESS_ID,
            "pid_namespace": _PID_NAMESPACE,
            "pid": os.getpid(),
            "pid_started": _PROCESS_STARTED,
            "ttl_s": self.ttl_s,
            "written_at": utc_now_iso(),
        }

    def renew(self) -> None:
        """Move the lease on by one generation; LeaseLost when another run wrote that generation first."""
        if self._log.append(self.generation, self.record(HELD)):
            self.generation += 1
            return
        _, current = self._log.latest()
        taker = (current or {}).get("holder", "someone else")
        self._lost = LeaseLost(
            f"lease on {self.key_uri}: {taker} took it over from {self.holder} (it was not renewed within "
            f"storage.lease_ttl_s={self.ttl_s:g} s); this run stops, a retry finds that run's commit"
        )
        raise self._lost

    def check(self) -> None:
        """Raise LeaseLost when a renewal found the lease taken over."""
        if self._lost is not None:
            raise self._lost

    def release(self) -> None:
        """Give the lease up: delete it when the key is committed, else mark it released (free at once).
        Never raises: a lease that cannot be released goes stale by itself after `ttl_s`."""
        try:
            if self._is_done():
                self._log.purge()
            elif not self.lost:
                self._log.append(self.generation, self.record(RELEASED))
        except Exception as exc:  # noqa: BLE001 - releasing is best effort, see the docstring
            log.warning(
                "lease on %s: could not release it (%s); it goes stale after %g s",
                self.key_uri,
                exc,
                self.ttl_s,
            )

    @contextmanager
    def kept_alive(self, on_lost: Callable[[LeaseLost], None] = lambda exc: None) -> Iterator[Lease]:
        """Renew on a background thread while the block runs (calling `on_lost` if it is taken over), then
        release."""
        keeper = threading.Thread(target=self._keep, args=(on_lost,), name="forge-lease-keeper", daemon=True)
        keeper.start()
        try:
            yield self
        finally:
            self._stop.set()
            keeper.join()
            self.release()

    def _keep(self, on_lost: Callable[[LeaseLost], None]) -> None:
        while not self._stop.wait(self.renew_s):
            try:
                self.renew()
            except LeaseLost as exc:
                log.warning("%s", exc)
                on_lost(exc)
                return
            except Exception as exc:  # noqa: BLE001 - a storage outage: keep trying, the TTL decides
                log.warning(
                    "lease on %s: renewal failed (%s); trying again in %g s", self.key_uri, exc, self.renew_s
                )


_PROCESS_STARTED = psutil.Process().create_time()
# Who holds a lease, for people and logs: random per process, unlike a host name and pid.
_PROCESS_ID = uuid.uuid4().hex


def _pid_namespace() -> str:
    """This process's PID namespace and boot (a pid means a process only within both), "" when unknown."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return ""


_PID_NAMESPACE = _pid_namespace()


def _holder_gone(record: dict, owner: str | None) -> bool:
    """Whether the holder is known to have ended: an earlier attempt of `owner`, or a process of this host, PID
    namespace and boot that no longer runs (a reused pid does not count). A holder in another PID namespace
    under this host name cannot be seen from here: only the TTL decides."""
    if owner is not None and record.get("owner") == owner:
        return True
    if record.get("host") != socket.gethostname() or not isinstance(record.get("pid"), int):
        return False
    if not _PID_NAMESPACE or record.get("pid_namespace") != _PID_NAMESPACE:
        return False
    try:
        holder = psutil.Process(record["pid"])
        return (
            holder.status() == psutil.STATUS_ZOMBIE
            or abs(holder.create_time() - record.get("pid_started", 0)) > 1
        )
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False  # cannot tell (e.g. access denied): the TTL decides


def acquire_lease(
    store,
    key_uri: str,
    holder: str,
    is_done: Callable[[], bool],
    on_wait: Callable[[dict], None] = lambda record: None,
    ttl_s: float | None = None,
    renew_s: float | None = None,
    clock: Callable[[], float] = time.monotonic,
    owner: str | None = None,
) -> Lease | None:
    """Take the lease on `key_uri` for `holder`, waiting (polling every `renew_s`) while a live holder has it.

    Returns the held Lease, or None as soon as `is_done()` (e.g. "the key is committed") becomes true while
    waiting. `on_wait(record)` is called whenever a new holder is seen. `ttl_s` and `renew_s` default to the
    store's `lease_ttl_s` / `lease_renew_s`. `owner` names what the holder's attempts belong to: a lease held
    by an earlier attempt of the same owner is taken at once.
    """
    ttl_s = store.lease_ttl_s if ttl_s is None else ttl_s
    renew_s = store.lease_renew_s if renew_s is None else renew_s
    generations = GenerationLog(store, lease_prefix(store, key_uri))
    claim = Lease(generations, key_uri.rstrip("/"), holder, 0, ttl_s, renew_s, is_done, owner)
    seen_generation, seen_since, seen_holder = None, 0.0, None
    while True:
        generation, record = generations.latest()
        free = record is None or record.get("state") == RELEASED or _holder_gone(record, owner)
        if not free and generation != seen_generation:
            seen_generation, seen_since = generation, clock()
            if record.get("holder") != seen_holder:
                seen_holder = record.get("holder")
                on_wait(record)
        elif not free and clock() - seen_since >= ttl_s:
            log.warning(
                "lease on %s: %s has not renewed it for %g s (generation %d); taking it over",
                key_uri,
                record.get("holder"),
                ttl_s,
                generation,
            )
            free = True
        if free:
            if generations.append(generation, claim.record(HELD)):
                claim.generation = generation + 1
                return claim
            continue  # another run moved the lease on first: look again
        if is_done():
            return None
        time.sleep(renew_s)
