"""Benchmark: what placing stages on the workers of their pools (launch.placement=pool) costs against running
them on the flow's machine (launch.placement=local), on the demo pipeline, in one run.

    python -m bench.stage_dispatch                  # the demo config: ~30 min on 2 cores
    python -m bench.stage_dispatch --config configs/tiny_test.yaml sft.steps=4     # a smoke run

One cluster of real processes on this machine (tests/cluster/cluster.py): a Prefect server on loopback, the
pools `cpu-small` and `gpu-a` with one process worker each, the pipeline pool `local-cpu` with one, every worker
as on a node of its own (own HOME, TMPDIR, working folder), a moto S3 server as the only store. The same
pipeline (the `post-train` deployment, same config and seed) runs twice as a deployment run on the pipeline
pool's worker, each on a fresh store prefix so that every stage really runs:

- pool: prepare on cpu-small, every other stage on gpu-a (one node each, as the config says);
- local: every stage on the flow's machine (the pipeline worker), the engines and the trainer per stage too.

Both runs use the stage lifetimes (a rollout engine and a GRPO launch per stage), the per-stage dispatch this
benchmark is about. The pool run goes first, so that whatever a first run pays (cold file caches) counts against
placement. Two more runs use the config's own lifetimes (the demo's: one engine and one trainer job for the whole
run), placed (the engines' and the trainer's residents on their pools' workers, forge_core.run.resident; GRPO on
cpu-small there, whose one worker is free after prepare, since each resident holds a worker) and then local:
the details give their walls, ratio and per-stage medians (`--no-flow-lifetimes` skips them).

Results (two files):
- `stage_dispatch`: value = the median over the pipeline's stages of (the stage's wall in the pool run minus
  the same stage's wall in the local run), baseline = 1 s, so ratio = seconds; target <= 3. A stage's wall is
  its row of the `post-train-stages` table artifact (the flow's clock around the stage task). Details also
  give each stage's walls, its body (`wall_s` of its manifest), and the same median over the non-body part
  (wall minus body), which does not see the body's own run-to-run noise.
- `stage_dispatch.pipeline`: value = the pool run's wall, baseline = the local run's (each flow run's start
  to end as the Prefect API recorded it); target ratio <= 1.2.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import write_result

BENCH_NAME = "stage_dispatch"
DISPATCH_TARGET = "<=3"
PIPELINE_TARGET = "<=1.2"
DEFAULT_CONFIG = "configs/demo_cpu.yaml"
RUN_TIMEOUT_S = 3600.0
STAGE_LIFETIMES = ["rollout.engine_lifetime=stage", "grpo.trainer_lifetime=stage"]
TRAINING_STAGES = ("sft", "rollout", "grpo", "evaluate")
# With the flow lifetimes placed, each resident holds a worker: the trainer's goes to cpu-small (free after prepare).
FLOW_LIFETIMES_PLACED = ["launch.grpo.pool=cpu-small"]


def placement_overrides(mode: str) -> list[str]:
    """`pool`: prepare on cpu-small, the rest on gpu-a; `local`: the flow's machine."""
    if mode == "local":
        return ["launch.placement=local"]
    return [
        "launch.placement=pool",
        "launch.prepare.pool=cpu-small",
        *(f"launch.{stage}.pool=gpu-a" for stage in TRAINING_STAGES),
    ]


def run_mode(cluster, name: str, mode: str, config: str, extra: list[str]) -> dict:
    """One pipeline run named `name` in placement `mode` on its own store prefix; its wall, stage rows and the
    bodies' wall_s."""
    from tests.cluster.cluster import POST_TRAIN

    overrides = [
        f"storage.root={cluster.store_root(name)}",
        f"storage.endpoint_url={cluster.s3_endpoint}",
        f"name={name}",
        *placement_overrides(mode),
        *extra,
    ]
    print(f"[{BENCH_NAME}] {name}: starting {config} {' '.join(overrides)}", flush=True)
    started = time.monotonic()
    run_id = cluster.run_pipeline(POST_TRAIN, overrides, config=config)
    run = cluster.wait_flow_run(run_id, timeout_s=RUN_TIMEOUT_S)
    wall_s = (run.end_time - run.start_time).total_seconds()
    print(f"[{BENCH_NAME}] {name}: {wall_s:.1f} s of flow run ({time.monotonic() - started:.1f} s here)", flush=True)
    store = cluster.store(name)
    stages = {}
    for row in cluster.table(run_id, "post-train-stages"):
        manifest = store.read_manifest(row["artifact"])
        stages[row["stage"]] = {
            "wall_s": float(row["duration_s"]),
            "body_s": round(float(manifest.metrics["wall_s"]), 2),
            "where": row["where"],
        }
    return {"flow_run_id": run_id, "wall_s": round(wall_s, 1), "stages": stages}


def run_flow_lifetimes(cluster, config: str, extra: list[str]) -> dict:
    """The config's own lifetimes, placed then local: walls, ratio, per-stage medians, or the error (details)."""
    from tests.cluster.cluster import ClusterError

    try:
        pool = run_mode(cluster, "dispatch-pool-flow", "pool", config, [*FLOW_LIFETIMES_PLACED, *extra])
        local = run_mode(cluster, "dispatch-local-flow", "local", config, extra)
    except ClusterError as exc:
        return {"error": str(exc).splitlines()[0]}
    compared = compare(pool, local)
    return {
        "pool_wall_s": pool["wall_s"],
        "local_wall_s": local["wall_s"],
        "pool_over_local": round(pool["wall_s"] / local["wall_s"], 3),
        "median_dispatch_s": compared["median_dispatch_s"],
        "median_non_body_dispatch_s": compared["median_non_body_dispatch_s"],
        "flow_runs": {"pool": pool["flow_run_id"], "local": local["flow_run_id"]},
        "stages": compared["stages"],
    }


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


def start_store():
    """A moto S3 server on loopback with fake credentials in this environment (the workers inherit them)."""
    from tests.conftest import AWS_ENV_UNSET, FAKE_AWS_ENV, RestartableMotoServer, free_port

    os.environ.update(FAKE_AWS_ENV)
    for name in AWS_ENV_UNSET:
        os.environ.pop(name, None)
    server = RestartableMotoServer(free_port())
    server.start()
    return server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="pipeline config, relative to the repository")
    parser.add_argument("--no-flow-lifetimes", action="store_true", help="skip the two runs with the flow lifetimes")
    parser.add_argument("overrides", nargs="*", help="config overrides for every run (key=value)")
    args = parser.parse_args(argv)

    from tests.cluster.cluster import PIPELINE_POOL, Cluster

    with tempfile.TemporaryDirectory(prefix="forge-bench-dispatch-") as tmp:
        server = start_store()
        cluster = Cluster(Path(tmp), server.endpoint_url, {"cpu-small": 1, "gpu-a": 1, PIPELINE_POOL: 1})
        try:
            cluster.start()
            pool = run_mode(cluster, "dispatch-pool", "pool", args.config, [*STAGE_LIFETIMES, *args.overrides])
            local = run_mode(cluster, "dispatch-local", "local", args.config, [*STAGE_LIFETIMES, *args.overrides])
            flow = None if args.no_flow_lifetimes else run_flow_lifetimes(cluster, args.config, args.overrides)
        finally:
            survivors = cluster.stop()
            server.close()
    compared = compare(pool, local)
    common = {
        "config": args.config,
        "overrides": [*STAGE_LIFETIMES, *args.overrides],
        "order": "pool first, then local (a first run's cold caches count against placement)",
        "workers": {"cpu-small": 1, "gpu-a": 1, "local-cpu (pipelines)": 1},
        "survivors_after_stop": [str(p) for p in survivors],
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
            "encoding": "value = the pipeline's wall with launch.placement=pool, baseline = with local",
            "pool_flow_run": pool["flow_run_id"],
            "local_flow_run": local["flow_run_id"],
            "with_config_lifetimes": flow,
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
            "encoding": "value = median over stages of (pool wall - local wall) in seconds, baseline = 1 s",
            "median_non_body_dispatch_s": compared["median_non_body_dispatch_s"],
            "pipeline_wall_s": {"pool": pool["wall_s"], "local": local["wall_s"]},
            "stages": compared["stages"],
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
