"""Crashed attempts' files are swept when a flow starts: before, nothing called the sweep and killed writers'
files stayed forever (12 killed writers left 597 MB)."""

from __future__ import annotations

import pytest
from fault_kit import TINY_CONFIG
from prefect import flow

from flows.post_train import start_flow
from forge_core.storage import ObjectStore

pytestmark = pytest.mark.integration

OLD, YOUNG = "20200101T000000Z-0ld0ld0ld0ld", "29990101T000000Z-y0ungy0ungy0"


@flow(name="faults-flow-start")
def only_start(config: str, overrides: list[str]) -> str:
    return start_flow(config, overrides).name


@pytest.mark.fault(
    fault="files of a crashed attempt from 2020 and of an attempt that may still be writing, next to nothing "
    "committed",
    where="every flow's start (flows.post_train.start_flow -> ObjectStore.sweep_stale_attempts, bounded)",
    checked="the old attempt's files are deleted at the flow's start; the young attempt's stay",
)
def test_a_flow_start_sweeps_old_crashed_attempts_and_leaves_young_ones(prefect_api, tmp_path, fault_row):
    overrides = [f"storage.root=file://{tmp_path}/store", f"logging.dir={tmp_path}/runs"]
    store = ObjectStore(f"file://{tmp_path}/store")
    artifact = store.artifact_uri("sft", "crashed-key")
    for attempt in (OLD, YOUNG):
        store.put_bytes(store.join(store.files_uri(artifact, attempt), "shard.bin"), b"x" * 1024)
    only_start(TINY_CONFIG, overrides)
    left = sorted(uri.rsplit("/_attempts/", 1)[1].split("/")[0] for uri in store.list_files(artifact))
    assert left == [YOUNG], left
    fault_row.fact("1 old attempt deleted, 1 young kept")
