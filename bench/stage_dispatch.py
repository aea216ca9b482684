"""Benchmark: what running the stages on a joined multi-node Ray cluster costs against the embedded default (the
flow's own one-node Ray), on the demo pipeline, in one run.

    python -m bench.stage_dispatch                  # the demo config: ~15 min on 2 cores
    python -m bench.stage_dispatch --config configs/tiny_test.yaml sft.steps=4     # a smoke run

One process: Prefect's local API in a private home, and the same pipeline (same config, same seed, each run on a
fresh local store so that every stage really runs) twice:

- pool: on a simulated 3-node Ray cluster on this machine (`ray.cluster_utils.Cluster`: a head and three nodes
  labelled forgeflow.pool=gpu-a, two CPUs each, every port on 127.0.0.1, token authentication; one node is what
  one raylet with its workers is), joined by address, every stage on pool gpu-a: stage-lifetime stages as gangs
  (a placement group and a node agent per node), the rollout engines as engine actors on nodes of the pool
  (rollout and evaluate in the task's process), the flow-lifetime trainer as the run's trainer group;
- local: the defaults, as `make demo` runs: the flow starts its own embedded Ray (one node, this machine) and
  shuts it down at its end; the same stages, actors and group on it.

Before both, off the clock, a short run of the same config (WARM_UP_OVERRIDES, embedded) pays what only a
process's first pipeline run pays (the stages' imports in this process, cold file caches: about 10 s of this
process's CPU on the demo), which would otherwise count against whichever mode runs first. Then the pool run,
then the local one; the simulated cluster is shut down before the local run starts.

Results (two files):
- `stage_dispatch`: value = the median over the pipeline's stages of (the stage's wall in the pool run minus
  the same stage's wall in the local run), baseline = 1 s, so ratio = seconds; target <= 1. A stage's wall is
  its row of the flow's stage table (the flow's clock around the stage task). Details also give each stage's
  walls, its body (`wall_s` of its manifest), and the same median over the non-body part (wall minus body).
- `stage_dispatch.pipeline`: value = the pool run's wall, baseline = the local run's; target ratio <= 1.15.
  Details: the cluster's start-up time and each run's peak RSS (the sum over this process and all its
  descendants, the simulated cluster's processes included; target for the demo <= 6 GiB).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench._flow_runs import isolate_prefect, warm_up_api
from bench.harness import TreeMemorySampler, write_result

BENCH_NAME = "stage_dispatch"
DISPATCH_TARGET = "<=1"
PIPELINE_TARGET = "<=1.15"
DEFAULT_CONFIG = "configs/demo_cpu.yaml"
POOL = "gpu-a"
POOL_NODES = 3
# CPUs each simulated node reports: the demo's trainer group holds one per rank (launch.grpo.nproc_per_node=2).
NODE_CPUS = 2
STAGES = ("prepare", "sft", "rollout", "grpo", "evaluate")
# The warm-up run: every stage of the config once, with a few steps and prompts.
WARM_UP_OVERRIDES = ["sft.steps=2", "grpo.iterations=1", "rollout.prompts_per_iteration=32", "eval.num_prompts=16"]


def placement_overrides(mode: str, address: str = "") -> list[str]:
    """`pool`: every stage on pool gpu-a of the Ray cluster at `address`; `local`: the defaults (embedded)."""
    if mode == "local":
        return []
    return [f"launch.ray_address={address}", *(f"launch.{stage}.pool={POOL}" for stage in STAGES)]


def start_cluster(folder: Path):
    """The simulated cluster (module docstring) and this process's connection to it."""
    from ray.cluster_utils import Cluster

    from forge_core.compute.cluster import (
        POOL_LABEL,
        apply_environment,
        connect,
        embedded_environment,
        private_token_file,
    )

    apply_environment(embedded_environment(private_token_file(folder)))
    started = time.monotonic()
    raylets = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    for _ in range(POOL_NODES):
        raylets.add_node(num_cpus=NODE_CPUS, labels={POOL_LABEL: POOL})
    raylets.wait_for_nodes()
    compute = connect(raylets.address)
    return raylets, compute, time.monotonic() - started


def run_mode(folder: Path, name: str, mode: str, config: str, extra: list[str], address: str = "") -> dict:
    """One pipeline run in placement `mode` on its own store: its wall, its peak RSS (every process of this
    machine it ran, the Ray cluster's included) and per stage its wall and body."""
    from flows.post_train import post_train
    from forge_core.storage import ObjectStore

    overrides = [f"storage.root=file://{folder / name}/store", f"logging.dir={folder / name}/runs",
                 f"name={name}", *placement_overrides(mode, address), *extra]
    print(f"[{BENCH_NAME}] {name}: starting {config} {' '.join(overrides)}", flush=True)
    started = time.monotonic()
    with TreeMemorySampler(os.getpid()) as rss:
        summary = post_train(config, overrides)
    wall_s = time.monotonic() - started
    print(f"[{BENCH_NAME}] {name}: {wall_s:.1f} s", flush=True)
    store = ObjectStore(f"file://{folder / name}/store")
    stages = {}
    for row in summary["stages"]:
        manifest = store.read_manifest(row["artifact"])
        stages[row["stage"]] = {
            "wall_s": float(row["duration_s"]),
            "body_s": round(float(manifest.metrics["wall_s"]), 2),
            "where": row["where"],
        }
    return {"wall_s": round(wall_s, 1), "peak_rss_gib": round(rss.peak_bytes / 2**30, 2), "stages": stages}


def compare(pool: dict, local: dict) -> dict:
    """Per-stage differences pool - local (wall, and wall minus body) and their medians."""
    labels = [label for label in local["stages"] if label in pool["stages"]]
    missing = sorted(set(local["stages"]) ^ set(pool["stages"]))
    if missing:
        raise RuntimeError(f"the two runs ran different stages: {missing}")
    per_stage = {}
    for label in labels:
        p, q = pool["stages"][label], local["stages"][label]
        per_stage[label] = {
            "pool_s": p["wall_s"],
            "local_s": q["wall_s"],
            "dispatch_s": round(p["wall_s"] - q["wall_s"], 2),
            "pool_body_s": p["body_s"],
            "local_body_s": q["body_s"],
            "non_body_dispatch_s": round((p["wall_s"] - p["body_s"]) - (q["wall_s"] - q["body_s"]), 2),
            "where": p["where"],
        }
    return {
        "median_dispatch_s": statistics.median(s["dispatch_s"] for s in per_stage.values()),
        "median_non_body_dispatch_s": statistics.median(s["non_body_dispatch_s"] for s in per_stage.values()),
        "stages": per_stage,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="pipeline config, relative to the repository")
    parser.add_argument("overrides", nargs="*", help="config overrides for every run (key=value)")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="forge-bench-dispatch-") as tmp:
        folder = Path(tmp)
        isolate_prefect(folder / "prefect-home")
        warm_up_api()
        run_mode(folder, "dispatch-warm-up", "local", args.config, [*args.overrides, *WARM_UP_OVERRIDES])
        raylets, compute, cluster_start_s = start_cluster(folder / "ray")
        try:
            pool = run_mode(folder, "dispatch-pool", "pool", args.config, args.overrides, compute.address)
        finally:
            compute.close()
            raylets.shutdown()
        local = run_mode(folder, "dispatch-local", "local", args.config, args.overrides)
    compared = compare(pool, local)
    common = {
        "config": args.config,
        "overrides": args.overrides,
        "order": "after a warm-up run off the clock (" + " ".join(WARM_UP_OVERRIDES) + "), pool first, then "
        "local; the local run pays its embedded Ray's start inside its wall",
        "cluster": f"ray.cluster_utils: a head and {POOL_NODES} nodes of pool {POOL} ({NODE_CPUS} CPUs each), on 127.0.0.1",
        "cpu_count": os.cpu_count(),
    }
    write_result(
        f"{BENCH_NAME}.pipeline",
        value=pool["wall_s"],
        baseline=local["wall_s"],
        target=PIPELINE_TARGET,
        unit="s",
        details={
            **common,
            "encoding": "value = the pipeline's wall on the joined 3-node cluster's pool, baseline = on the "
            "embedded default",
            "cluster_start_s": round(cluster_start_s, 1),
            "peak_rss_gib": {"pool": pool["peak_rss_gib"], "local": local["peak_rss_gib"]},
        },
    )
    write_result(
        BENCH_NAME,
        value=compared["median_dispatch_s"],
        baseline=1.0,
        target=DISPATCH_TARGET,
        unit="s",
        details={
            **common,
            "encoding": "value = median over stages of (pool wall - embedded wall) in seconds, baseline = 1 s",
            "median_non_body_dispatch_s": compared["median_non_body_dispatch_s"],
            "pipeline_wall_s": {"pool": pool["wall_s"], "local": local["wall_s"]},
            "stages": compared["stages"],
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
