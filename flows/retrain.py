"""Scheduled retraining: start from the promoted policy, train on fresh data, promote only if it is better.

    python -m flows.retrain configs/demo_cpu.yaml data.demo.num_rl=40000
    prefect deployment run 'retrain/nightly-demo'        # the cron schedule in prefect.yaml (inactive by default)

The promoted policy is a pointer object on the store (`_pointers/promoted-<run name>.json`), replaced in one
atomic put. With no promoted policy yet, the flow runs SFT first and promotes the result of the whole run.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from prefect import flow, get_run_logger

from flows.post_train import end_orphaned_launches, flow_engines, kill_launches, stage_tasks
from forge_core.config import config_to_json, load_config
from forge_core.launch import install_sigterm_handler
from forge_core.storage import ObjectStore


@dataclass
class RetrainOutcome:
    candidate_policy_uri: str
    candidate_accuracy: float
    incumbent_policy_uri: str | None
    incumbent_accuracy: float | None
    promoted: bool


def promotion_pointer(run_name: str) -> str:
    return f"promoted-{run_name}"


def _accuracy(store: ObjectStore, eval_uri: str) -> float:
    return float(store.read_manifest(eval_uri).metrics["accuracy"])


@flow(name="retrain", on_cancellation=[kill_launches], on_crashed=[kill_launches], log_prints=True)
def retrain(config: str = "configs/demo_cpu.yaml", overrides: list[str] | None = None) -> dict:
    """GRPO from the promoted policy on freshly prepared data; promote if held-out accuracy improves."""
    cfg = load_config(config, list(overrides or []))
    install_sigterm_handler()
    end_orphaned_launches()
    with flow_engines(cfg):
        return _retrain(cfg)


def _retrain(cfg) -> dict:
    logger = get_run_logger()
    store = ObjectStore.from_config(cfg.storage)
    config_json = config_to_json(cfg)
    pointer = promotion_pointer(cfg.name)
    t = stage_tasks(cfg)

    data_uri = t.prepare(config_json)
    incumbent = store.pointer_read(pointer)
    start_policy = incumbent or t.sft(config_json, data_uri)
    # Both policies are scored on the same, current held-out split.
    incumbent_accuracy = _accuracy(store, t.evaluate(config_json, incumbent, data_uri)) if incumbent else None

    policy_uri = start_policy
    for iteration in range(cfg.grpo.iterations):
        rollouts_uri = t.rollout(config_json, policy_uri, data_uri, iteration)
        policy_uri = t.grpo(config_json, policy_uri, rollouts_uri, iteration)
    candidate_accuracy = _accuracy(store, t.evaluate(config_json, policy_uri, data_uri))

    promoted = incumbent_accuracy is None or candidate_accuracy > incumbent_accuracy
    if promoted:
        store.pointer_write(pointer, policy_uri)
        logger.info("promoted %s (accuracy %.3f, was %s)", policy_uri, candidate_accuracy, incumbent_accuracy)
    else:
        logger.info(
            "kept %s: candidate %.3f <= incumbent %.3f", incumbent, candidate_accuracy, incumbent_accuracy
        )
    return RetrainOutcome(policy_uri, candidate_accuracy, incumbent, incumbent_accuracy, promoted).__dict__


if __name__ == "__main__":
    retrain(sys.argv[1] if len(sys.argv) > 1 else "configs/demo_cpu.yaml", sys.argv[2:])
