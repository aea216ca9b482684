"""`make demo` (flows.demo) through the real post-train flow on configs/demo_cpu.yaml (the shipped defaults: the
flow lifetimes of the engine and the trainer).

The reduced run keeps the demo's config (task, model, 2 torchrun ranks, vLLM), shrinks the budgets and adds
per-digit credit to the reward (see REDUCED): it checks every stage's committed manifest, a real GRPO
update, the printed report and the rollout query of docs/storage-layout.md.
The full demo (slow marker) checks the demo's learning target: GRPO adds >= 10 points of held-out accuracy.

    .venv/bin/python -m pytest tests/flows/test_demo.py -q -m "not slow"     # reduced, ~3 min
    .venv/bin/python -m pytest tests/flows/test_demo.py -q -m slow           # the full demo, seeds 0-4, ~50 min
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

from forge_core.config import load_config
from forge_core.storage import ObjectStore

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
DEMO_CONFIG = REPO / "configs" / "demo_cpu.yaml"
# One GRPO iteration covers every stage kind; each stage costs ~25 s of process and engine start-up on an idle
# 2-core machine whatever its budget, so more iterations would mostly add start-up time.
ITERATIONS = 1
# Budgets: 64 rollouts per iteration (2 optimizer steps of 32), 20 SFT steps, 64 held-out prompts.
# After 20 SFT steps the policy writes `<answer>..</answer>` but no sum exactly, so the demo's exact-match
# reward alone is 0 for every sample and GRPO would skip every step. Per-digit partial credit, added as a
# second component (exact match stays the primary one: accuracy and the docs' query use it), differs
# within a group, so the reduced GRPO stage really updates the policy.
PER_DIGIT_REWARD = (
    'rollout.rewards=[{"name": "exact_answer", "weight": 1.0}, {"name": "per_digit", "weight": 0.5}]'
)
REDUCED = [
    "data.demo.num_sft=256",
    "data.demo.num_rl=512",
    "data.demo.num_eval=64",
    "sft.steps=20",
    "sft.batch_size=32",
    "sft.micro_batch_size=16",
    "sft.eval_every=10",
    "sft.eval_rows=16",
    "sft.checkpoint_every=10",
    "rollout.prompts_per_iteration=16",
    "rollout.sampling.group_size=4",
    PER_DIGIT_REWARD,
    f"grpo.iterations={ITERATIONS}",
    "grpo.epochs=1",
    "grpo.mini_batch_size=32",
    "grpo.micro_batch_size=16",
    "eval.num_prompts=64",
    *(f"launch.{stage}.retries=0" for stage in ("prepare", "sft", "rollout", "grpo", "evaluate")),
]
STAGE_KINDS = {"prepare": "data", "sft": "sft", "eval": "eval", "rollout": "rollouts", "grpo": "grpo"}


def _expected_labels(iterations: int) -> list[str]:
    labels = ["prepare", "sft", "eval-sft"]
    for n in range(1, iterations + 1):
        labels += [f"rollout-{n}", f"grpo-{n}", f"eval-grpo-{n}"]
    return labels


def _run_demo(overrides: list[str]) -> tuple[dict, str]:
    from flows.demo import run_demo

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        summary = run_demo(overrides)
    return summary, out.getvalue()


def _docs_query_example() -> str:
    """The python block after `<!-- example: query-rollouts -->` in docs/storage-layout.md."""
    text = (REPO / "docs" / "storage-layout.md").read_text()
    match = re.search(r"<!-- example: query-rollouts -->\s*```python\n(.*?)```", text, re.DOTALL)
    assert match, "docs/storage-layout.md lost its query-rollouts example"
    return match.group(1)


# Loaded CI machines stretch every stage's start-up; the 900 s default leaves too little headroom.
@pytest.mark.timeout(1800)
def test_demo_at_reduced_budgets_commits_every_stage_and_reports(prefect_api, tmp_path):
    overrides = [*REDUCED, f"storage.root=file://{tmp_path}/store", f"logging.dir={tmp_path}/runs"]
    cfg = load_config(DEMO_CONFIG, overrides)
    store = ObjectStore.from_config(cfg.storage)

    summary, printed = _run_demo(overrides)

    rows = summary["stages"]
    assert [row["stage"] for row in rows] == _expected_labels(ITERATIONS)
    manifests = {row["stage"]: store.read_manifest(row["artifact"]) for row in rows}  # raises if uncommitted
    for label, manifest in manifests.items():
        assert manifest.kind == STAGE_KINDS[label.split("-")[0]], label
    # Nothing else was committed: one artifact per stage run, no stray outputs of failed attempts.
    runs_per_kind = {"data": 1, "sft": 1, "eval": 1 + ITERATIONS, "rollouts": ITERATIONS, "grpo": ITERATIONS}
    for kind, count in runs_per_kind.items():
        assert len(store.list_committed(kind)) == count, kind
    # Every key metric was found under the name the stage worker writes.
    for row in rows:
        assert row["key metric"] and "n/a" not in row["key metric"], row
        assert row["duration_s"] > 0, row
    # The demo runs on the shipped default, the fast path: one engine for the whole run (eval-sft starts it,
    # later stages load their policy into it in place) and one GRPO trainer group.
    assert (cfg.rollout.engine_lifetime, cfg.grpo.trainer_lifetime) == ("flow", "flow")
    assert manifests["eval-sft"].metrics["engine_startup_s"] > 0
    for label in ("rollout-1", "eval-grpo-1"):
        assert manifests[label].metrics["engine_lifetime"] == "flow", label
        assert manifests[label].metrics["engine_startup_s"] == 0.0, label  # reloaded, not started again
    # Where each stage's time went: the rollout's sampling, GRPO's steps, in the manifest and the table's column.
    by_label = {row["stage"]: row for row in rows}
    for label, phase in (("rollout-1", "sample"), ("grpo-1", "steps")):
        assert manifests[label].metrics[f"phase/{phase}_s"] > 0, label
        assert f"{phase} " in by_label[label]["phases"], by_label[label]
    assert {"phase/load_s", "phase/score_s", "phase/export_s"} <= set(manifests["grpo-1"].metrics)
    assert manifests["prepare"].metrics["rows"]["sft"] == cfg.data.demo.num_sft
    assert manifests["sft"].metrics["steps"] == cfg.sft.steps
    # Validation-driven SFT: a validation every sft.eval_every steps, the selected step and why in the manifest
    # and in the stage table.
    sft = manifests["sft"].metrics
    assert [point["step"] for point in sft["validation"]] == list(range(10, cfg.sft.steps + 1, 10))
    assert sft["selected_by"] == "best" and sft["selected_step"] in (10, 20), sft
    assert f"step {sft['selected_step']}/{cfg.sft.steps} (best)" in rows[1]["key metric"], rows[1]
    samples = cfg.rollout.prompts_per_iteration * cfg.rollout.sampling.group_size
    steps_per_iteration = cfg.grpo.epochs * samples // cfg.grpo.mini_batch_size
    for n in range(1, ITERATIONS + 1):
        assert manifests[f"rollout-{n}"].metrics["samples"] == samples
        grpo = manifests[f"grpo-{n}"].metrics
        assert grpo["train/steps"] + grpo["train/skipped_steps"] == steps_per_iteration
        assert grpo["train/steps"] >= 1, grpo  # the policy was updated, not passed through
        assert grpo["policy_uri"] == store.join(
            rows[_expected_labels(ITERATIONS).index(f"grpo-{n}")]["artifact"], "policy"
        )
    for label in ["eval-sft", *(f"eval-grpo-{n}" for n in range(1, ITERATIONS + 1))]:
        assert manifests[label].metrics["n"] == cfg.eval.num_prompts
    # Lineage: the rollouts were sampled by the SFT policy, GRPO trained on them, eval scored its policy.
    assert manifests["rollout-1"].inputs["policy"].uri == summary["sft_uri"]
    assert manifests["grpo-1"].inputs["rollouts"].uri == rows[3]["artifact"]
    assert manifests["eval-grpo-1"].inputs["policy"].uri == rows[4]["artifact"]
    assert summary["final_policy_uri"] == rows[-2]["artifact"]

    evals = summary["evals"]
    assert [p["label"] for p in evals] == ["sft", *(f"grpo-{n}" for n in range(1, ITERATIONS + 1))]
    for point, label in zip(evals, ["eval-sft", *(f"eval-grpo-{n}" for n in range(1, ITERATIONS + 1))]):
        assert point["accuracy"] == manifests[label].metrics["accuracy"]

    # The printed report: the stage table with every artifact, the learning table, the plot, the wandb runs.
    assert "stage" in printed and "duration_s" in printed and "key metric" in printed
    for row in rows:
        assert row["artifact"] in printed
    assert "Held-out exact match" in printed
    for point in evals:
        assert re.search(rf"^{point['label']}\s+{100 * point['accuracy']:.1f}%", printed, re.MULTILINE), point
    assert summary["flow_run_id"] in printed
    plot = Path(summary["plot_path"])
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert str(plot) in printed
    wandb_runs = sorted((tmp_path / "runs").glob("*/wandb/offline-run-*"))
    assert len(wandb_runs) == 1 + ITERATIONS  # the SFT run and one per GRPO stage
    assert f"wandb sync {(tmp_path / 'runs').resolve()}/*/wandb/offline-run-*" in printed

    # The docs' query example runs against this store and sees every iteration's rollouts.
    example = _docs_query_example().replace("file://./.forge-store", f"file://{tmp_path}/store")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(example, "docs/storage-layout.md:query-rollouts", "exec"), {})  # noqa: S102 - the docs example itself
    for iteration in range(ITERATIONS):
        assert re.search(rf"│\s+{iteration}\s+│\s+{samples}\s+│", out.getvalue()), out.getvalue()


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
def test_full_demo_lifts_held_out_accuracy_by_ten_points(prefect_api, tmp_path, seed):
    """The issue's target, on the demo config as shipped, seeds 0-4: GRPO >= +10 points over the selected SFT
    policy."""
    summary, printed = _run_demo(
        [f"seed={seed}", f"storage.root=file://{tmp_path}/store", f"logging.dir={tmp_path}/runs"]
    )

    evals = summary["evals"]
    assert len(evals) == 1 + load_config(DEMO_CONFIG).grpo.iterations
    assert evals[0]["accuracy"] < 0.9, "SFT already at the ceiling: the demo leaves GRPO nothing to show"
    assert evals[-1]["accuracy"] - evals[0]["accuracy"] >= 0.10, printed
