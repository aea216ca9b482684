"""Prefect tasks, one per pipeline stage, and one generic task for any registered stage (see tasks/stages.py)."""

from tasks.stages import (
    evaluate,
    generate_rollouts,
    prepare_data,
    run_stage,
    run_stage_task,
    stage_task,
    train_grpo,
    train_sft,
)

__all__ = [
    "evaluate",
    "generate_rollouts",
    "prepare_data",
    "run_stage",
    "run_stage_task",
    "stage_task",
    "train_grpo",
    "train_sft",
]
