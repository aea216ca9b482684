"""The Prefect task that runs any registered stage (see tasks/stages.py)."""

from tasks.stages import run_as_task, run_stage, run_stage_task, stage_task

__all__ = ["run_as_task", "run_stage", "run_stage_task", "stage_task"]
