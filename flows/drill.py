"""The drill flow: a ladder of cluster sizes, at each the same workload run clean and then once per fault of the
plan, with recovery, consistency and node health measured, judged and reported.

    forgeflow drill configs/drills/ci.yaml                     # simulated nodes on this machine
    forgeflow drill configs/drills/ladder.yaml --out runs/drill
    forgeflow drill configs/drills/ci.yaml --judge runs/drill/drill.json   # judge a recorded drill again
    prefect deployment run 'drill/nightly'                     # as a scheduled deployment

Every run is a `post_train` subflow on its own storage prefix (nothing is shared between runs, so no stage is
a cache hit). A fault's run gets the fault's FORGE_FAULT entries and its injector on a thread; after the run the
drill waits for its processes, actors and placement groups to be gone and brings the cluster back to the step's
size. The record (`drill.json`), the report (`drill.md`) and the plots go to the output folder and to the flow
run's artifacts; the flow fails when the verdict does (forge_core.drills.report).
"""

from __future__ import annotations

import os
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.artifacts import create_image_artifact, create_markdown_artifact, create_table_artifact

from flows.post_train import post_train
from flows.task_runs import settled_task_runs
from forge_core.compute.simulated import JoinedCluster, SimulatedCluster
from forge_core.config import ConfigError, RunConfig, load_config
from forge_core.drills.faults import injector_for
from forge_core.drills.health import HealthSampler
from forge_core.drills.measure import fault_metrics, node_health, stage_rows, workload_metrics
from forge_core.drills.plan import DrillFault, DrillPlan, LadderStep, load_plan, pool_stages
from forge_core.drills.report import CLEAN, judge, scaling, write_report
from forge_core.faults import FAULT_ENV, FAULT_ONCE_ENV
from forge_core.stages import all_stages
from forge_core.storage import ObjectStore
from forge_core.timings import DRILL_POLL_S


class DrillFailed(RuntimeError):
    """The verdict: every problem of the drill, one per line."""


def workload_config(plan: DrillPlan, step: LadderStep, extra: list[str] = ()) -> RunConfig:
    return load_config(plan.config, workload_overrides(plan, step, extra))


def workload_overrides(plan: DrillPlan, step: LadderStep, extra: list[str] = ()) -> list[str]:
    """Every stage on the drill's pool, then the plan's, the step's and the run's own overrides."""
    return [*(f"launch.{stage}.pool={plan.pool}" for stage in pool_stages()), *plan.overrides, *step.overrides, *extra]


def check_workload(plan: DrillPlan) -> None:
    """Each step's run config, and what each fault needs of it, before any node starts.

    Raises:
        ValueError: every problem, each naming the key, the value and the fix.
    """
    problems = []
    for step in plan.steps:
        try:
            cfg = workload_config(plan, step)
        except ConfigError as exc:
            problems += [f"steps (nodes={step.nodes}): {e}" for e in exc.errors]
            continue
        for fault in plan.faults:
            problems += [f"faults {fault.label} at {step.nodes} nodes: {p}" for p in _fault_needs(fault, cfg, step)]
    if problems:
        raise ValueError("the drill's workload cannot run its faults:\n" + "\n".join(f"  - {p}" for p in problems))


def _fault_needs(fault: DrillFault, cfg: RunConfig, step: LadderStep) -> list[str]:
    needs = []
    if fault.kind == "node_lost" and fault.target in ("sft", "grpo"):
        launch = getattr(cfg.launch, fault.target)
        if launch.retries < 1:
            needs.append(f"launch.{fault.target}.retries={launch.retries}: the retry is the recovery; set it to 1 or more")
        if launch.nnodes < 2:
            needs.append(f"launch.{fault.target}.nnodes={launch.nnodes}: the lost node is the stage's second; use 2")
        if launch.nnodes >= step.nodes:
            needs.append(f"launch.{fault.target}.nnodes={launch.nnodes}: leaves no spare of {step.nodes} nodes to retry on")
        if fault.target == "sft" and fault.at >= cfg.sft.steps:
            needs.append(f"at={fault.at}: SFT takes sft.steps={cfg.sft.steps} steps; strike before the last")
    if fault.target == "rollout" and fault.kind in ("node_lost", "engine_killed"):
        if cfg.rollout.num_engines < 2:
            needs.append(f"rollout.num_engines={cfg.rollout.num_engines}: a lost engine's prompts need another; use 2")
        if cfg.rollout.engine_lifetime != "flow":
            needs.append("rollout.engine_lifetime=stage: the drill strikes the run's engine actors; use flow")
    return needs


def open_cluster(plan: DrillPlan):
    if plan.ray_address is None:
        return SimulatedCluster.start(plan.pool, plan.node.cpus, plan.node.gpus)
    return JoinedCluster.join(plan.ray_address, plan.pool, plan.spare_wait_s)


def run_drill(plan: DrillPlan, cluster, folder: Path, plan_overrides: list[str] = ()) -> dict:
    """Climb the ladder on `cluster`, judge and report; returns the record (also in `folder`/drill.json)."""
    check_workload(plan)
    logger = get_run_logger()
    record = {"plan": plan.model_dump(), "plan_overrides": list(plan_overrides), "cluster": cluster.describe(),
              "kind": cluster.kind, "overrides": plan.overrides, "started_at": time.time(), "steps": []}  # fmt: skip
    for step in plan.steps:
        began = time.monotonic()
        cluster.resize(step.nodes)
        logger.info("drill step: %d nodes ready in %.1f s", step.nodes, time.monotonic() - began)
        runs = [_run(plan, cluster, step, None, folder)]
        runs += [_run(plan, cluster, step, fault, folder) for fault in plan.faults]
        record["steps"].append({"nodes": step.nodes, "ready_s": time.monotonic() - began, "runs": runs})
    record["ended_at"] = time.time()
    record["scaling"] = scaling(record)
    record["problems"] = judge(record, plan)
    record["passed"] = not record["problems"]
    report = write_report(record, folder)
    _publish(record, report)
    return record


def _run(plan: DrillPlan, cluster, step: LadderStep, fault: DrillFault | None, folder: Path) -> dict:
    """One run of the step's workload, clean (`fault` None) or with the fault; its record."""
    logger = get_run_logger()
    name = fault.label if fault else CLEAN
    run_dir = (folder / f"n{step.nodes}" / name.replace("@", "-")).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    extra = [f"storage.root={_run_root(plan, step, run_dir)}", f"logging.dir={run_dir / 'logs'}",
             f"name={plan.name}-n{step.nodes}-{name.replace('@', '-').replace('_', '-')}"]  # fmt: skip
    overrides = workload_overrides(plan, step, extra)
    store = ObjectStore.from_config(load_config(plan.config, overrides).storage)
    injector = injector_for(fault, cluster, run_dir / "fault-once") if fault else None
    skipped = injector.unavailable() if injector is not None else None
    if skipped:
        logger.warning("drill %s at %d nodes skipped: %s", name, step.nodes, skipped)
        return {"name": name, "skipped": skipped}
    logger.info("drill run %s at %d nodes: start", name, step.nodes)
    summary, error, stop = None, None, threading.Event()
    thread = threading.Thread(target=injector.run, args=(stop,), daemon=True) if injector else None
    saved = {key: os.environ.get(key) for key in (FAULT_ENV, FAULT_ONCE_ENV)}
    started = time.time()
    with HealthSampler(cluster, plan.health_every_s) as health:
        try:
            if injector is not None:
                os.environ[FAULT_ENV], os.environ[FAULT_ONCE_ENV] = injector.fault_entry(), str(run_dir / "fault-once")
                thread.start()
            summary = post_train(plan.config, overrides)
        except Exception as exc:  # noqa: BLE001 - a failed run is a finding of the drill, recorded and judged
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        finally:
            _restore(saved)
            stop.set()
            if thread is not None and thread.is_alive():
                thread.join()
    ended = time.time()
    leftovers = _leftovers_after(cluster, plan.leftover_wait_s)
    cluster.resize(step.nodes)  # a lost node's replacement, before the next run
    run = {"name": name, "started_at": started, "ended_at": ended, "wall_s": ended - started, "error": error,
           "leftovers": leftovers, "samples": health.samples, "health": node_health(health.samples, ended),
           "store_root": store.root}  # fmt: skip
    if summary is not None:
        run.update(_measured(summary, store, fault, injector))
    logger.info("drill run %s at %d nodes: %s in %.1f s", name, step.nodes, error or "done", run["wall_s"])
    return run


def _measured(summary: dict, store: ObjectStore, fault: DrillFault | None, injector) -> dict:
    stages = stage_rows(summary, store)
    workload = workload_metrics(summary, store)
    measured = {"flow_run_id": summary["flow_run_id"], "stages": stages, "workload": workload}
    if fault is not None:
        attempts = _attempts(summary["flow_run_id"], len(stages))
        measured["fault"] = {**fault_metrics(fault, injector.strike, stages, workload, attempts, store),
                             "bound_s": fault.recover_within_s}  # fmt: skip
    return measured


def _attempts(flow_run_id: str, count: int) -> dict[str, int]:
    """Per stage name, the most runs any of its task runs took (1: no retry)."""
    by_task = {stage.name: stage.task_name for stage in all_stages()}
    runs = settled_task_runs(flow_run_id, count)
    return {stage: max((r.run_count for r in runs if r.name.rsplit("-", 1)[0] == task), default=0)
            for stage, task in by_task.items()}  # fmt: skip


def _run_root(plan: DrillPlan, step: LadderStep, run_dir: Path) -> str:
    """A fresh storage root per run: under the run's folder for a local store, else a prefix of the plan's."""
    root = workload_config(plan, step).storage.root
    if "://" not in root or root.startswith("file://"):
        return f"file://{run_dir / 'store'}"
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    return f"{root.rstrip('/')}/drills/{plan.name}-{stamp}/{run_dir.parent.name}-{run_dir.name}"


def _leftovers_after(cluster, wait_s: float) -> list[str]:
    deadline = time.monotonic() + wait_s
    while (left := cluster.leftovers()) and time.monotonic() < deadline:
        time.sleep(DRILL_POLL_S)
    return left


def _restore(saved: dict[str, str | None]) -> None:
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _publish(record: dict, report: Path) -> None:
    create_markdown_artifact(markdown=report.read_text(), key="drill-report", description="drill report")
    rows = [{"nodes": step["nodes"], "run": run["name"], "wall_s": round(run.get("wall_s", 0.0), 1),
             "recover_s": (run.get("fault") or {}).get("recover_s"), "error": run.get("error") or run.get("skipped") or ""}
            for step in record["steps"] for run in step["runs"]]  # fmt: skip
    create_table_artifact(table=rows, key="drill-runs", description="every run of the drill")
    for plot in record.get("plots", []):
        create_image_artifact(image_url=(report.parent / plot).resolve().as_uri(), description=plot)


def default_folder(plan: DrillPlan) -> Path:
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    return Path(load_config(plan.config, plan.overrides).logging.dir) / "drills" / f"{plan.name}-{stamp}"


@flow(name="drill", log_prints=True)
def drill(plan: str = "configs/drills/ci.yaml", overrides: list[str] | None = None, out: str | None = None) -> dict:
    """Run the drill `plan` (a YAML file, `key=value` overrides applied) and report to `out` (default:
    <logging.dir>/drills/<name>-<time>). Fails, after writing the report, when the verdict does."""
    drill_plan = load_plan(plan, overrides or [])
    folder = Path(out) if out else default_folder(drill_plan)
    cluster = open_cluster(drill_plan)
    try:
        record = run_drill(drill_plan, cluster, folder, overrides or [])
    finally:
        cluster.close()
    if not record["passed"]:
        raise DrillFailed(f"drill {drill_plan.name} failed ({folder / 'drill.md'}):\n" + "\n".join(record["problems"]))
    return record
