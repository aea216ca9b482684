"""What one drill run measured, read back from what the run committed (its manifests) and what the injector saw.

Every number of a run's record is taken from a manifest, the run's summary, the injector's `Strike` or the node
health samples, so a report can be checked against the store.
"""

from __future__ import annotations

import itertools
from datetime import datetime
from statistics import fmean
from typing import Any

from forge_core.drills.faults import Strike
from forge_core.drills.plan import DrillFault
from forge_core.storage import ObjectStore


def unix_time(iso: str) -> float:
    return datetime.fromisoformat(iso).timestamp()


def stage_rows(summary: dict, store: ObjectStore) -> list[dict[str, Any]]:
    """Each committed stage of the run: label, registry stage, artifact kind, URI, seconds, commit time."""
    rows = []
    for row in summary.get("stages", []):
        manifest = store.read_manifest(row["artifact"])
        rows.append({"label": row["stage"], "stage": manifest.stage, "kind": manifest.kind, "uri": row["artifact"],
                     "seconds": float(row["duration_s"]), "committed_at": unix_time(manifest.committed_at)})  # fmt: skip
    return rows


def workload_metrics(summary: dict, store: ObjectStore) -> dict[str, Any]:
    """Throughput, losses, accuracy, sample efficiency and failover counts of a finished run."""
    by_kind: dict[str, list] = {}
    for row in summary.get("stages", []):
        manifest = store.read_manifest(row["artifact"])
        by_kind.setdefault(manifest.kind, []).append(manifest)
    sft = by_kind["sft"][0].metrics
    rollouts = [m.metrics for m in by_kind.get("rollouts", [])]
    grpo = [m.metrics for m in by_kind.get("grpo", [])]
    evals = summary.get("evals", [])
    samples = sum(float(m["samples"]) for m in rollouts)
    accuracy_sft = float(evals[0]["accuracy"]) if evals else None
    accuracy_final = float(evals[-1]["accuracy"]) if evals else None
    gain = (accuracy_final - accuracy_sft) * 1000.0 / samples if samples and evals else None
    lost_at = [m.get("engines/first_lost_at", 0.0) for m in rollouts if m.get("engines/first_lost_at", 0.0)]
    return {
        "data_rows": _rows(by_kind["data"][0].metrics["rows"]) if "data" in by_kind else None,
        "sft_tokens_per_s": float(sft["tokens_per_s"]),
        "sft_final_loss": float(sft["final_loss"]),
        "sft_resumed_from_step": sft.get("resumed_from_step"),
        "grpo_final_loss": float(grpo[-1]["final/loss"]) if grpo and "final/loss" in grpo[-1] else None,
        "rollout_tokens_per_s": fmean(float(m["tokens_per_s"]) for m in rollouts) if rollouts else None,
        "rollout_samples": int(samples),
        "reward_mean": fmean(float(m["reward_mean"]) for m in rollouts) if rollouts else None,
        "accuracy_sft": accuracy_sft,
        "accuracy_final": accuracy_final,
        "accuracy_gain_per_1k_samples": gain,
        "engines_lost": int(sum(m.get("engines/lost", 0.0) for m in rollouts)),
        "rerouted_prompts": int(sum(m.get("engines/rerouted_prompts", 0.0) for m in rollouts)),
        "engine_first_lost_at": min(lost_at) if lost_at else None,
    }


def _rows(rows: dict | float) -> int:
    """A data manifest's row count: per table, summed."""
    return int(sum(rows.values())) if isinstance(rows, dict) else int(rows)


def fault_metrics(fault: DrillFault, strike: Strike, stages: list[dict], workload: dict,
                  attempts: dict[str, int], store: ObjectStore) -> dict[str, Any]:  # fmt: skip
    """When the fault struck, was noticed and was recovered from, and what moved.

    Recovery is the commit of the struck stage's first output after the strike: from then on the run goes on
    as if nothing happened. Detection is when the attempt's placement ended (a lost trainer node) or the
    router dropped the engine (engine side); other faults are not detected as such, they are ridden out.
    `redirects` counts the struck stage's nodes that its committed output no longer ran on.
    """
    injected = strike.injected_at
    detected = strike.detected_at
    if detected is None and fault.target == "rollout" and fault.kind in ("node_lost", "engine_killed"):
        detected = workload.get("engine_first_lost_at")
    recovered_row = None
    if injected is not None:
        after = [row for row in stages if row["stage"] == fault.target and row["committed_at"] >= injected]
        recovered_row = min(after, key=lambda row: row["committed_at"]) if after else None
    redirects = 0
    if recovered_row is not None and strike.nodes_before:
        placement = store.read_manifest(recovered_row["uri"]).placement or {}
        now_on = {node.get("node_id") for node in placement.get("nodes", [])}
        redirects = len(set(strike.nodes_before) - now_on)
    return {
        "injected_at": injected,
        "detected_at": detected,
        "recovered_at": recovered_row["committed_at"] if recovered_row else None,
        "detect_s": detected - injected if injected is not None and detected is not None else None,
        "recover_s": recovered_row["committed_at"] - injected if recovered_row and injected is not None else None,
        "struck_node": strike.node_id,
        "attempts": attempts.get(fault.target),
        "redirects": redirects,
    }


def node_health(samples: list[dict], ended_at: float) -> list[dict[str, Any]]:
    """Per node alive at some point of a run: samples seen, the longest gap between two sightings alive (a lost node's runs to the
    run's end), peak CPU % and memory of its processes."""
    by_node: dict[str, list[dict]] = {}
    for sample in samples:
        by_node.setdefault(sample["node"], []).append(sample)
    rows = []
    for node, seen in by_node.items():
        alive = [s["t"] for s in seen if s["alive"]]
        if not alive:
            continue  # lost before this run began
        gaps = [b - a for a, b in itertools.pairwise(alive)]
        lost = not seen[-1]["alive"]
        if lost and alive:
            gaps.append(ended_at - alive[-1])
        rows.append({"node": node, "samples": len(seen), "lost": lost, "max_gap_s": max(gaps, default=0.0),
                     "peak_cpu_percent": max((s.get("cpu") or 0.0 for s in seen), default=0.0),
                     "peak_rss_mb": max((s.get("rss_mb") or 0.0 for s in seen), default=0.0)})  # fmt: skip
    return rows
