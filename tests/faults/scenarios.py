"""The expensive runs of the fault suite, each shared by several tests (session fixtures in conftest.py).

1. `FlowToKill`: the tiny pipeline as its own flow process (`python -m flows.post_train`, on the session's
   Prefect API); GRPO rank 1 hangs after step 2 (FORGE_FAULT=hang_rank:1:2@grpo), then the flow process is
   SIGKILLed. Its prepare/SFT/eval/rollout stages ran uninterrupted: they are the reference for the faulted
   runs. Being a process of its own, it starts with the session and runs while the cheap tests and
   scenario 4 run in this process (see conftest.py).
2. `FlowRerunProcess`: the same flow again, as a new flow process: it must drop the first run's stale launch
   records (its launch ended itself: forge_core.launch.owner), skip what was committed and resume GRPO from
   its checkpoint. It runs while scenario 3 does (mostly while
   scenario 3's hung SFT attempt waits out its deadline).
3. `faulted_sft_and_rollout`: prepare -> SFT -> rollout as Prefect tasks with retries, under three faults
   that fire once each: SFT rank 1 hangs at step 1 (the deadline must end it), then SFT rank 1 is SIGKILLed
   at step 3 while the test overwrites bytes of the committed step-2 checkpoint, then the rollout worker
   SIGKILLs its vLLM engine core mid-generation.
4. `s3_outage`: prepare -> SFT on moto S3 with fake credentials and storage.retry_horizon_s=900; the S3
   server stops four times, each time until the process it hit has provably outlasted the old retry budget
   (a call logged its 3rd retry; storage.retries=2 gave up there): on a request of the task process after the
   prepare worker committed (the commit check), then on its publishing read, then on the SFT task's planning,
   and finally on the SFT ranks' write of the step-4 checkpoint (the stage is retried and resumes from
   step 3). The test's own reads go to an observer port that never goes down.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import pytest
from fault_kit import (
    COMMON_OVERRIDES,
    TINY_CONFIG,
    CommitWatch,
    OutageMotoServer,
    ProcessWatch,
    SeenProcess,
    all_artifacts_text,
    all_logs,
    flip_bytes,
    flow_run,
    host_segments,
    mapped_segments,
    task_runs,
    worker_processes_under,
)
from prefect import flow

from flows.last_run import find_run
from forge_core.config import config_from_dict, config_to_json, load_config
from forge_core.storage import ObjectStore
from tasks import run_as_task, stage_task

REPO = Path(__file__).resolve().parents[2]
# Generous on purpose: the suite must pass on a loaded 2-core box; every wait ends early on success.
STAGE_WAIT_S = 1500


def file_overrides(root: Path, *more: str) -> list[str]:
    return [f"storage.root=file://{root}/store", f"logging.dir={root}/runs", *COMMON_OVERRIDES, *more]


def fault_env(root: Path, faults: str) -> dict[str, str]:
    return {
        "FORGE_FAULT": faults,
        "FORGE_FAULT_ONCE": str(root / "fault-fired"),
        "FORGE_LAUNCH_REGISTRY": str(root / "launches"),
    }


def fired(root: Path, index: int) -> bool:
    """Whether the `index`-th fault of `fault_env(root, ...)` has fired (its once-marker exists)."""
    return (root / ("fault-fired" + (f".{index}" if index else ""))).exists()


def saved_logs(flow_run_id, path: Path) -> list[str]:
    """A flow run's log messages, also written to `path` (to read after a failure)."""
    logs = all_logs(flow_run_id)
    path.write_text("\n".join(logs) + "\n")
    return logs


# ---- 1 + 2: the flow process SIGKILLed mid-GRPO, then run again ------------------------------------------


@dataclass
class KilledFlow:
    root: Path
    overrides: list[str]
    env: dict[str, str]
    output: str
    workers: list[SeenProcess]  # the flow's worker processes just before its SIGKILL
    orphans: list[SeenProcess]  # those still alive a second after it (their owner watchdog ends them)
    sft_launch_s: float  # how long the uninterrupted SFT launch took (sizes the hang test's deadline)
    wall_s: float  # from the flow process's start to its SIGKILL

    @property
    def store(self) -> ObjectStore:
        return ObjectStore(f"file://{self.root}/store")


class FlowToKill:
    """Scenario 1 in the background: the flow process runs while this process runs other tests; a thread
    SIGKILLs it once GRPO hangs. `result()` waits for that and returns the KilledFlow."""

    def __init__(self, root: Path, api_url: str) -> None:
        # The tiny policy earns the same reward on every sample, so GRPO would skip its steps (no gradient)
        # and the fault hook, which fires after optimizer steps, would never run: keep zero-variance groups.
        self.root = root
        self.overrides = file_overrides(root, "grpo.advantage.drop_zero_variance_groups=false")
        self.env = fault_env(root, "hang_rank:1:2@grpo")
        self.log_path = root / "flow-1.log"
        self._started = time.monotonic()
        with open(self.log_path, "w") as log:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "flows.post_train", TINY_CONFIG, *self.overrides],
                env={**os.environ, **self.env, "PREFECT_API_URL": api_url},
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO,
            )
        self._workers: list[SeenProcess] = []
        self._error: AssertionError | None = None
        self._wall_s = 0.0
        self._killer = threading.Thread(target=self._kill_once_grpo_hangs, daemon=True, name="flow-killer")
        self._killer.start()

    def _kill_once_grpo_hangs(self) -> None:
        proc = self._proc
        try:
            deadline = time.monotonic() + STAGE_WAIT_S
            while not fired(self.root, 0) and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.5)
            if not fired(self.root, 0):
                self._error = AssertionError(
                    f"GRPO never reached its hang (flow exit code {proc.poll()}); flow output tail:\n"
                    + self.log_path.read_text()[-4000:]
                )
                return
            time.sleep(1.0)  # rank 0 is now blocked in the step's collective, rank 1 sleeps
            self._workers = worker_processes_under(proc.pid)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            self._wall_s = time.monotonic() - self._started

    def wait_until_stage_done(self, stage: str) -> None:
        """Until the flow logged `<stage>: SUCCESS` (or died): what runs next then no longer competes with
        that stage for the cores."""
        while self._killer.is_alive() and f"{stage}: SUCCESS in" not in self.log_path.read_text():
            time.sleep(0.5)

    def result(self) -> KilledFlow:
        self._killer.join()
        if self._error is not None:
            raise self._error
        time.sleep(1.0)
        output = self.log_path.read_text()
        return KilledFlow(
            root=self.root,
            overrides=self.overrides,
            env=self.env,
            output=output,
            workers=list(self._workers),
            orphans=[p for p in self._workers if p.alive()],
            sft_launch_s=_launch_seconds(output, "sft"),
            wall_s=self._wall_s,
        )

    def close(self) -> None:
        """End the flow and whatever it left running, in case the re-run that should reap it never ran."""
        from forge_core.launch import reap_orphaned_launches

        if self._proc.poll() is None:
            self._proc.kill()
        self._killer.join()
        reap_orphaned_launches(Path(self.env["FORGE_LAUNCH_REGISTRY"]), grace_s=5)


def _launch_seconds(output: str, stage: str) -> float:
    match = re.search(rf"{stage}: SUCCESS in ([0-9.]+)s", output)
    assert match, f"no '{stage}: SUCCESS in ...' line in the flow output"
    return float(match.group(1))


@dataclass
class FlowRerun:
    state: object
    summary: dict
    committed_before: dict[str, str]  # artifact URI -> committed_at, before the rerun
    logs: list[str]
    task_runs: dict[str, object]
    wall_s: float


def committed_at_by_uri(store: ObjectStore, kinds: tuple[str, ...]) -> dict[str, str]:
    return {
        uri: store.read_manifest(uri).committed_at for kind in kinds for uri in store.list_committed(kind)
    }


class FlowRerunProcess:
    """Scenario 2 in the background: the killed flow run again as a new flow process, as an operator would;
    `result()` waits for it."""

    def __init__(self, killed: KilledFlow, api_url: str) -> None:
        self.killed = killed
        self.committed_before = committed_at_by_uri(killed.store, ("data", "sft", "eval", "rollouts", "grpo"))
        self.log_path = killed.root / "flow-2.log"
        self._started = time.monotonic()
        with open(self.log_path, "w") as log:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "flows.post_train", TINY_CONFIG, *killed.overrides],
                env={**os.environ, **killed.env, "PREFECT_API_URL": api_url},
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO,
            )
        self._ended: float | None = None
        self._waiter = threading.Thread(target=self._wait, daemon=True, name="flow-rerun-waiter")
        self._waiter.start()

    def _wait(self) -> None:
        self._proc.wait()
        self._ended = time.monotonic()

    def result(self) -> FlowRerun:
        self._waiter.join(timeout=STAGE_WAIT_S)
        if self._ended is None:
            self.close()
            raise AssertionError(f"the re-run did not end in {STAGE_WAIT_S} s; see {self.log_path}")
        wall_s = self._ended - self._started
        output = self.log_path.read_text()
        run_id = re.search(r"/flow-run/([0-9a-f-]{36})", output)
        assert run_id, (
            f"no flow run id in the re-run's output (exit code {self._proc.returncode}):\n{output[-4000:]}"
        )
        flow_run_id = run_id.group(1)
        return FlowRerun(
            state=flow_run(flow_run_id).state,
            summary=find_run(self.killed.root / "runs", flow_run_id) or {},
            committed_before=self.committed_before,
            logs=all_logs(flow_run_id),
            task_runs=task_runs(flow_run_id),
            wall_s=wall_s,
        )

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()


# ---- 3: SFT hang + kill + corrupt checkpoint, rollout engine kill ----------------------------------------

SFT_FAULTS = "hang_rank:1:1@sft,kill_rank:1:3@sft,kill_vllm:0@rollout"


@flow(name="faults-sft-rollout")
def sft_then_rollout(config_json: str) -> dict[str, str]:
    cfg = config_from_dict(json.loads(config_json))
    data_uri = run_as_task(cfg, "prepare", {})
    sft_uri = stage_task(cfg, "sft").with_options(retries=2, retry_delay_seconds=0)(cfg, "sft", {"data": data_uri})
    rollouts_uri = stage_task(cfg, "rollout").with_options(retries=1, retry_delay_seconds=0)(
        cfg, "rollout", {"policy": sft_uri, "data": data_uri}, {"iteration": 0, "policy_iteration": 0}
    )
    return {"data": data_uri, "sft": sft_uri, "rollouts": rollouts_uri}


@dataclass
class FaultedRun:
    root: Path
    deadline_s: float
    state: object
    uris: dict[str, str]
    logs: list[str]
    task_runs: dict[str, object]
    launch_ids: list[str]
    processes: list[SeenProcess]
    wall_s: float
    corrupted: list[str] = field(default_factory=list)  # "<checkpoint uri>/<file>" overwritten by the test
    # Shared-memory segments made during the run that outlived it with no process mapping them.
    orphan_segments: list[str] = field(default_factory=list)

    @property
    def store(self) -> ObjectStore:
        return ObjectStore(f"file://{self.root}/store")


def corrupt_after_commit(checkpoint_dir: Path) -> str:
    """Overwrite bytes in the middle of the largest file of a committed checkpoint (wherever the layout puts
    it, e.g. under its attempt's folder). Returns the file's path relative to the checkpoint."""
    files = (p for p in checkpoint_dir.rglob("*") if p.is_file() and p.name != "_MANIFEST.json")
    target = max(files, key=lambda p: p.stat().st_size)
    flip_bytes(target)
    return target.relative_to(checkpoint_dir).as_posix()


def faulted_sft_and_rollout(root: Path, deadline_s: float) -> FaultedRun:
    # kill_vllm needs an engine core process of its own to kill (an in-process engine would die with the
    # worker, and the worker could not report EngineDeadError).
    overrides = file_overrides(
        root, f"launch.sft.deadline_s={deadline_s:.0f}", "rollout.engine_in_process=false"
    )
    config_json = config_to_json(load_config(TINY_CONFIG, overrides))
    corrupted: list[str] = []
    stop = threading.Event()

    def corrupt_step2_once_rank1_is_killed() -> None:
        # The kill fires after step 3's update, when steps 1 and 2 are committed: corrupt step 2 before the
        # retry (seconds away: torchrun must notice, Prefect retry, a new torchrun start) looks at it.
        while not stop.is_set():
            if fired(root, 1):
                for step_dir in (root / "store" / "sft").glob("*/_checkpoints/step-2"):
                    corrupted.append(f"{step_dir}/{corrupt_after_commit(step_dir)}")
                return
            time.sleep(0.05)

    corrupter = threading.Thread(target=corrupt_step2_once_rank1_is_killed, daemon=True)
    with pytest.MonkeyPatch.context() as mp:
        for name, value in fault_env(root, SFT_FAULTS).items():
            mp.setenv(name, value)
        corrupter.start()
        segments_before = host_segments()
        started = time.monotonic()
        # Scenario 2's flow process may run meanwhile: watch only this scenario's launches (on the test run's Ray
        # cluster, below this process: their spec URIs hold this scenario's store root).
        with ProcessWatch(marker=str(root)) as watch:
            state = sft_then_rollout(config_json, return_state=True)
        wall_s = time.monotonic() - started
        stop.set()
        corrupter.join()
    flow_run_id = state.state_details.flow_run_id
    return FaultedRun(
        root=root,
        deadline_s=deadline_s,
        state=state,
        uris=state.result() if state.is_completed() else {},
        logs=saved_logs(flow_run_id, root / "flow.log"),
        task_runs=task_runs(flow_run_id),
        launch_ids=watch.launch_ids(),
        processes=list(watch.seen.values()),
        wall_s=wall_s,
        corrupted=corrupted,
        orphan_segments=sorted(host_segments() - segments_before - mapped_segments()),
    )


# ---- 4: S3 server down: in the task process (commit check, publishing, planning), then mid-checkpoint -----

# Recognisable fake secrets, planted in the environment of every process of this run; no output may show them.
FAKE_WANDB_API_KEY = "forge-fake-wandb-key-0123456789abcdef0123456789abcdef"
# The run's storage retries: the count the old policy had (2 quick retries, then StorageUnavailable) and a
# horizon far longer than any outage here, which all end within seconds of being observed.
OUTAGE_RETRIES = 2
OUTAGE_RETRY_BACKOFF_S = 0.1
OUTAGE_HORIZON_S = 900.0
# An outage lasts until a call of the task process has logged this retry: the old policy gave up one retry
# earlier, so the outage provably outlasted the old budget, however fast or slow the machine is.
RETRY_THAT_OUTLASTS = OUTAGE_RETRIES + 1
# Should the test's own wait break, the server comes back by itself after this.
OUTAGE_SAFETY_S = 900.0
_RETRY_NUMBER = re.compile(r"; retry (\d+)/\d+ in ")


@dataclass(frozen=True)
class PlannedOutage:
    name: str
    pattern: str  # the trigger's "<METHOD> <path>", a regex
    from_task_process: bool  # only a request of this (the task's) process triggers it
    after: str | None = None  # only once a request matching this came in


def planned_outages(bucket: str) -> list[PlannedOutage]:
    """In run order. The first three hit only the task process (no worker runs then); the last one hits the
    SFT ranks while they write the step-4 checkpoint (DCP's metadata, after every shard is written)."""
    b = re.escape(bucket)
    data_manifest = rf"/{b}/run/data/[^/ ]+/_MANIFEST\.json$"
    return [
        # After the prepare worker committed: the task's check that the output is committed.
        PlannedOutage("commit-wait", rf"^(HEAD|GET) {data_manifest}", True, after=rf"^PUT {data_manifest}"),
        # Then the task reads the committed manifest for the stage's Prefect artifacts.
        PlannedOutage("publishing", rf"^GET {data_manifest}", True),
        # The SFT task's first storage call: its new store checks the bucket (the call that failed first in an outage).
        PlannedOutage("planning", rf"^HEAD /{b}$", True),
        PlannedOutage(
            "checkpoint", rf"^PUT /{b}/run/sft/[^ ]*/_checkpoints/step-4/[^ ]*\.metadata(\.tmp)?$", False
        ),
    ]


@flow(name="faults-sft-on-s3")
def sft_on_s3(config_json: str) -> dict[str, str]:
    cfg = config_from_dict(json.loads(config_json))
    data_uri = stage_task(cfg, "prepare").with_options(retries=2, retry_delay_seconds=0)(cfg, "prepare", {})
    sft_uri = stage_task(cfg, "sft").with_options(retries=2, retry_delay_seconds=0)(cfg, "sft", {"data": data_uri})
    return {"data": data_uri, "sft": sft_uri}


class RetryLog(logging.Handler):
    """The storage retry warnings of this process (the task's: the flow runs here), in order."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []
        self._changed = threading.Condition()

    def emit(self, record: logging.LogRecord) -> None:
        with self._changed:
            self.messages.append(record.getMessage())
            self._changed.notify_all()

    def wait_for_retry(self, since: int, number: int, stop: threading.Event) -> list[str] | None:
        """The messages from index `since` on, once one of them is retry `number` (or later) of a call; None
        when `stop` is set (or STAGE_WAIT_S passes) first."""
        deadline = time.monotonic() + STAGE_WAIT_S
        with self._changed:
            while time.monotonic() < deadline and not stop.is_set():
                found = self.messages[since:]
                if any(int(m.group(1)) >= number for m in map(_RETRY_NUMBER.search, found) if m):
                    return found
                self._changed.wait(0.5)
        return None


class OutageDriver:
    """Runs `planned` in order on a thread: arms each outage, waits until it fired, keeps the server down until
    the task process has logged RETRY_THAT_OUTLASTS of one call, brings it back, arms the next. `done` (the
    flow ended) ends the wait for whatever outage is pending. `events[name]` is each outage's OutageEvent, its
    notes: `task_retries` (the task process's retry warnings from the trigger until the server came back),
    `outlasted_old_budget`, and what `on_down` / `on_up` add."""

    def __init__(
        self, server: OutageMotoServer, planned: list[PlannedOutage], retries: RetryLog, on_down, on_up
    ):
        self.server = server
        self.planned = planned
        self.retries = retries
        self._callbacks = (on_down, on_up)
        self.done = threading.Event()
        self.events: dict[str, object] = {}
        self._thread = threading.Thread(target=self._drive, daemon=True, name="outage-driver")

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self._thread.join()

    def _drive(self) -> None:
        for outage in self.planned:
            went_down = threading.Event()

            def on_down(event, outage=outage, went_down=went_down) -> None:
                event.notes["name"] = outage.name
                self._callbacks[0](event)
                went_down.set()

            since = len(self.retries.messages)  # the server is up until the trigger: no retries before it

            self.server.arm(
                outage.pattern,
                OUTAGE_SAFETY_S,
                on_down=on_down,
                on_up=self._callbacks[1],
                client_pid=os.getpid() if outage.from_task_process else None,
                after=outage.after,
            )
            while not went_down.wait(0.5):
                if self.done.is_set():
                    return  # the flow ended before this outage fired: the test reports it missing
            event = self.server.events[-1]
            retries = self.retries.wait_for_retry(since, RETRY_THAT_OUTLASTS, self.done)
            event.notes["outlasted_old_budget"] = retries is not None
            event.notes["task_retries"] = self.retries.messages[since:]
            self.server.end_outage()
            self.events[outage.name] = event


@dataclass
class OutageRun:
    root: Path
    store_root: str
    state: object
    uris: dict[str, str]
    task_runs: dict[str, object]
    logs: list[str]
    outages: dict[str, object]  # planned outage name -> fault_kit.OutageEvent, for those that fired
    task_pid: int  # the process the task-process outages had to come from (this one)
    violations: list[str]
    commits: object  # the fault_kit.CommitWatch that polled the store throughout
    committed_before_outage: dict[
        str, str
    ]  # artifact URI -> manifest sha256, seen as the checkpoint outage began
    committed_after: dict[str, str]  # the same, as read back after the run
    final_manifest_metrics: dict
    bucket_dump: Path  # every object of the bucket, copied to local files for the secret grep
    run_dir: Path
    state_messages: list[str]
    secrets: dict[str, str]
    wall_s: float  # of the flow run

    @property
    def outage(self):
        """The checkpoint outage (the worker-side one)."""
        return self.outages.get("checkpoint")


_outage_runs: dict[str, OutageRun] = {}


def s3_outage(root: Path, secrets: dict[str, str]) -> OutageRun:
    """Run once per session (tests/faults and tests/security both read it)."""
    if "run" not in _outage_runs:
        _outage_runs["run"] = _s3_outage(root, secrets)
    return _outage_runs["run"]


def _s3_outage(root: Path, secrets: dict[str, str]) -> OutageRun:
    server = OutageMotoServer().start()
    try:
        bucket = f"forge-faults-{uuid.uuid4().hex[:10]}"
        store_root = f"s3://{bucket}/run"
        # The test's own eyes use the observer port: it never goes down, and its requests trigger nothing.
        watch_store = ObjectStore(store_root, endpoint_url=server.observer_url, retries=0)
        watch_store.fs.call_s3("create_bucket", Bucket=bucket)
        overrides = [
            f"storage.root={store_root}",
            f"storage.endpoint_url={server.endpoint_url}",
            f"storage.retries={OUTAGE_RETRIES}",
            f"storage.retry_backoff_s={OUTAGE_RETRY_BACKOFF_S}",
            f"storage.retry_horizon_s={OUTAGE_HORIZON_S:g}",
            "storage.keep_checkpoints=10",  # every checkpoint stays: the test compares them before and after
            "sft.steps=5",  # the outage hits the step-4 checkpoint: SFT writes none at its last step
            f"logging.dir={root}/runs",
            *COMMON_OVERRIDES,
            "logging.wandb_mode=offline",  # the wandb key must not leak either
        ]
        config_json = config_to_json(load_config(TINY_CONFIG, overrides))
        commits = CommitWatch(watch_store)

        def while_down(event) -> None:
            # At least one listing while the server is down, whatever the poll thread's timing: the driver keeps
            # the outage on until this returns.
            commits.poll()
            event.notes["committed"] = dict(commits.committed)

        def once_back(event) -> None:
            if event.notes.get("name") != "checkpoint":
                return
            step4 = next(
                (u.rsplit("/_MANIFEST.json", 1)[0] for u in _step_manifest_candidates(watch_store)), None
            )
            event.notes["step4_uri"] = step4
            event.notes["step4_files"] = sorted(watch_store.list_files(step4)) if step4 else []
            event.notes["step4_committed"] = watch_store.is_committed(step4) if step4 else None

        retries = RetryLog()
        retry_logger = logging.getLogger("forge_core.storage.retry")
        driver = OutageDriver(server, planned_outages(bucket), retries, while_down, once_back)
        with pytest.MonkeyPatch.context() as mp:
            env = {**secrets, "FORGE_LAUNCH_REGISTRY": str(root / "launches"), "AWS_MAX_ATTEMPTS": "1"}
            for name, value in env.items():  # AWS_MAX_ATTEMPTS: DCP's own S3 client gives up after seconds
                mp.setenv(name, value)
            retry_logger.addHandler(retries)
            started = time.monotonic()
            try:
                with commits, driver:
                    state = sft_on_s3(config_json, return_state=True)
            finally:
                retry_logger.removeHandler(retries)
            wall_s = time.monotonic() - started
        flow_run_id = state.state_details.flow_run_id
        checkpoint = driver.events.get("checkpoint")
        before = checkpoint.notes.get("committed", {}) if checkpoint else {}
        after = {uri: watch_store.manifest_sha256(uri) for uri in before if watch_store.is_committed(uri)}
        uris = state.result() if state.is_completed() else {}
        runs = task_runs(flow_run_id)
        return OutageRun(
            root=root,
            store_root=store_root,
            state=state,
            uris=uris,
            task_runs=runs,
            logs=saved_logs(flow_run_id, root / "flow.log"),
            outages=dict(driver.events),
            task_pid=os.getpid(),
            violations=list(commits.violations),
            commits=commits,
            committed_before_outage=before,
            committed_after=after,
            final_manifest_metrics=watch_store.read_manifest(uris["sft"]).metrics if uris else {},
            bucket_dump=_dump_bucket(watch_store, root / "bucket"),
            run_dir=root / "runs",
            state_messages=[str(state.message)] + [str(r.state.message) for r in runs.values() if r.state],
            secrets=secrets,
            wall_s=wall_s,
        )
    finally:
        server.close()


def _step_manifest_candidates(store: ObjectStore) -> list[str]:
    """Where the step-4 checkpoint's manifest would be (its data files are there, its manifest is not)."""
    step4_files = [u for u in store.list_files(store.root) if "/_checkpoints/step-4/" in u]
    return sorted(
        {u.split("/_checkpoints/step-4/")[0] + "/_checkpoints/step-4/_MANIFEST.json" for u in step4_files}
    )


def _dump_bucket(store: ObjectStore, local: Path) -> Path:
    for uri in store.list_files(store.root):
        rel = uri[len(store.root) + 1 :]
        target = local / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(store.get_bytes(uri))
    return local


def prefect_text_everywhere() -> str:
    """Every log message and artifact the session's Prefect API holds."""
    return "\n".join(all_logs()) + "\n" + all_artifacts_text()


def json_dumps(obj) -> str:
    return json.dumps(obj, default=str)
