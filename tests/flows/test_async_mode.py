"""`grpo.mode: async` through the real post-train flow on configs/tiny_test.yaml (Prefect test API, torchrun,
vLLM): rollouts sampled by an older policy while GRPO trains, staleness recorded per row and in the GRPO
manifests and never above grpo.max_staleness; async with max_staleness 0 is sync (the same artifacts).

    .venv/bin/python -m pytest tests/flows/test_async_mode.py -q -p no:cacheprovider            # async S=1
    .venv/bin/python -m pytest tests/flows/test_async_mode.py -q -p no:cacheprovider -m slow    # S=0 == sync
"""

from __future__ import annotations

import pytest

from forge_core.config import load_config
from forge_core.storage import ObjectStore

pytestmark = pytest.mark.integration

CONFIG = "configs/tiny_test.yaml"
ITERATIONS = 2
# The 4-step tiny SFT policy rarely solves a prompt, so its iterations may carry no learning signal; that must
# not stop these flows (grpo.max_no_signal_iterations, not part of any key).
# The default lifetimes (one engine set and one trainer group for the flow, on the test run's Ray cluster): the
# async schedule is the flow's, whichever lifetime; the stage lifetime's engines and launches run sync elsewhere.
RUN_ALL = [
    f"grpo.iterations={ITERATIONS}", "grpo.max_no_signal_iterations=0",
    "rollout.engine_lifetime=flow", "grpo.trainer_lifetime=flow",
]  # fmt: skip
ASYNC_1 = [*RUN_ALL, "grpo.mode=async", "grpo.max_staleness=1", "grpo.correction.type=tis"]
ASYNC_0 = [*RUN_ALL, "grpo.mode=async", "grpo.max_staleness=0"]
SYNC = [*RUN_ALL, "grpo.mode=sync"]


def _post_train(overrides: list[str]) -> tuple[dict, ObjectStore]:
    from flows.post_train import post_train

    summary = post_train(CONFIG, overrides)
    return summary, ObjectStore.from_config(load_config(CONFIG, overrides).storage)


def _row_staleness(store: ObjectStore, rollouts_uri: str) -> list[int]:
    table = store.reader(rollouts_uri).read_table("rollouts.parquet", columns=["iteration", "policy_iteration"])
    return [i - p for i, p in zip(table.column("iteration").to_pylist(), table.column("policy_iteration").to_pylist())]


def _stage_uris(summary: dict) -> dict[str, str]:
    return {row["stage"]: row["artifact"] for row in summary["stages"]}


@pytest.mark.timeout(1800)
def test_async_staleness_one_samples_from_the_previous_policy_within_the_bound(prefect_api, tiny_overrides):
    summary, store = _post_train([*tiny_overrides, *ASYNC_1])
    uris = _stage_uris(summary)

    labels = [row["stage"] for row in summary["stages"]]
    assert labels == ["prepare", "sft", "eval-sft", "rollout-1", "grpo-1", "eval-grpo-1",
                      "rollout-2", "grpo-2", "eval-grpo-2"]
    # Both rollouts came from the SFT policy (policy 0): rollout-2 did not wait for grpo-1.
    for n in (1, 2):
        assert store.read_manifest(uris[f"rollout-{n}"]).inputs["policy"].uri == summary["sft_uri"]
        assert store.read_manifest(uris[f"rollout-{n}"]).metrics["policy_iteration"] == 0
    assert store.read_manifest(uris["grpo-2"]).inputs["policy"].uri == uris["grpo-1"]
    assert store.read_manifest(uris["grpo-2"]).inputs["rollouts"].uri == uris["rollout-2"]

    staleness = [_row_staleness(store, uris[f"rollout-{n}"]) for n in (1, 2)]
    assert set(staleness[0]) == {0}
    assert set(staleness[1]) == {1}, "iteration 1 trains policy 1 on rows sampled by policy 0"
    assert max(max(s) for s in staleness) <= 1
    for n, expected in ((1, 0.0), (2, 1.0)):
        metrics = store.read_manifest(uris[f"grpo-{n}"]).metrics
        assert metrics["rollout/staleness_mean"] == expected and metrics["rollout/staleness_max"] == expected
        assert metrics["train/steps"] + metrics["train/skipped_steps"] >= 1


# Slow (two flows; about 1 min on a loaded 2-core box): tests/trainers/test_staleness.py
# checks the same equivalence without stages (identical schedule, identical GRPO keys).
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_async_with_staleness_zero_commits_what_sync_commits(prefect_api, tiny_overrides):
    """Same code path: async S=0 plans every stage exactly as sync does, so a sync run after it finds each of
    its artifacts committed (same URIs) and commits nothing new."""
    async_0, store = _post_train([*tiny_overrides, *ASYNC_0])
    committed = {kind: set(store.list_committed(kind)) for kind in ("rollouts", "grpo", "eval")}

    sync, _ = _post_train([*tiny_overrides, *SYNC])

    assert _stage_uris(sync) == _stage_uris(async_0)
    assert sync["rollouts"] == async_0["rollouts"] and sync["final_policy_uri"] == async_0["final_policy_uri"]
    assert {kind: set(store.list_committed(kind)) for kind in committed} == committed
    for n, rollouts_uri in enumerate(async_0["rollouts"]):
        assert set(_row_staleness(store, rollouts_uri)) == {0}
        manifest = store.read_manifest(rollouts_uri)
        assert manifest.metrics["iteration"] == manifest.metrics["policy_iteration"] == n
