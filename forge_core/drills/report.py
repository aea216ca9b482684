"""A drill's verdict and report: `judge` lists every way a drill failed; `write_report` writes drill.json, drill.md
and the plots (throughput and recovery against cluster size, a per-node timeline of each step with its faults
marked).

A drill fails when a fault's run loses data (a stage, data rows or rollout samples the clean run had), leaves a
process, actor or placement group behind, never strikes, does not recover within its bound, or ends further from
the clean run than the plan's tolerance; and when recovery grows faster along the ladder than
nodes**max_recovery_exponent.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from forge_core.drills.plan import DrillPlan

CLEAN = "clean"
RUN_HEADER = (
    "| run | wall s | SFT tok/s | rollout tok/s | detect s | recover s (bound) | attempts | redirects "
    "| re-routed prompts | Δ SFT loss | Δ accuracy | acc. gain / 1k samples | left behind |"
)


def judge(drill: dict, plan: DrillPlan) -> list[str]:
    """Every problem of a recorded drill against `plan`'s bounds and tolerance (empty: it passed)."""
    problems: list[str] = []
    bounds = {fault.label: fault for fault in plan.faults}
    for step in drill["steps"]:
        clean = next((run for run in step["runs"] if run["name"] == CLEAN), None)
        for run in step["runs"]:
            where = f"{run['name']} at {step['nodes']} nodes"
            if run.get("skipped"):
                continue
            if run.get("error"):
                problems.append(f"{where}: the run failed: {run['error']}")
                continue
            if run.get("leftovers"):
                left = run["leftovers"]
                problems.append(f"{where}: {len(left)} thing(s) left after the run: {', '.join(left[:5])}")
            if run["name"] == CLEAN or clean is None or clean.get("error"):
                continue
            problems += _fault_problems(where, run, clean, bounds.get(run["name"]), plan)
    for label, fit in scaling(drill).items():
        if fit["exponent"] is not None and fit["exponent"] > plan.max_recovery_exponent:
            problems.append(
                f"{label}: recovery grows as nodes**{fit['exponent']:.2f} along the ladder "
                f"({_pairs(fit)}), faster than max_recovery_exponent={plan.max_recovery_exponent:g}"
            )
    return problems


def _fault_problems(where: str, run: dict, clean: dict, fault, plan: DrillPlan) -> list[str]:
    problems = []
    measured = run["fault"]
    if measured["injected_at"] is None:
        return [f"{where}: the fault never struck (its trigger was not reached: check its `at`)"]
    if measured["recover_s"] is None:
        problems.append(f"{where}: not recovered: no output of {fault.target if fault else 'its stage'} was "
                        "committed after the fault")  # fmt: skip
    elif fault is not None and measured["recover_s"] > fault.recover_within_s:
        problems.append(
            f"{where}: recovered in {measured['recover_s']:.1f} s, over its bound recover_within_s="
            f"{fault.recover_within_s:g} s; raise the bound or find what slowed the recovery"
        )
    lost = [s["label"] for s in clean["stages"] if s["label"] not in {r["label"] for r in run["stages"]}]
    if lost:
        problems.append(f"{where}: data lost: stages {lost} of the clean run were not committed")
    for key in ("data_rows", "rollout_samples"):
        if run["workload"][key] != clean["workload"][key]:
            problems.append(f"{where}: data lost: {key}={run['workload'][key]}, the clean run had {clean['workload'][key]}")
    for key, tolerance in (("sft_final_loss", plan.tolerance.loss), ("grpo_final_loss", plan.tolerance.loss),
                           ("accuracy_final", plan.tolerance.accuracy)):  # fmt: skip
        delta = difference(run, clean, key)
        if delta is not None and delta > tolerance:
            problems.append(f"{where}: {key} differs from the clean run by {delta:.3g}, over the tolerance {tolerance:g}")
    return problems


def difference(run: dict, clean: dict, key: str) -> float | None:
    a, b = run["workload"].get(key), clean["workload"].get(key)
    return abs(a - b) if a is not None and b is not None else None


def scaling(drill: dict) -> dict[str, dict[str, Any]]:
    """Per fault: recovery seconds at each cluster size, the linear slope (s per node) and the fitted exponent
    k of recover_s ~ nodes**k (least squares in log-log; None with fewer than two sizes)."""
    points: dict[str, list[tuple[int, float]]] = {}
    for step in drill["steps"]:
        for run in step["runs"]:
            recover = (run.get("fault") or {}).get("recover_s")
            if run["name"] != CLEAN and recover is not None and recover > 0:
                points.setdefault(run["name"], []).append((step["nodes"], recover))
    fits = {}
    for label, pairs in points.items():
        nodes, seconds = [p[0] for p in pairs], [p[1] for p in pairs]
        fits[label] = {"nodes": nodes, "recover_s": seconds, "slope_s_per_node": _slope(nodes, seconds),
                       "exponent": _slope([math.log(n) for n in nodes], [math.log(s) for s in seconds])}  # fmt: skip
    return fits


def _slope(xs: list[float], ys: list[float]) -> float | None:
    if len(set(xs)) < 2:
        return None
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)


def _pairs(fit: dict) -> str:
    return ", ".join(f"{n} nodes: {s:.1f} s" for n, s in zip(fit["nodes"], fit["recover_s"]))


# ---- the report ------------------------------------------------------------------------------------------


def _num(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}" if abs(value) >= 10 ** -digits or value == 0 else f"{value:.2g}"
    return str(value)


def markdown(drill: dict) -> str:
    """The report: the verdict, one table per step (runs, then node health), the scaling fit, the plots."""
    verdict = "**passed**" if drill["passed"] else f"**failed** ({len(drill['problems'])} problem(s))"
    lines = [f"# Drill `{drill['plan']['name']}`: {verdict}", "", f"Cluster: {drill['cluster']}.", "",
             f"Workload: `{drill['plan']['config']}` with {', '.join(f'`{o}`' for o in drill['overrides']) or 'no overrides'}.",
             ""]  # fmt: skip
    lines += [f"- {problem}" for problem in drill["problems"]] + ([""] if drill["problems"] else [])
    for step in drill["steps"]:
        lines += [f"## {step['nodes']} nodes", "", RUN_HEADER, "|" + " --- |" * 13]
        clean = next((r for r in step["runs"] if r["name"] == CLEAN), None)
        for run in step["runs"]:
            lines.append(_run_row(run, clean))
        lines += ["", "| run | node | lost | longest gap between sightings s | peak CPU % | peak RSS MiB |",
                  "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
        for run in step["runs"]:
            for node in run.get("health", []):
                lines.append(f"| {run['name']} | {node['node'][:8]} | {'yes' if node['lost'] else ''} | "
                             f"{_num(node['max_gap_s'])} | {_num(node['peak_cpu_percent'])} | {_num(node['peak_rss_mb'], 0)} |")  # fmt: skip
        lines += ["", f"![timeline]({step['timeline']})" if step.get("timeline") else "", ""]
    fits = drill.get("scaling", {})
    if fits:
        lines += ["## Recovery against cluster size", "", "| fault | recovery s by nodes | slope s/node | exponent k |",
                  "| --- | --- | --- | --- |"]  # fmt: skip
        for label, fit in fits.items():
            lines.append(f"| {label} | {_pairs(fit)} | {_num(fit['slope_s_per_node'], 2)} | {_num(fit['exponent'], 2)} |")
        lines.append("")
    for plot in drill.get("plots", []):
        lines += [f"![{Path(plot).stem}]({plot})", ""]
    return "\n".join(lines)


def _run_row(run: dict, clean: dict | None) -> str:
    if run.get("skipped"):
        return f"| {run['name']} | skipped: {run['skipped']} |" + " |" * 11
    if run.get("error"):
        return f"| {run['name']} | failed: {run['error'][:200]} |" + " |" * 11
    work, fault = run["workload"], run.get("fault") or {}
    bound = f" ({fault['bound_s']:g})" if fault.get("bound_s") else ""
    deltas = [difference(run, clean, k) if clean and run is not clean else None for k in ("sft_final_loss", "accuracy_final")]
    cells = [run["name"], _num(run["wall_s"]), _num(work["sft_tokens_per_s"]), _num(work["rollout_tokens_per_s"]),
             _num(fault.get("detect_s")), _num(fault.get("recover_s")) + bound, _num(fault.get("attempts")),
             _num(fault.get("redirects")), _num(work["rerouted_prompts"]), _num(deltas[0], 6), _num(deltas[1], 3),
             _num(work["accuracy_gain_per_1k_samples"], 3), str(len(run.get("leftovers", [])))]  # fmt: skip
    return "| " + " | ".join(cells) + " |"


def plot(drill: dict, folder: Path) -> list[str]:
    """Throughput and recovery against cluster size (file names, relative to `folder`); each step's timeline
    is written too and named in its step's `timeline`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    steps = drill["steps"]
    cleans = [(s["nodes"], next((r for r in s["runs"] if r["name"] == CLEAN and not r.get("error")), None)) for s in steps]
    cleans = [(n, r) for n, r in cleans if r is not None]
    if cleans:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for key, label in (("sft_tokens_per_s", "SFT tokens/s"), ("rollout_tokens_per_s", "rollout tokens/s")):
            ax.plot([n for n, _ in cleans], [r["workload"][key] or 0.0 for _, r in cleans], marker="o", label=label)
        ax.set_xlabel("nodes"), ax.set_ylabel("tokens/s (clean run)"), ax.legend(), ax.grid(alpha=0.3)
        fig.tight_layout(), fig.savefig(folder / "throughput_vs_nodes.png", dpi=110), plt.close(fig)
        written.append("throughput_vs_nodes.png")
    fits = drill.get("scaling") or scaling(drill)
    if fits:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for label, fit in fits.items():
            ax.plot(fit["nodes"], fit["recover_s"], marker="o", label=label)
        ax.set_xlabel("nodes"), ax.set_ylabel("recovery s"), ax.legend(fontsize=7), ax.grid(alpha=0.3)
        fig.tight_layout(), fig.savefig(folder / "recovery_vs_nodes.png", dpi=110), plt.close(fig)
        written.append("recovery_vs_nodes.png")
    for step in steps:
        name = f"timeline_{step['nodes']}_nodes.png"
        if _timeline(step, folder / name, plt):
            step["timeline"] = name
    return written


def step_nodes(step: dict) -> list[str]:
    """The nodes a step's timeline shows: those seen alive during the step. Ray lists a node removed in an
    earlier step as dead for good; it is not this step's."""
    return sorted({s["node"] for run in step["runs"] for s in run.get("samples", []) if s["alive"]})


def _timeline(step: dict, path: Path, plt) -> bool:
    nodes = step_nodes(step)
    samples = [(run["name"], s) for run in step["runs"] for s in run.get("samples", []) if s["node"] in nodes]
    if not samples:
        return False
    start = min(s["t"] for _, s in samples)
    fig, ax = plt.subplots(figsize=(10, 0.35 * len(nodes) + 1.8))
    alive = [(s["t"] - start, nodes.index(s["node"]), s.get("cpu") or 0.0) for _, s in samples if s["alive"]]
    dead = [(s["t"] - start, nodes.index(s["node"])) for _, s in samples if not s["alive"]]
    if alive:
        points = ax.scatter([a[0] for a in alive], [a[1] for a in alive], c=[a[2] for a in alive], s=6, cmap="viridis")
        fig.colorbar(points, ax=ax, label="CPU % of the node's processes")
    if dead:
        ax.scatter([d[0] for d in dead], [d[1] for d in dead], marker="x", color="red", s=8, label="node dead")
        ax.legend(loc="lower left", fontsize=7)
    for run in step["runs"]:
        fault = run.get("fault") or {}
        if fault.get("injected_at"):
            x = fault["injected_at"] - start
            ax.axvline(x, color="red", linestyle="--", linewidth=1)
            # Above the plot (x in data, y in axes units), so the names never cover a node's row.
            ax.text(x, 1.01, run["name"], transform=ax.get_xaxis_transform(), color="red", fontsize=7, rotation=90,
                    va="bottom", ha="center")  # fmt: skip
    ax.set_yticks(range(len(nodes)), [n[:8] for n in nodes], fontsize=6)
    ax.set_xlabel(f"seconds since the step began ({step['nodes']} nodes)")
    fig.tight_layout(), fig.savefig(path, dpi=110), plt.close(fig)
    return True


def write_report(drill: dict, folder: Path) -> Path:
    """drill.json, drill.md and the plots in `folder`; returns drill.md's path."""
    folder.mkdir(parents=True, exist_ok=True)
    drill["plots"] = plot(drill, folder)
    (folder / "drill.json").write_text(json.dumps(drill, indent=1, default=str))
    path = folder / "drill.md"
    path.write_text(markdown(drill))
    return path
