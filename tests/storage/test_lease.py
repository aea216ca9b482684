"""Stage leases (forge_core.storage.lease) on memory://, file:// and s3:// (moto): one holder at a time, a
stale lease taken over by exactly one of two takers, a holder that lost its lease learns it on renewal.

Staleness is driven by a clock the test advances (acquire_lease's `clock`), and every wait is for an event
(a waiter reporting the holder it sees), so no outcome depends on how fast the machine is.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from forge_core.storage import LeaseLost, acquire_lease
from forge_core.storage.generations import GenerationLog
from forge_core.storage.lease import lease_prefix

WAIT_S = 60  # generous bound on events that take milliseconds
POLL_S = 0.01
TTL_S = 100.0  # only ever reached by advancing the test clock


class Clock:
    """A monotonic clock that moves only when the test says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Contender(threading.Thread):
    """acquire_lease on a thread; `saw` records every holder it reported waiting for."""

    def __init__(
        self,
        store,
        key_uri: str,
        name: str,
        clock: Clock,
        start: threading.Barrier,
        returned: threading.Event,
    ):
        super().__init__(name=f"contender-{name}", daemon=True)
        self.store, self.key_uri, self.holder, self.clock, self.start_together = (
            store,
            key_uri,
            name,
            clock,
            start,
        )
        self.returned = returned  # shared by the contenders of a test: set by whichever returns first
        self.done = threading.Event()  # set by the test: "the key is committed", the waiter may stop
        self.saw: list[str] = []
        self.seen = threading.Condition()
        self.lease = None
        self.error: BaseException | None = None

    def run(self) -> None:
        self.start_together.wait(WAIT_S)
        try:
            self.lease = acquire_lease(
                self.store,
                self.key_uri,
                self.holder,
                self.done.is_set,
                self._on_wait,
                ttl_s=TTL_S,
                renew_s=POLL_S,
                clock=self.clock,
            )
        except BaseException as exc:  # noqa: BLE001 - reported by finish()
            self.error = exc
        self.returned.set()

    def _on_wait(self, record: dict) -> None:
        with self.seen:
            self.saw.append(record["holder"])
            self.seen.notify_all()

    def wait_seeing(self, holder: str) -> None:
        with self.seen:
            assert self.seen.wait_for(lambda: holder in self.saw, WAIT_S), (self.holder, self.saw)

    def finish(self):
        self.join(WAIT_S)
        assert not self.is_alive() and self.error is None, (self.holder, self.error)
        return self.lease


def _gives_up(done=lambda: False):
    """An `is_done` for a call that must not wait: `done()`, or WAIT_S passed (the wait ends, and the test
    fails on the missing lease instead of hanging)."""
    deadline = time.monotonic() + WAIT_S
    return lambda: done() or time.monotonic() > deadline


def _key(store, name: str = "k") -> str:
    return store.artifact_uri("sft", name)


def _contenders(store, clock: Clock, *names: str) -> list[Contender]:
    together, returned = threading.Barrier(len(names)), threading.Event()
    contenders = [Contender(store, _key(store), name, clock, together, returned) for name in names]
    for contender in contenders:
        contender.start()
    return contenders


def _first_returned(contenders: list[Contender]) -> tuple[Contender, Contender]:
    """(the contender that returned first, the other one)."""
    assert contenders[0].returned.wait(WAIT_S), "no contender returned"
    first = next(c for c in contenders if not c.is_alive())
    first.finish()
    return first, next(c for c in contenders if c is not first)


def test_of_two_contenders_exactly_one_holds_the_lease(store):
    # Exactly one returns with the lease; the other reports waiting for that one and keeps waiting.
    holder, waiter = _first_returned(_contenders(store, Clock(), "a", "b"))
    waiter.wait_seeing(holder.holder)
    assert holder.lease is not None and holder.lease.generation == 1
    assert waiter.is_alive() and waiter.lease is None
    waiter.done.set()  # the holder committed: the waiter stops waiting, without the lease
    assert waiter.finish() is None
    assert GenerationLog(store, lease_prefix(store, _key(store))).latest()[1]["holder"] == holder.holder


def test_a_stale_lease_is_taken_over_by_exactly_one_of_two_takers(store):
    clock = Clock()
    crashed = acquire_lease(
        store, _key(store), "crashed", lambda: False, ttl_s=TTL_S, renew_s=POLL_S, clock=clock
    )
    takers = _contenders(store, clock, "t1", "t2")
    for taker in takers:
        taker.wait_seeing("crashed")  # both watch generation 1, never renewed...
    clock.now += TTL_S  # ...for a whole TTL: both find it stale at the same moment
    winner, loser = _first_returned(takers)
    loser.wait_seeing(winner.holder)
    assert winner.lease.generation == 2 and loser.is_alive()
    loser.done.set()
    assert loser.finish() is None

    # The crashed holder, back to life, learns on its next renewal that it lost the lease.
    with pytest.raises(LeaseLost, match=f"{winner.holder} took it over from crashed"):
        crashed.renew()
    assert crashed.lost
    winner.lease.renew()  # the winner still holds it
    assert winner.lease.generation == 3


def test_a_lease_taken_over_while_kept_alive_reports_the_loss_and_is_not_released(store):
    clock = Clock()
    holder = acquire_lease(
        store, _key(store), "holder", lambda: False, ttl_s=TTL_S, renew_s=POLL_S, clock=clock
    )
    # A takeover as the holder meets it: someone else wrote the generation its next renewal writes.
    generations = GenerationLog(store, lease_prefix(store, _key(store)))
    assert generations.append(holder.generation, {"holder": "taker", "state": "held"})
    lost = threading.Event()
    with holder.kept_alive(on_lost=lambda exc: lost.set()):
        assert lost.wait(WAIT_S)
        with pytest.raises(LeaseLost, match="taker took it over from holder"):
            holder.check()
    # Releasing a lost lease writes nothing: the taker's generation stays the newest.
    assert generations.latest() == (2, {"holder": "taker", "state": "held", "generation": 2})


def test_exactly_one_of_two_generation_writers_wins_at_once(store):
    log = GenerationLog(store, store.join(store.root, "_leases", "x"))
    together, results = threading.Barrier(2), {}

    def write(name: str) -> None:
        together.wait(WAIT_S)
        results[name] = log.append(0, {"holder": name})

    threads = [threading.Thread(target=write, args=(name,)) for name in ("p", "q")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT_S)
    assert sorted(results.values()) == [False, True], results
    (winner,) = [name for name, won in results.items() if won]
    assert log.latest() == (1, {"holder": winner, "generation": 1})


def test_a_released_lease_is_free_at_once_and_a_committed_key_leaves_no_lease(store):
    clock = Clock()
    key = _key(store)
    first = acquire_lease(store, key, "first", lambda: False, ttl_s=TTL_S, renew_s=POLL_S, clock=clock)
    first.release()  # ended without committing: the next run computes at once, no TTL to wait out
    committed = _gives_up(lambda: store.is_committed(key))
    second = acquire_lease(store, key, "second", committed, ttl_s=TTL_S, renew_s=POLL_S, clock=clock)
    assert second is not None and second.generation == 3
    store.writer(key, kind="sft", stage="sft").commit(config={}, inputs={}, metrics={})
    second.release()
    assert store.list_files(lease_prefix(store, key)) == {}


def test_a_retry_takes_over_the_lease_its_own_earlier_attempt_left_at_once(store):
    """An attempt that could not release its lease (a storage outage) does not make its own retry wait out
    the TTL: the lease names its owner (the task run), whose attempts run one after the other."""
    clock = Clock()
    key = _key(store)
    acquire_lease(
        store, key, "attempt-1", lambda: False, ttl_s=TTL_S, renew_s=POLL_S, clock=clock, owner="run-7"
    )
    retry = acquire_lease(
        store, key, "attempt-2", _gives_up(), ttl_s=TTL_S, renew_s=POLL_S, clock=clock, owner="run-7"
    )
    assert retry is not None and retry.generation == 2
    (other,) = _contenders(store, clock, "other-run")  # no shared owner: it waits for attempt-2
    other.wait_seeing("attempt-2")
    assert other.is_alive() and other.lease is None
    other.done.set()
    assert other.finish() is None


@pytest.mark.integration  # a holder process of its own
@pytest.mark.parametrize("kind", ["file", "s3"])
def test_a_lease_whose_holder_process_died_on_this_host_is_taken_at_once(kind, request):
    """A flow run killed on this machine leaves its lease held; the next run does not wait out the TTL."""
    store = request.getfixturevalue(f"{kind}_store")
    key = _key(store)
    holder = subprocess.run(
        [sys.executable, "-c", _DIE_HOLDING, store.root, store.endpoint_url or "", key],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert holder.returncode == 3, holder.stderr
    record = GenerationLog(store, lease_prefix(store, key)).latest()[1]
    assert record["holder"] == "killed-run" and record["state"] == "held"

    lease = acquire_lease(store, key, "next-run", _gives_up(), ttl_s=TTL_S, renew_s=POLL_S, clock=Clock())
    assert lease is not None and lease.generation == 2  # taken without the clock moving: no TTL waited out


_DIE_HOLDING = """
import os, sys
from forge_core.storage import ObjectStore, acquire_lease
root, endpoint, key = sys.argv[1:4]
store = ObjectStore(root, endpoint_url=endpoint or None)
acquire_lease(store, key, "killed-run", lambda: False, ttl_s=100.0, renew_s=0.01)
os._exit(3)  # no release, no clean-up: as a SIGKILL would leave it
"""
