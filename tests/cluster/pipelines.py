"""A short pipeline for the placement tests: data prep, then SFT, with post-train's start, resources and hooks.

Deployed by tests/cluster/cluster.py as `cluster-sft/cluster` (the workers import it through PYTHONPATH).
"""

from __future__ import annotations

from prefect import flow

from flows.post_train import flow_resources, kill_launches, stage_tasks, start_flow


@flow(name="cluster-sft", on_cancellation=[kill_launches], on_crashed=[kill_launches])
def prepare_and_sft(config: str, overrides: list[str] | None = None) -> dict:
    """prepare -> sft on the config's pools; returns both artifact URIs."""
    cfg = start_flow(config, overrides)
    with flow_resources(cfg):
        tasks = stage_tasks(cfg)
        data_uri = tasks.prepare(cfg)
        return {"data": data_uri, "sft": tasks.sft(cfg, data_uri)}
