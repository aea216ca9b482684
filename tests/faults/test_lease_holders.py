"""A lease holder on this host name but in another PID namespace (a container, a hostNetwork pod) is alive as
far as anyone here can tell: its pid means nothing in this namespace, so only the TTL may free its lease."""

from __future__ import annotations

import socket
import time

import pytest

from forge_core.storage.lease import HELD, GenerationLog, acquire_lease, lease_prefix


class Waited(Exception):
    """Raised from on_wait: the taker saw a live holder and would wait for it."""


def _foreign_record(pid_namespace: str) -> dict:
    return {
        "holder": "attempt-in-a-pod", "owner": "flow-run-in-a-pod", "state": HELD, "host": socket.gethostname(),
        "process": "0" * 32, "pid_namespace": pid_namespace, "pid": 4_000_000, "pid_started": time.time(),
        "ttl_s": 600.0, "written_at": "2026-12-04T00:00:00+00:00",
    }  # fmt: skip


@pytest.mark.fault(
    fault="a live lease holder with this host name and a pid that is no process here (another PID namespace: "
    "a hostNetwork pod)",
    where="forge_core.storage.lease.acquire_lease (every stage task)",
    checked="the taker waits for the holder (the TTL decides) instead of taking the lease over at once; a dead "
    "holder of this very namespace is still taken over at once",
)
def test_a_holder_in_another_pid_namespace_is_not_taken_over(file_store, fault_row):
    from forge_core.storage.lease import _PID_NAMESPACE

    def wait_is_seen(record: dict) -> None:
        raise Waited(record["holder"])

    key = file_store.artifact_uri("sft", "k-pod")
    GenerationLog(file_store, lease_prefix(file_store, key)).append(0, _foreign_record("another-boot:4026531836"))
    with pytest.raises(Waited, match="attempt-in-a-pod"):
        acquire_lease(file_store, key, "attempt-here", is_done=lambda: False, on_wait=wait_is_seen, ttl_s=600)

    here = file_store.artifact_uri("sft", "k-here")
    GenerationLog(file_store, lease_prefix(file_store, here)).append(0, _foreign_record(_PID_NAMESPACE))
    lease = acquire_lease(file_store, here, "attempt-here", is_done=lambda: False, on_wait=wait_is_seen, ttl_s=600)
    assert lease is not None and lease.holder == "attempt-here"
    lease.release()
    fault_row.fact("foreign namespace: waited; this namespace, no such pid: taken at once")
