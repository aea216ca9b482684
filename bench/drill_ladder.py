"""The simulated drill ladder (`make drill`): 3 -> 6 -> 12 nodes of configs/drills/ladder.yaml, every fault at each
step. One node is a raylet of this machine with 2 logical CPUs and 1 fake GPU; all share its cores.

    python -m bench.drill_ladder                    # runs the ladder, then records the fit
    python -m bench.drill_ladder --from DRILL_JSON  # records the fit of a ladder already run

Result: the steepest fitted exponent k of recovery time ~ nodes**k over the faults (target <= 1: recovery must
not grow faster than linearly in the number of nodes), with every fault's slope in seconds per node, the
recovery times, and the clean runs' throughput per step in `details`; the report and plots stay in
bench/results/drill/.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from bench.harness import write_result

PLAN = "configs/drills/ladder.yaml"
FOLDER = Path(__file__).resolve().parent / "results" / "drill"


def record_fit(drill: dict) -> dict:
    fits = {label: fit for label, fit in drill["scaling"].items() if fit["exponent"] is not None}
    steepest = max(fits.values(), key=lambda fit: fit["exponent"], default=None)
    clean = {step["nodes"]: next(r for r in step["runs"] if r["name"] == "clean") for step in drill["steps"]}
    details = {
        "cluster": drill["cluster"],
        "passed": drill["passed"],
        "problems": drill["problems"],
        "faults": {label: {"exponent": round(fit["exponent"], 3), "slope_s_per_node": round(fit["slope_s_per_node"], 3),
                           "recover_s": dict(zip(fit["nodes"], (round(s, 1) for s in fit["recover_s"]), strict=True))}
                   for label, fit in fits.items()},
        "clean_runs": {n: {"wall_s": round(r["wall_s"], 1),
                           "sft_tokens_per_s": round(r["workload"]["sft_tokens_per_s"], 1),
                           "rollout_tokens_per_s": round(r["workload"]["rollout_tokens_per_s"], 1)}
                       for n, r in clean.items() if not r.get("error")},
        "skipped": sorted({r["name"]: r["skipped"] for s in drill["steps"] for r in s["runs"] if r.get("skipped")}.items()),
        "report": "bench/results/drill/drill.md",
    }
    return write_result("drill_ladder", steepest["exponent"] if steepest else float("nan"), 1.0, "<= 1",
                        "fitted exponent k of recovery_s ~ nodes**k (steepest fault)", details)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="source", default=None, help="a drill.json already written")
    args = parser.parse_args(argv)
    source = Path(args.source) if args.source else FOLDER / "drill.json"
    if not args.source:
        subprocess.run([sys.executable, "-m", "flows.cli", "drill", PLAN, "--out", str(FOLDER)], check=False)
    record_fit(json.loads(source.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
