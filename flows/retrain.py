"""Scheduled retraining: start from the promoted policy, train on fresh data, promote only if it is better.

    python -m flows.retrain configs/demo_cpu.yaml data.demo.num_rl=40000
    prefect deployment run 'retrain/nightly-demo'        # the cron schedule in prefect.yaml (inactive by default)

The promoted policy is a compare-and-swap pointer on the store, keyed by the run name and a hash of the
model, data and eval sections (`promotion_pointer`), so runs of another setup never compete. With no promoted
policy yet, the flow runs SFT first. Promotion is safe against overlapping runs (flows.promotion). The
incumbent must use the fresh data's tokenizer; start another run name when the tokenizer changes.
"""


from __future__ import annotations

import sys
from dataclasses import dataclass

from prefect import flow, get_run_logger

from flows.post_train import flow_resources, kill_launches, start_flow
from flows.promotion import check_same_tokenizer, promote_if_better, promotion_pointer
from forge_core.credentials import hide_credentials_in_overrides
from forge_core.storage import ObjectStore
from tasks import run_as_task


@dataclass
class RetrainOutcome:
    candidate_policy_uri: str
    candidate_accuracy: float
    incumbent_policy_uri: str | None
    incumbent_accuracy: float | None
    promoted: bool


def _accuracy(store: ObjectStore, eval_uri: str) -> float:
    return float(store.read_manifest(eval_uri).metrics["accuracy"])


@flow(name="retrain", on_cancellation=[kill_launches], on_crashed=[kill_launches], log_prints=True)
def retrain(config: str = "configs/demo_cpu.yaml", overrides: list[str] | None = None) -> dict:
    """GRPO from the promoted policy on freshly prepared data; promote if held-out accuracy improves."""
    cfg = start_flow(config, overrides)
    with flow_resources(cfg):
        return _retrain(cfg)


def _retrain(cfg) -> dict:
    logger = get_run_logger()
    store = ObjectStore.from_config(cfg.storage)
    pointer = promotion_pointer(cfg)
    data_uri = run_as_task(cfg, "prepare", {})

    def evaluate(policy_uri: str) -> str:
        return run_as_task(cfg, "evaluate", {"policy": policy_uri, "data": data_uri})

    def accuracy_of(policy_uri: str) -> float:
        """An incumbent's held-out accuracy on this run's data (same tokenizer required)."""
        check_same_tokenizer(store, policy_uri, data_uri)
        return _accuracy(store, evaluate(policy_uri))

    incumbent = store.pointer_state(pointer)
    # Both policies are scored on the same, current held-out split.
    incumbent_accuracy = accuracy_of(incumbent.uri) if incumbent.uri else None
    policy_uri = incumbent.uri or run_as_task(cfg, "sft", {"data": data_uri})
    for iteration in range(cfg.grpo.iterations):
        on_policy = {"iteration": iteration, "policy_iteration": iteration}
        rollouts_uri = run_as_task(cfg, "rollout", {"policy": policy_uri, "data": data_uri}, on_policy)
        policy_uri = run_as_task(cfg, "grpo", {"policy": policy_uri, "rollouts": rollouts_uri}, {"iteration": iteration})
    candidate_accuracy = _accuracy(store, evaluate(policy_uri))

    decision = promote_if_better(
        store, pointer, policy_uri, candidate_accuracy, incumbent, incumbent_accuracy, accuracy_of
    )
    if decision.promoted:
        logger.info(
            "promoted %s (accuracy %.3f, was %s) as %s version %d",
            policy_uri,
            candidate_accuracy,
            decision.incumbent_accuracy,
            pointer,
            decision.pointer.version,
        )
    else:
        logger.info(
            "kept %s: candidate %.3f <= incumbent %.3f",
            decision.incumbent_uri,
            candidate_accuracy,
            decision.incumbent_accuracy,
        )
    return RetrainOutcome(
        policy_uri, candidate_accuracy, decision.incumbent_uri, decision.incumbent_accuracy, decision.promoted
    ).__dict__


if __name__ == "__main__":
    # Prefect records the flow's parameters: a tokenised URL in an override goes in redacted.
    overrides = hide_credentials_in_overrides(sys.argv[2:])
    retrain(sys.argv[1] if len(sys.argv) > 1 else "configs/demo_cpu.yaml", overrides)
