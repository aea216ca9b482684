"""The runner interface (forge_core.run.runner): every runner is chosen in one place (forge_core.run.runners)
and supervised the same way: past its deadline an attempt is ended and RETRYABLE, a cancel ends it as
CANCELLED. Checked on a real worker launch (a gang on the test run's Ray cluster) and on a real thread of this
process, with stages that never end by themselves (tests/run/waiting_stages.py), so the outcome does not depend
on the machine's speed.
"""

from __future__ import annotations

import threading
import time

import pytest

from forge_core.config import load_config
from forge_core.config.schema import ResourceConfig
from forge_core.launch import Outcome
from forge_core.run.cluster_runner import ClusterRunner
from forge_core.run.in_process import TaskProcessRunner
from forge_core.run.plan import plan_stage
from forge_core.run.resources import FlowResources
from forge_core.run.runner import Cancel
from forge_core.run.runners import runner_for
from forge_core.run.spec import write_spec
from forge_core.run.trainer_group import TrainerGroupRunner
from forge_core.storage import ObjectStore, new_attempt_id
from tests.run import waiting_stages  # noqa: F401 - registers wait_forever and wait_for_engines

WAIT_S = 300  # bound on a worker's start-up (it takes seconds) on a loaded machine
DEADLINE_S = 3.0


def _cfg(tmp_path, *overrides):
    return load_config(
        None,
        [
            f"storage.root=file://{tmp_path}/store",
            f"logging.dir={tmp_path}/runs",
            *overrides,
        ],
    )


def _planned(cfg, stage: str, marker):
    store = ObjectStore.from_config(cfg.storage)
    plan = plan_stage(cfg, store, stage, params={"marker": str(marker)}).for_attempt(new_attempt_id())
    write_spec(store, plan.spec)
    return plan


def _short(runner_cls):
    """The runner with a deadline of DEADLINE_S (a registered stage without a launch section has defaults)."""

    class ShortDeadline(runner_cls):
        @property
        def resources(self) -> ResourceConfig:
            return ResourceConfig(deadline_s=DEADLINE_S, kill_grace_s=2.0)

    return ShortDeadline


def _wait_for(path, what: str) -> None:
    until = time.monotonic() + WAIT_S
    while not path.exists():
        assert time.monotonic() < until, f"{what} never started"
        time.sleep(0.05)


@pytest.mark.parametrize(
    ("stage", "overrides", "expected"),
    [
        ("prepare", [], ClusterRunner),  # a gang on the Ray cluster ...
        ("sft", [], ClusterRunner),
        ("rollout", [], TaskProcessRunner),  # ... the engine clients in the task's process, with engine actors
        ("evaluate", [], TaskProcessRunner),
        ("rollout", ["rollout.engine_lifetime=stage"], TaskProcessRunner),
        ("evaluate", ["rollout.engine_lifetime=stage"], TaskProcessRunner),
        ("grpo", [], TrainerGroupRunner),  # ... or an order to the run's trainer group
        ("grpo", ["grpo.trainer_lifetime=stage"], ClusterRunner),
        ("grpo", ["rollout.engine_lifetime=stage"], TrainerGroupRunner),  # each stage reads its own setting
        ("wait_forever", [], ClusterRunner),  # a registered stage without a lifetime setting
        ("wait_for_engines", [], TaskProcessRunner),
        ("wait_for_engines", ["rollout.engine_lifetime=stage"], TaskProcessRunner),
    ],
)
def test_the_runner_is_chosen_from_the_stage_record_and_its_lifetime_setting(tmp_path, stage, overrides, expected):
    runner = runner_for(_cfg(tmp_path, *overrides), stage)
    assert type(runner) is expected and runner.stage == stage


@pytest.mark.integration
def test_a_worker_launch_past_its_deadline_is_ended_and_retryable(tmp_path, ray_cluster):
    cfg = _cfg(tmp_path)
    plan = _planned(cfg, "wait_forever", tmp_path / "started")
    lines: list[str] = []

    result = _short(ClusterRunner)(cfg, "wait_forever").run(plan, lines.append)

    assert result.outcome is Outcome.RETRYABLE, result
    assert result.reason.startswith(
        f"deadline of {DEADLINE_S:g} s exceeded while wait_forever ran in the Ray cluster"
    ), result.reason
    assert result.duration_s >= DEADLINE_S
    assert ray_cluster.stage_processes() == []
    assert not ObjectStore.from_config(cfg.storage).is_committed(plan.output_uri)


@pytest.mark.integration
def test_a_cancelled_worker_launch_is_ended_and_cancelled(tmp_path, ray_cluster):
    cfg = _cfg(tmp_path)
    marker = tmp_path / "started"
    plan = _planned(cfg, "wait_forever", marker)
    cancel, results = Cancel(), []
    runner = ClusterRunner(cfg, "wait_forever")
    running = threading.Thread(target=lambda: results.append(runner.run(plan, print, cancel)))
    running.start()
    _wait_for(marker, "the wait_forever worker")  # its body runs: the scaffold found the registered stage

    cancel.request("another run took the stage's lease")
    running.join(WAIT_S)

    (result,) = results
    assert result.outcome is Outcome.CANCELLED
    assert result.reason == "cancelled: another run took the stage's lease"
    assert ray_cluster.stage_processes() == []


def test_a_stage_in_the_task_process_past_its_deadline_stops_the_flow_engines_and_is_retryable(tmp_path):
    cfg = _cfg(tmp_path)
    resources = FlowResources.of(cfg)
    plan = _planned(cfg, "wait_for_engines", tmp_path / "started")
    lines: list[str] = []
    # The run's engines are reserved before the deadline runs, so the stage has them at once whatever the
    # cluster's speed (a reservation can outlast DEADLINE_S on a loaded machine).
    with resources.engine_actors(seed=0):
        pass

    result = _short(TaskProcessRunner)(cfg, "wait_for_engines", resources).run(plan, lines.append)

    assert result.outcome is Outcome.RETRYABLE, result
    assert result.reason == (
        f"deadline of {DEADLINE_S:g} s exceeded while wait_for_engines ran in the task's process; it was ended"
    )
    assert resources.flow_engines is None  # the run's engines were stopped: that is what ended the stage
    assert (tmp_path / "started").read_text() == "started"
    assert not ObjectStore.from_config(cfg.storage).is_committed(plan.output_uri)
