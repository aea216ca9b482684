"""Benchmark: how much of the post-training flow's wall time goes to orchestration rather than stage work.

    python -m bench.orchestration_overhead            # tiny pipeline: 2 measured runs
    python -m bench.orchestration_overhead --warmup 1 --repeats 3 sft.steps=40   # config overrides

Runs the real `post-train` flow in this process on Prefect's local API (the ephemeral SQLite server Prefect
starts for a process without PREFECT_API_URL, in a private PREFECT_HOME), each run on a fresh local store so
that every stage really launches. A trivial flow first starts the API server and warms Prefect's client
and task engine (once-per-process costs); `--warmup N` adds N untimed full runs. Each measured run's wall
time (around the `post_train` call) splits into:

- stage work: the workers' own body time, `wall_s` in each committed stage manifest (from the worker
  scaffold's start of the stage to its commit, so without interpreter and torch/vLLM import start-up);
- process start-up: per stage, the launcher's duration minus that body time (torchrun, interpreter and
  imports, rendezvous, process exit); the launch duration is read back from the stage task's own log line
  (`<stage>: SUCCESS in <s>s`) through the Prefect API. The embedded Ray cluster's start falls inside the
  first stage's launch; its shutdown at the flow's end (the flow's `shut down the run's embedded Ray cluster
  in <s> s` line) is counted here too, as the cluster's process exit;
- orchestration: everything else (flow and task runs, API calls, log shipping, planning, spec writing,
  commit checks, UI artifacts, the report).

Result: value = orchestration seconds, baseline = wall seconds minus process start-up, both summed over
the measured runs, so ratio = the orchestration fraction of the wall time that is not process start-up;
target <= 0.05. Start-up is reported separately in details (it is what the fast loop removes), and so is
the vLLM engine start inside the rollout/evaluate bodies (`engine_startup_s` in their manifests), with the
fraction the target would see if that start counted as start-up too.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench._flow_runs import isolate_prefect, read_task_runs, warm_up_api
from bench.harness import write_result

# Prefect itself is imported only after isolate_prefect has pointed it at a private home.
BENCH_NAME = "orchestration_overhead"
TARGET = "<=0.05"
DEFAULT_CONFIG = "configs/tiny_test.yaml"
# tasks/stages.py's line before a stage runs: "<stage>: running in <runner> -> <uri> (attempt <id>)".
_LAUNCH_START = re.compile(r"^(?P<stage>\w+): running in .+ -> (?P<uri>\S+) \(attempt \S+\)$")
_LAUNCH_END = re.compile(r"^(?P<stage>\w+): SUCCESS in (?P<seconds>[0-9.]+)s$")
# forge_core.run.resources' lines around the flow run's embedded Ray cluster.
_CLUSTER_START = re.compile(r"^started the run's embedded Ray cluster ")
_CLUSTER_STOP = re.compile(r"^shut down the run's embedded Ray cluster in (?P<seconds>[0-9.]+) s$")
LOG_WAIT_S = 60.0


@dataclass(frozen=True)
class StageSplit:
    label: str  # the task run's name: prepare_data-5c2, train_sft-f6d, ...
    uri: str
    task_s: float  # the task run, start to end, as the Prefect API recorded it
    launch_s: float  # the launcher's duration (0.1 s resolution, from the task's log)
    body_s: float  # the worker's own wall_s
    engine_startup_s: float  # part of body_s: vLLM engine start in rollout/evaluate (0 elsewhere)

    @property
    def startup_s(self) -> float:
        return self.launch_s - self.body_s


@dataclass(frozen=True)
class RunSplit:
    wall_s: float
    stages: list[StageSplit]
    cluster_stop_s: float = 0.0  # the embedded Ray cluster's shutdown at the flow's end (process exit)

    @property
    def work_s(self) -> float:
        return sum(s.body_s for s in self.stages)

    @property
    def startup_s(self) -> float:
        return sum(s.startup_s for s in self.stages) + self.cluster_stop_s

    @property
    def engine_startup_s(self) -> float:
        return sum(s.engine_startup_s for s in self.stages)

    @property
    def orchestration_s(self) -> float:
        return self.wall_s - sum(s.launch_s for s in self.stages) - self.cluster_stop_s

    def as_details(self) -> dict:
        return {
            "wall_s": round(self.wall_s, 2),
            "work_s": round(self.work_s, 2),
            "startup_s": round(self.startup_s, 2),
            "cluster_stop_s": round(self.cluster_stop_s, 2),
            "orchestration_s": round(self.orchestration_s, 2),
            "engine_startup_in_work_s": round(self.engine_startup_s, 2),
            "orchestration_fraction": round(self.orchestration_s / (self.wall_s - self.startup_s), 4),
            "stages": [
                {
                    k: round(v, 2) if isinstance(v, float) else v
                    for k, v in {**asdict(s), "startup_s": s.startup_s}.items()
                }
                for s in self.stages
            ],
        }


@dataclass(frozen=True)
class Launch:
    uri: str
    seconds: float


async def _read_all_logs(client, flow_run_id) -> list:
    """Every log line of the flow run, oldest first (the API pages them)."""
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort

    logs: list = []
    while True:
        page = await client.read_logs(
            log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])),
            sort=LogSort.TIMESTAMP_ASC,
            limit=200,
            offset=len(logs),
        )
        logs += page
        if len(page) < 200:
            return logs


def launches_from_logs(logs: list) -> dict:
    """{task run id: Launch} from each stage task's `launching -> <uri>` and `SUCCESS in <s>s` log lines."""
    uri_by_task: dict = {}
    seconds_by_task: dict = {}
    for log in logs:
        if (start := _LAUNCH_START.match(log.message)) is not None:
            uri_by_task[log.task_run_id] = start["uri"]
        elif (end := _LAUNCH_END.match(log.message)) is not None:
            seconds_by_task[log.task_run_id] = float(end["seconds"])
    return {
        task: Launch(uri, seconds_by_task[task])
        for task, uri in uri_by_task.items()
        if task in seconds_by_task
    }


def cluster_stop_seconds(logs: list) -> float | None:
    """The embedded cluster's shutdown seconds from the flow's log; 0 when the run joined a cluster (it never
    started one), None while the line has not reached the API yet."""
    if not any(_CLUSTER_START.match(log.message) for log in logs):
        return 0.0
    stops = [float(stop["seconds"]) for log in logs if (stop := _CLUSTER_STOP.match(log.message))]
    return stops[-1] if stops else None


def read_stage_runs(flow_run_id: str) -> tuple[list, dict, float]:
    """(the flow run's task runs by start time, {task run id: Launch}, the embedded cluster's shutdown
    seconds), once every task run's launch lines and the flow's shutdown line have reached the API (logs travel
    from a background worker: flush it, then poll)."""
    from prefect.client.orchestration import get_client
    from prefect.logging.handlers import APILogHandler

    async def read_logs() -> list:
        async with get_client() as client:
            return await _read_all_logs(client, flow_run_id)

    APILogHandler().flush()
    deadline = time.monotonic() + LOG_WAIT_S
    while True:
        task_runs, logs = read_task_runs(flow_run_id), asyncio.run(read_logs())
        launches, cluster_stop_s = launches_from_logs(logs), cluster_stop_seconds(logs)
        missing = [run.name for run in task_runs if run.id not in launches]
        if not missing and cluster_stop_s is not None:
            return task_runs, launches, cluster_stop_s
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"flow run {flow_run_id}: after {LOG_WAIT_S:.0f}s still no 'running in ... -> <uri>' and "
                f"'SUCCESS in <s>s' log lines for task runs {missing}, or no 'shut down the run's embedded Ray "
                "cluster' line (forge_core.run.resources) for a run that started one; a stage was skipped (the "
                "store is fresh, so it should not be) or those lines changed"
            )
        time.sleep(1.0)


def body_seconds(store, uri: str) -> tuple[float, float]:
    """(the worker's wall_s, the vLLM engine start-up inside it) from the stage's committed manifest."""
    metrics = store.read_manifest(uri).metrics
    if "wall_s" not in metrics:
        raise RuntimeError(f"{uri}: the manifest metrics have no wall_s; the stage's worker must record it")
    return float(metrics["wall_s"]), float(metrics.get("engine_startup_s", 0.0))


def measure_run(config: str, overrides: list[str], store_root: str) -> RunSplit:
    """One full pipeline on a fresh store, split into stage work, start-up and orchestration."""
    from flows.post_train import post_train
    from forge_core.config import load_config
    from forge_core.storage import ObjectStore

    run_overrides = [*overrides, f"storage.root={store_root}"]
    started = time.perf_counter()
    summary = post_train(config, run_overrides)
    wall_s = time.perf_counter() - started

    store = ObjectStore.from_config(load_config(config, run_overrides).storage)
    task_runs, launches, cluster_stop_s = read_stage_runs(summary["flow_run_id"])
    stages = [
        StageSplit(
            run.name,
            launches[run.id].uri,
            (run.end_time - run.start_time).total_seconds(),
            launches[run.id].seconds,
            *body_seconds(store, launches[run.id].uri),
        )
        for run in task_runs
    ]
    return RunSplit(wall_s, stages, cluster_stop_s)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.orchestration_overhead", description=__doc__.split("\n")[0]
    )
    parser.add_argument("overrides", nargs="*", help="key=value config overrides, e.g. sft.steps=40")
    parser.add_argument("--config", default=DEFAULT_CONFIG, help=f"YAML config (default {DEFAULT_CONFIG})")
    parser.add_argument("--warmup", type=int, default=0, help="untimed full runs first (default 0)")
    parser.add_argument("--repeats", type=int, default=2, help="measured full runs (default 2)")
    args = parser.parse_args(argv)
    if args.warmup < 0 or args.repeats < 1:
        parser.error(f"--warmup={args.warmup} --repeats={args.repeats}: need warmup >= 0 and repeats >= 1")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = _parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="forge-bench-orch-") as tmp:
        workdir = Path(tmp)
        isolate_prefect(workdir / "prefect-home")
        overrides = [*args.overrides, f"logging.dir={workdir / 'runs'}"]
        warm_up_api()
        for index in range(args.warmup):
            measure_run(args.config, overrides, f"file://{workdir}/warmup-{index}")
        runs = [
            measure_run(args.config, overrides, f"file://{workdir}/run-{index}")
            for index in range(args.repeats)
        ]

    orchestration_s = sum(run.orchestration_s for run in runs)
    non_startup_s = sum(run.wall_s - run.startup_s for run in runs)
    return write_result(
        BENCH_NAME,
        value=orchestration_s,
        baseline=non_startup_s,
        target=TARGET,
        unit="s",
        details={
            "encoding": (
                "value = orchestration s (wall - launcher durations), baseline = wall - process start-up s, "
                "summed over the measured runs; ratio = orchestration fraction of the non-start-up wall time"
            ),
            "config": args.config,
            "overrides": args.overrides,
            "warmup_runs": args.warmup,
            "wall_s": round(sum(run.wall_s for run in runs), 2),
            "work_s": round(sum(run.work_s for run in runs), 2),
            "startup_s": round(sum(run.startup_s for run in runs), 2),
            "cluster_stop_s": round(sum(run.cluster_stop_s for run in runs), 2),
            "startup_fraction_of_wall": round(
                sum(run.startup_s for run in runs) / sum(run.wall_s for run in runs), 4
            ),
            # vLLM's engine start sits inside the rollout/evaluate bodies; counted as start-up instead:
            "orchestration_fraction_if_engine_startup_were_startup": round(
                orchestration_s / (non_startup_s - sum(run.engine_startup_s for run in runs)), 4
            ),
            "runs": [run.as_details() for run in runs],
        },
    )


if __name__ == "__main__":
    main(sys.argv[1:])
