"""The GRPO-family learning check (docs/grpo.md, "Off-policy correction and the GRPO family"): held-out accuracy of
the demo with the loss and correction variants, per seed.

    .venv/bin/python docs/grpo_family_check.py                  # 3 seeds x 5 variants, ~2 h on an idle 2-core box
    .venv/bin/python docs/grpo_family_check.py --quick          # 1 seed, 2 iterations, small budgets (~15 min)
    .venv/bin/python docs/grpo_family_check.py --corrections tis icepop --seeds 0   # other corrections

Variants (each `python -m flows.demo seed=N <overrides>`, docs/demo_seeds.py's `run_seed`):
- `sync`: the demo as shipped (token-mean loss, no correction): the reference;
- `async-none`: async with grpo.max_staleness=2 and no correction (grpo.allow_uncorrected_async=true);
- `async-<c>`: the same with grpo.correction.type=<c> for every c in --corrections (default: tis);
- `gspo`, `cispo`: sync with grpo.loss.type=gspo (clip 3e-4 / 4e-4, the GSPO paper's) or cispo.
The runs of one seed share one store (`<work-dir>/seed-N/store`): prepare and SFT do not depend on the
variant, so the first run computes them and the others reuse them by their content keys; only rollouts, GRPO
and evaluation differ. The report gives each variant's accuracy after SFT and after the last iteration per
seed, the mean gain over seeds, and, from the GRPO manifests, the mean sampler-vs-trainer mismatch
(mismatch/logprob_diff_mean), the share of tokens the correction masked or truncated, and the extra
forward's time against the optimizer steps'. Results go to `<work-dir>/grpo_family_check.json`; the full
run (not --quick) also writes docs/grpo_family_check.json and the table of docs/grpo.md between
`<!-- grpo-family:start -->` and `<!-- grpo-family:end -->` unless --no-readme.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from demo_seeds import REPO, replace_between, run_seed

RESULTS = REPO / "docs" / "grpo_family_check.json"
PAGE = REPO / "docs" / "grpo.md"
ASYNC = ["grpo.mode=async", "grpo.max_staleness=2"]
# 1 seed, 2 iterations, small budgets: proves every variant runs end to end, measures nothing.
QUICK = [
    "sft.steps=60",
    "grpo.iterations=2",
    "rollout.prompts_per_iteration=32",
    "grpo.epochs=1",
    "eval.num_prompts=64",
]
GRPO_METRICS = (
    "mismatch/logprob_diff_mean",
    "mismatch/logprob_diff_max",
    "mismatch/kl_k3",
    "correction/masked_token_frac",
    "correction/truncated_token_frac",
    "rollout/staleness_mean",
    "train/score_logprobs_s",
    "train/time_s",
)


def variants(corrections: list[str]) -> dict[str, list[str]]:
    """Variant name -> its overrides on top of the demo config (the reference first: it computes SFT)."""
    table = {"sync": [], "async-none": [*ASYNC, "grpo.allow_uncorrected_async=true"]}
    for correction in corrections:
        table[f"async-{correction}"] = [*ASYNC, f"grpo.correction.type={correction}"]
    table["gspo"] = ["grpo.loss.type=gspo"]  # its own clip defaults (3e-4 / 4e-4: LossConfig.clip_range)
    table["cispo"] = ["grpo.loss.type=cispo"]
    # The check compares the mismatch of every variant, those without a correction included.
    return {name: ["grpo.correction.measure_mismatch=true", *overrides] for name, overrides in table.items()}


def grpo_manifest_means(summary_path: str, store_root: str) -> dict[str, float]:
    """Means over the run's GRPO stages of GRPO_METRICS, read from their manifests."""
    from forge_core.storage import ObjectStore

    store = ObjectStore(store_root)
    evals = json.loads(Path(summary_path).read_text())["evals"]
    manifests = [store.read_manifest(point["policy_uri"]).metrics for point in evals[1:]]
    means = {}
    for key in GRPO_METRICS:
        values = [float(m[key]) for m in manifests if key in m]
        if values:
            means[key] = sum(values) / len(values)
    return means


def run_variant(name: str, overrides: list[str], seed: int, work_dir: Path, extra: list[str]) -> dict:
    started = time.perf_counter()
    result = run_seed(seed, work_dir, [*extra, *overrides], label=name)
    store_root = f"file://{work_dir / f'seed-{seed}' / 'store'}"
    row = {
        "variant": name,
        "seed": seed,
        "overrides": overrides,
        "accuracy": result["accuracy"],
        "gain_points": result["gain_points"],
        "wall_s": time.perf_counter() - started,
        "grpo": grpo_manifest_means(result["summary_path"], store_root),
    }
    print(
        f"{name} seed {seed}: accuracy {[round(a, 3) for a in row['accuracy']]}, gain {row['gain_points']:+.1f} pt, "
        f"{row['wall_s']:.0f}s, mismatch {row['grpo'].get('mismatch/logprob_diff_mean', float('nan')):.2e}",
        flush=True,
    )
    return row


def report(rows: list[dict], quick: bool) -> str:
    names = list(dict.fromkeys(r["variant"] for r in rows))
    seeds = sorted({r["seed"] for r in rows})
    header = ["variant", *(f"seed {s}: SFT -> final" for s in seeds), "mean gain", "mismatch |dlogp|",
              "masked / truncated", "extra forward / steps"]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for name in names:
        mine = {r["seed"]: r for r in rows if r["variant"] == name}
        cells = [f"`{name}`"]
        for s in seeds:
            acc = mine[s]["accuracy"] if s in mine else None
            cells.append(f"{100 * acc[0]:.1f}% -> {100 * acc[-1]:.1f}%" if acc else "-")
        gains = [r["gain_points"] for r in mine.values()]
        grpo = [r["grpo"] for r in mine.values()]

        def mean(key: str, grpo=grpo) -> float:
            values = [g[key] for g in grpo if key in g]
            return sum(values) / len(values) if values else float("nan")

        cells += [
            f"{sum(gains) / len(gains):+.1f} pt",
            f"{mean('mismatch/logprob_diff_mean'):.1e}",
            "{:.2f}% / {:.2f}%".format(
                100 * mean("correction/masked_token_frac"), 100 * mean("correction/truncated_token_frac")
            ),
            f"{100 * mean('train/score_logprobs_s') / mean('train/time_s'):.1f}%",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    machine = f"{os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()}"
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    budget = "--quick budgets (a smoke run, not a measurement)" if quick else "the demo as shipped"
    lines += ["", (
        f"Measured by `docs/grpo_family_check.py` with {budget}, on {machine} (load average at the end: {load}); "
        "mismatch, masked / truncated and the extra forward's share of the optimizer steps' time are means over "
        "the GRPO stages' manifests."
    )]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="default 0 1 2 (--quick: 0)")
    parser.add_argument("--corrections", nargs="+", default=["tis"], choices=["tis", "mis", "geo_mask", "icepop"])
    parser.add_argument("--quick", action="store_true", help="1 seed, 2 iterations, small budgets")
    parser.add_argument("--work-dir", type=Path, default=REPO / ".forge-family-check")
    parser.add_argument("--no-readme", action="store_true", help="print the results, leave docs/grpo.md alone")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value for every run")
    args = parser.parse_args(argv)
    seeds = args.seeds if args.seeds is not None else ([0] if args.quick else [0, 1, 2])
    extra = [*(QUICK if args.quick else []), *args.overrides]
    work_dir = args.work_dir.resolve()
    work_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for seed in seeds:
        for name, overrides in variants(args.corrections).items():
            rows.append(run_variant(name, overrides, seed, work_dir, extra))
            (work_dir / "grpo_family_check.json").write_text(json.dumps(rows, indent=2) + "\n")
    table = report(rows, args.quick)
    print(table)
    if args.quick or args.no_readme:
        return 0
    RESULTS.write_text(json.dumps(rows, indent=2) + "\n")
    PAGE.write_text(replace_between(PAGE.read_text(), "grpo-family", table))
    print(f"wrote {PAGE} and {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
