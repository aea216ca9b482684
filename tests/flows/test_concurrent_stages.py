"""Two runs of one stage at once on one store (two deployment runs of one config, a retry next to a zombie):
the stage is computed once, both get the same committed URI, and the waiting run holds no pool capacity.

Both runs are tasks of one flow, submitted together, each calling `run_stage` as the stage tasks do. The run
that takes the output key's lease holds its launch back until the other run has reported waiting for that
lease (its log line), then launches the real worker; so the two always overlap, however fast the machine.
The SFT stage checkpoints every step but the last and keeps the newest storage.keep_checkpoints=2 (retention).

Then a holder that loses its lease while its worker runs (another run took it over) cancels its own launch
on the next renewal and fails with LeaseLost, which is retryable.
"""

from __future__ import annotations

import json
import logging
import re
import threading

import pytest
from prefect import flow, task

from forge_core.config import config_from_dict, config_to_json, load_config
from forge_core.engine import committed_checkpoints
from forge_core.launch.errors import Category, classify_exception
from forge_core.run.cluster_runner import ClusterRunner
from forge_core.run.plan import plan_stage
from forge_core.storage import LeaseLost, ObjectStore
from forge_core.storage.generations import GenerationLog
from forge_core.storage.lease import lease_prefix
from tasks import run_as_task
from tasks.stages import run_stage

pytestmark = pytest.mark.integration

WAIT_S = 900  # bound on events that take seconds; generous for a loaded 2-core machine
_WAITING = re.compile(r"^(\w+): \S+ is being computed by attempt")
launches: dict[str, list[str]] = {}
waiting_seen: dict[str, threading.Event] = {}


class _WaiterSpotter(logging.Handler):
    """Sets waiting_seen[stage] when a run logs that it waits for another run's lease on that stage."""

    def emit(self, record: logging.LogRecord) -> None:
        match = _WAITING.match(record.getMessage())
        if match and match.group(1) in waiting_seen:
            waiting_seen[match.group(1)].set()


class _LaunchOnceTheOtherRunWaits(ClusterRunner):
    def start(self, plan, log):
        launches[plan.stage].append(plan.spec.attempt)
        assert waiting_seen[plan.stage].wait(WAIT_S), f"{plan.stage}: the other run never waited for the lease"
        return super().start(plan, log)


@task
def stage_run(config_json: str, stage: str, inputs: dict[str, str]) -> str:
    cfg = config_from_dict(json.loads(config_json))
    return run_stage(cfg, stage, inputs, runner=_LaunchOnceTheOtherRunWaits(cfg, stage))


@flow(name="two-runs-of-each-stage")
def two_runs_of_each_stage(config_json: str) -> dict[str, list[str]]:
    data = [stage_run.submit(config_json, "prepare", {}) for _ in range(2)]
    data_uris = [future.result() for future in data]
    sft = [stage_run.submit(config_json, "sft", {"data": data_uris[0]}) for _ in range(2)]
    return {"prepare": data_uris, "sft": [future.result() for future in sft]}


def test_two_runs_of_one_stage_compute_it_once_and_share_the_output(prefect_api, tiny_overrides):
    cfg = load_config(
        "configs/tiny_test.yaml",
        [
            *tiny_overrides,
            "data.demo.num_rl=72",  # a data key (so an SFT key) no other test commits
            "sft.steps=5",  # checkpoints after steps 1-4: none at the last step, the export follows at once
            "sft.checkpoint_every=1",
            "sft.select=last",  # no best-validation checkpoint pinned past retention
            "storage.keep_checkpoints=2",
            "storage.lease_renew_s=0.5",  # how often the waiting run looks for the commit
        ],
    )
    for stage in ("prepare", "sft"):
        launches[stage], waiting_seen[stage] = [], threading.Event()
    spotter = _WaiterSpotter()
    logging.getLogger("prefect.task_runs").addHandler(spotter)
    try:
        uris = two_runs_of_each_stage(config_to_json(cfg))
    finally:
        logging.getLogger("prefect.task_runs").removeHandler(spotter)

    store = ObjectStore.from_config(cfg.storage)
    for stage in ("prepare", "sft"):
        first, second = uris[stage]
        assert first == second and store.is_committed(first), uris
        assert len(launches[stage]) == 1, launches  # one launch: the waiting run launched nothing
        (attempt,) = launches[stage]
        assert sorted(store.list_files(store.join(first, "_specs"))) == [
            store.join(first, "_specs", f"{attempt}.json")
        ]
        assert store.list_files(lease_prefix(store, first)) == {}  # the lease is gone with the commit
    # Retention: of the checkpoints after steps 1-4 the newest two are committed; older ones are gone entirely.
    sft_uri = uris["sft"][0]
    assert [ref.step for ref in committed_checkpoints(store, sft_uri)] == [4, 3]
    assert sorted(
        {
            uri.split("/_checkpoints/")[1].split("/")[0]
            for uri in store.list_files(sft_uri)
            if "/_checkpoints/" in uri
        }
    ) == ["step-3", "step-4"]


_outcomes: list[str] = []
_OUTCOME = re.compile(r"^sft: (\w+) in [\d.]+s$")


class _OutcomeSpotter(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        if match := _OUTCOME.match(record.getMessage()):
            _outcomes.append(match.group(1))


class _LaunchThenLoseTheLease(ClusterRunner):
    def start(self, plan, log):
        """Start the real worker (its rank 0 hangs at step 1), then take the stage's lease over as another run
        would once the holder looked stale; the holder's next renewal must find out and cancel its launch."""
        attempt = super().start(plan, log)
        store = ObjectStore.from_config(self.cfg.storage)
        generations = GenerationLog(store, lease_prefix(store, plan.output_uri))
        # The holder renews concurrently: write the next generation, looking again whenever a renewal came first.
        while not generations.append(generations.latest()[0], {"holder": "another-run", "state": "held"}):
            pass
        return attempt


@task(retries=0)
def stage_run_losing_its_lease(config_json: str, data_uri: str) -> str:
    cfg = config_from_dict(json.loads(config_json))
    return run_stage(cfg, "sft", {"data": data_uri}, runner=_LaunchThenLoseTheLease(cfg, "sft"))


@flow(name="sft-losing-its-lease")
def sft_losing_its_lease(config_json: str) -> str:
    return stage_run_losing_its_lease(config_json, run_as_task(config_from_dict(json.loads(config_json)), "prepare", {}))


def test_a_holder_that_lost_its_lease_cancels_its_launch_and_fails_retryably(
    prefect_api, tiny_overrides, monkeypatch
):
    monkeypatch.setenv("FORGE_FAULT", "hang_rank:0:1@sft")  # only the cancel can end this worker in time
    cfg = load_config(
        "configs/tiny_test.yaml",
        [*tiny_overrides, "sft.steps=9", "storage.lease_renew_s=0.5", "launch.sft.deadline_s=1800"],
    )
    spotter = _OutcomeSpotter()
    _outcomes.clear()
    logging.getLogger("prefect.task_runs").addHandler(spotter)
    try:
        state = sft_losing_its_lease(config_to_json(cfg), return_state=True)
    finally:
        logging.getLogger("prefect.task_runs").removeHandler(spotter)

    assert state.is_failed()
    with pytest.raises(LeaseLost, match="another-run took it over from"):
        state.result()
    assert classify_exception(LeaseLost("x")).category is Category.RETRYABLE
    assert _outcomes == ["CANCELLED"]  # the launch was ended by the lease keeper, not by its deadline
    store = ObjectStore.from_config(cfg.storage)
    data_uri = plan_stage(cfg, store, "prepare").output_uri
    sft_uri = plan_stage(cfg, store, "sft", inputs={"data": data_uri}).output_uri
    assert not store.is_committed(sft_uri)
    # The lost lease was not released over the taker's: its generation is still the newest.
    assert GenerationLog(store, lease_prefix(store, sft_uri)).latest()[1]["holder"] == "another-run"
