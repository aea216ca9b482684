"""Runs the demo for several seeds and writes what the docs show of it: the five-seed learning table, seed 0's
output and plot.

    .venv/bin/python docs/demo_seeds.py                    # seeds 0-4, fresh store per seed (~50 min)
    .venv/bin/python docs/demo_seeds.py --seeds 0 --no-readme   # one seed, only print the measurements

Each seed is one `python -m flows.demo seed=N` process (exactly what `make demo` runs, plus the seed) on a fresh
store and runs folder under `--work-dir`, so every stage really runs and the timings are real. While it runs,
the resident memory of its whole process tree (flow, Prefect, torchrun ranks, vLLM) is sampled every 0.5 s;
the table reports the peak of that sum. Results land in docs/demo_seeds.json, between the README's
`<!-- demo-seeds:start/end -->` markers (the table), between docs/getting-started.md's
`<!-- demo-output:start/end -->` markers (the first seed's terminal output, progress bars removed, its temporary
paths shown as the demo's defaults) and in docs/img/demo-curves.png (the first seed's plot). The table records
the machine it was measured on (`machine_facts`: CPU model, the ISA torch's CPU kernels use, torch build): exact
accuracies differ between CPUs (docs/getting-started.md, "Does it learn?").
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.harness import TreeMemorySampler

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"  # the five-seed table
GETTING_STARTED = REPO / "docs" / "getting-started.md"  # seed 0's output
PLOT = REPO / "docs" / "img" / "demo-curves.png"  # seed 0's curves, beside the README's table
RESULTS = REPO / "docs" / "demo_seeds.json"


def machine_facts() -> dict:
    """What the numbers depend on beyond the code and config: CPU model, the ISA torch's CPU kernels dispatch
    to (ATEN_CPU_CAPABILITY pins it), the torch build and its BLAS, the cores, Python."""
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""

    def field(name: str) -> str:
        found = re.search(rf"^{name}\s*:\s*(.+)$", cpuinfo, re.MULTILINE)
        return found.group(1).strip() if found else "?"

    return {
        "cpu_model": field("model name") if cpuinfo else platform.processor() or "unknown",
        # A virtual machine may hide the model name ("AMD EPYC"); family/model/stepping still tell the core.
        "cpu_id": f"{field('vendor_id')} family {field('cpu family')} model {field('model')} stepping "
        f"{field('stepping')}",
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "blas": "mkl" if torch.backends.mkl.is_available() else "other",
        "cores": os.cpu_count(),
        "machine": platform.machine(),
        "python": platform.python_version(),
    }


def sft_selection(summary: dict, store: Path) -> dict:
    """The SFT stage's selection (steps run, selected step, why) from its committed manifest."""
    from forge_core.storage import ObjectStore

    (row,) = [r for r in summary["stages"] if r["stage"] == "sft"]
    metrics = ObjectStore(f"file://{store}").read_manifest(row["artifact"]).metrics
    return {key: metrics.get(key) for key in ("steps", "selected_step", "selected_by", "val_exact_match")}


def run_seed(seed: int, work_dir: Path, extra: list[str], label: str = "") -> dict:
    """One demo run on the seed's store under `work_dir` (fresh for a new work dir; runs of one seed that share
    prepare and SFT settings reuse those stages from it); its accuracies, wall time, peak memory and cleaned
    output. `label` names the run's log file, seed-N[-label].log."""
    store, runs = work_dir / f"seed-{seed}" / "store", work_dir / f"seed-{seed}" / "runs"
    args = [f"seed={seed}", f"storage.root=file://{store}", f"logging.dir={runs}", *extra]
    started = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, "-m", "flows.demo", *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "FORGE_PROGRESS_BARS": "1"},
    )
    with TreeMemorySampler(process.pid) as memory:
        output, _ = process.communicate()
    wall_s = time.perf_counter() - started
    log_file = work_dir / f"seed-{seed}{'-' + label if label else ''}.log"
    log_file.write_text(output)
    if process.returncode != 0:
        raise SystemExit(f"seed {seed}: the demo failed (exit {process.returncode}); see {log_file}")
    summary_path = _summary_path(output)
    summary = json.loads(Path(summary_path).read_text())
    accuracies = [point["accuracy"] for point in summary["evals"]]
    return {
        "seed": seed,
        "summary_path": summary_path,
        "sft": sft_selection(summary, store),
        "accuracy": accuracies,
        "gain_points": 100 * (accuracies[-1] - accuracies[0]),
        "wall_s": wall_s,
        "peak_rss_gib": memory.peak_bytes / 2**30,
        "output": clean_output(output, store, runs),
    }


def _summary_path(output: str) -> str:
    match = re.search(r"^summary:\s+(\S+)", output, re.MULTILINE)
    if match is None:
        raise SystemExit("the demo printed no `summary:` line; is flows/demo.py current?")
    return match.group(1)


def clean_output(output: str, store: Path, runs: Path) -> str:
    """What a user's terminal keeps: progress-bar redraws dropped, this script's folders named as the demo's."""
    lines = []
    for line in output.splitlines():
        line = line.rsplit("\r", 1)[-1]  # a progress bar redraws itself with carriage returns
        if not line.strip() or re.match(r"^\s*(sft|grpo):\s+\d+%", line):
            continue
        lines.append(
            line.replace(f"file://{store}", "file://./.forge-store").replace(str(runs), ".forge-runs")
        )
    return "\n".join(lines)


def seeds_table(results: list[dict], machine: dict) -> str:
    iterations = len(results[0]["accuracy"]) - 1
    header = [
        "seed",
        "SFT steps (selected)",
        "after SFT",
        *(f"GRPO {i}" for i in range(1, iterations + 1)),
        "GRPO gain",
        "wall",
        "peak RSS",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for r in results:
        sft = r.get("sft", {})
        chosen = f"{sft.get('selected_step')} of {sft.get('steps')} ({sft.get('selected_by')})" if sft else "n/a"
        cells = [str(r["seed"]), chosen, *(f"{100 * a:.1f}%" for a in r["accuracy"])]
        cells += [
            f"{r['gain_points']:+.1f} pt",
            f"{r['wall_s'] / 60:.1f} min",
            f"{r['peak_rss_gib']:.1f} GiB",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    gains = [r["gain_points"] for r in results]
    where = (
        f"{machine['cpu_model']} ({machine['cpu_id']}; {machine['cores']} cores, {machine['machine']}; torch's CPU kernels: "
        f"{machine['cpu_capability']}), torch {machine['torch']} ({machine['blas']}), Python {machine['python']}"
    )
    lines += [
        "",
        (
            f"GRPO gain over the selected SFT policy: mean {sum(gains) / len(gains):+.1f} points, smallest "
            f"{min(gains):+.1f} (target: >= +10). Measured by `docs/demo_seeds.py` on {where}; wall time "
            "includes Prefect, process and vLLM start-up, and peak RSS is the whole process tree (flow, torchrun "
            "ranks, vLLM) summed. On another CPU the exact accuracies differ (see below)."
        ),
    ]
    return "\n".join(lines)


def replace_between(text: str, marker: str, body: str) -> str:
    start, end = f"<!-- {marker}:start -->", f"<!-- {marker}:end -->"
    if start not in text or end not in text:
        raise SystemExit(f"lost the {start} ... {end} markers")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n{body}\n{end}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--work-dir", type=Path, default=REPO / ".forge-seeds")
    parser.add_argument("--no-readme", action="store_true", help="print the results, leave the docs alone")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value for every seed's run")
    args = parser.parse_args(argv)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for seed in args.seeds:
        result = run_seed(seed, args.work_dir.resolve(), args.overrides)
        print(
            f"seed {seed}: accuracy {[round(a, 3) for a in result['accuracy']]}, gain {result['gain_points']:+.1f} pt, "
            f"{result['wall_s']:.0f}s, peak {result['peak_rss_gib']:.2f} GiB",
            flush=True,
        )
        results.append(result)
    machine = machine_facts()
    table = seeds_table(results, machine)
    print(table)
    if args.no_readme:
        return 0
    runs = [{k: v for k, v in r.items() if k not in ("output", "summary_path")} for r in results]
    RESULTS.write_text(json.dumps({"machine": machine, "overrides": args.overrides, "seeds": runs}, indent=2) + "\n")
    README.write_text(replace_between(README.read_text(), "demo-seeds", table))
    GETTING_STARTED.write_text(
        replace_between(GETTING_STARTED.read_text(), "demo-output", f"```\n{results[0]['output']}\n```")
    )
    shutil.copyfile(Path(results[0]["summary_path"]).with_name("curves.png"), PLOT)  # the flow's own plot
    print(f"wrote {README}, {GETTING_STARTED}, {PLOT} and {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
