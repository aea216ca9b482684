"""Benchmark: what running a launch as a Ray gang costs over launching it directly, and Ray's start-up.

    python -m bench.ray_gang                 # ~2 min on 2 cores
    python -m bench.ray_gang --repeats 9

In one process: the embedded Ray cluster is started (forge_core.compute.cluster.connect: loopback only, token
auth), then the same one-node torchrun launch of bench/_dist_hello.py (join a gloo group, all-reduce, exit)
runs alternately (bench.harness.interleave) two ways:

- direct: `forge_core.launch.launch(spec)` in this process, as the local runner does;
- gang: a `forge_core.compute.gang.Gang` of one node: a placement group, a node agent actor, the same launch
  run by the agent, its log lines and result streamed back through Ray, the actor and group removed after.

Result `ray_gang`: value = median(gang) - median(direct) in seconds, baseline = 1 s, so ratio = seconds of
overhead per attempt; target <= 1. Details: both sides' times, Ray's start-up time, the medians.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from bench.harness import interleave, median, write_result
from forge_core.compute.cluster import connect
from forge_core.compute.gang import Gang, GangRequest
from forge_core.launch import LaunchSpec, Outcome, launch

BENCH_NAME = "ray_gang"
TARGET = "<=1"
REPO_ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args(argv)

    cluster = connect(None, num_cpus=4)
    pythonpath = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    spec = LaunchSpec("bench._dist_hello", [], nproc_per_node=1, env={"PYTHONPATH": pythonpath})

    def direct() -> None:
        result = launch(spec, log=lambda _line: None)
        assert result.outcome is Outcome.SUCCESS, result.reason

    def gang() -> None:
        attempt = Gang(cluster, GangRequest(None), spec, lambda _line: None, wait_s=120, name="bench")
        attempt.start()
        result = attempt.wait(600)
        assert result is not None and result.outcome is Outcome.SUCCESS, result

    try:
        times = interleave({"direct": direct, "gang": gang}, warmup=args.warmup, repeats=args.repeats)
    finally:
        cluster.close()
    direct_s, gang_s = median(times["direct"]), median(times["gang"])
    return write_result(
        BENCH_NAME,
        value=gang_s - direct_s,
        baseline=1.0,
        target=TARGET,
        unit="s",
        details={
            "encoding": "value = median(gang) - median(direct) seconds per attempt, baseline = 1 s",
            "ray_start_s": round(cluster.start_s, 2),
            "direct_s": [round(t, 2) for t in times["direct"]],
            "gang_s": [round(t, 2) for t in times["gang"]],
            "direct_median_s": round(direct_s, 2),
            "gang_median_s": round(gang_s, 2),
            "cpu_count": os.cpu_count(),
            "launch": "one node, one torchrun rank: gloo group, one all-reduce (bench/_dist_hello.py)",
        },
    )


if __name__ == "__main__":
    main(sys.argv[1:])
