"""forge_core.run.in_process: rollout/evaluate stages run in the task's process with the run's engine actors.

The success path against real engine actors is in tests/rollout/test_engine_actors.py and the flow tests;
these check the dispatch and the launcher-equivalent classification of failures without an engine.
"""

from __future__ import annotations

import pytest

from forge_core.config import config_to_dict, load_config
from forge_core.launch import LaunchFailed, Outcome
from forge_core.rollout.protocol import EngineLost
from forge_core.run.in_process import TaskProcessRunner, _failure
from forge_core.run.plan import StagePlan
from forge_core.run.resources import FlowResources
from forge_core.run.runners import runner_for
from forge_core.run.spec import StageSpec
from forge_core.storage import ObjectStore


def _cfg(tmp_path, lifetime: str):
    return load_config(None, [f"storage.root=file://{tmp_path}/store", f"rollout.engine_lifetime={lifetime}"])


def _plan(cfg, stage: str, inputs: dict[str, str]) -> StagePlan:
    """A planned stage whose spec names `inputs` as they are (plan_stage would insist they are committed)."""
    output_uri = ObjectStore.from_config(cfg.storage).artifact_uri("eval", "in-process-test")
    spec = StageSpec(stage=stage, config=config_to_dict(cfg), inputs=inputs, output_uri=output_uri)
    return StagePlan(stage=stage, key="in-process-test", output_uri=output_uri, spec=spec, inputs=inputs)


@pytest.mark.parametrize(
    ("stage", "lifetime", "expected"),
    [
        ("rollout", "flow", True),
        ("evaluate", "flow", True),
        ("rollout", "stage", True),  # the stage's own engine actors
        ("evaluate", "stage", True),
        ("grpo", "flow", False),
        ("sft", "flow", False),
    ],
)
def test_only_engine_client_stages_run_in_the_task_process(tmp_path, stage, lifetime, expected):
    assert isinstance(runner_for(_cfg(tmp_path, lifetime), stage), TaskProcessRunner) is expected


def test_a_stage_that_is_no_engine_client_is_refused(tmp_path):
    cfg = _cfg(tmp_path, "flow")
    with pytest.raises(ValueError, match=r"stage 'sft' with no lifetime setting='stage'.*launch it instead"):
        TaskProcessRunner(cfg, "sft", FlowResources.of(cfg))


def test_a_user_error_in_the_stage_is_fatal_with_its_message(tmp_path):
    """The spec has no data input: the stage's own ValueError, classified as a worker's would be."""
    cfg = _cfg(tmp_path, "flow")
    store = ObjectStore.from_config(cfg.storage)
    plan = _plan(cfg, "evaluate", {"policy": store.artifact_uri("sft", "some-policy")})
    result = runner_for(cfg, "evaluate").run(plan, print)

    assert result.outcome is Outcome.FATAL
    assert "inputs has no 'data' entry" in result.reason, result.reason
    assert result.rank_errors[0].category == "fatal" and result.rank_errors[0].exc_type == "builtins.ValueError"
    assert any("required_input" in line for line in result.tail), result.tail
    with pytest.raises(LaunchFailed) as failed:
        result.raise_for_outcome()
    assert not failed.value.retryable
    assert not store.is_committed(plan.output_uri)


@pytest.mark.parametrize(
    ("error", "outcome"),
    [
        (EngineLost("engine-0 on Ray node 1a2b3c4d died during 'generate'"), Outcome.RETRYABLE),
        (OSError("connection reset"), Outcome.RETRYABLE),
        (ValueError("eval.num_prompts=0: must be >= 1"), Outcome.FATAL),
        (RuntimeError("something unclassified"), Outcome.FATAL),
    ],
)
def test_exceptions_are_classified_like_a_workers(error, outcome):
    try:
        raise error
    except Exception as raised:  # noqa: BLE001 - a real traceback for the tail
        result = _failure("rollout", raised, 1.5)
    assert result.outcome is outcome and result.duration_s == 1.5
    assert str(error) in result.reason and result.reason.startswith("rollout (in the task's process)")
    assert result.rank_errors[0].message == str(error)


def test_the_stage_threads_records_reach_the_task_log_only_and_other_threads_are_untouched(caplog):
    """A stage thread's forge_core INFO records go to the sink (not to the root handlers, which would print
    them twice); another thread's records are not relayed and its warnings still reach the root handlers."""
    import logging
    import threading

    from forge_core.run.in_process import _StageLogRelay

    log = logging.getLogger("forge_core.run.rollout")
    lines: list[str] = []
    others_done = threading.Event()

    def stage_body() -> None:
        log.info("stage record")
        others_done.wait(30)  # alive while the other thread logs, as a stage is while the flow goes on

    stage = threading.Thread(target=stage_body)
    other = threading.Thread(target=lambda: (log.info("other info"), log.warning("other warning")))
    caplog.set_level(logging.WARNING)  # the flow process's root threshold
    level_before, propagate_before = logging.getLogger("forge_core").level, logging.getLogger("forge_core").propagate
    with _StageLogRelay(lines.append, stage):
        stage.start()
        other.start()
        other.join()
        others_done.set()
        stage.join()
    assert lines == ["INFO forge_core.run.rollout: stage record"]
    assert [r.getMessage() for r in caplog.records] == ["other warning"]
    assert (logging.getLogger("forge_core").level, logging.getLogger("forge_core").propagate) == (
        level_before, propagate_before
    )
