"""Short pipelines for the placement tests, with post-train's start, resources and hooks.

Deployed by tests/cluster/cluster.py (the workers import this module through PYTHONPATH):
`cluster-sft/cluster` (prepare_and_sft) and `cluster-held/cluster` (one_iteration_held).
"""

from __future__ import annotations

import time

from prefect import flow

from flows.post_train import flow_resources, kill_launches, stage_tasks, start_flow
from forge_core.storage import ObjectStore

HOLD_S = 900.0  # one_iteration_held waits at most this long for its release object


@flow(name="cluster-sft", on_cancellation=[kill_launches], on_crashed=[kill_launches])
def prepare_and_sft(config: str, overrides: list[str] | None = None) -> dict:
    """prepare -> sft on the config's pools; returns both artifact URIs."""
    cfg = start_flow(config, overrides)
    with flow_resources(cfg):
        tasks = stage_tasks(cfg)
        data_uri = tasks.prepare(cfg)
        return {"data": data_uri, "sft": tasks.sft(cfg, data_uri)}


@flow(name="cluster-held", on_cancellation=[kill_launches], on_crashed=[kill_launches])
def one_iteration_held(
    config: str, overrides: list[str] | None = None, release_uri: str = "", resume_uri: str = ""
) -> dict:
    """prepare -> sft -> rollout -> grpo -> evaluate on the config's pools; then, before the run's long-lived
    processes end with its resources, it waits for the object `release_uri`, so that a test can look at them
    while they are sure to live. With `resume_uri` it also waits for that object before the evaluate stage (a
    test acts between two stages). Each wait lasts at most HOLD_S."""
    cfg = start_flow(config, overrides)
    store = ObjectStore.from_config(cfg.storage)
    with flow_resources(cfg):
        tasks = stage_tasks(cfg)
        data = tasks.prepare(cfg)
        sft = tasks.sft(cfg, data)
        rollouts = tasks.rollout(cfg, sft, data, 1)
        grpo = tasks.grpo(cfg, sft, rollouts, 1)
        _wait_for_object(store, resume_uri)
        evaluation = tasks.evaluate(cfg, grpo, data)
        _wait_for_object(store, release_uri)
    return {"data": data, "sft": sft, "rollouts": rollouts, "grpo": grpo, "eval": evaluation}


def _wait_for_object(store: ObjectStore, uri: str) -> None:
    held_until = time.monotonic() + HOLD_S
    while uri and not store.exists(uri) and time.monotonic() < held_until:
        time.sleep(0.5)
