"""Prefect tasks, one per pipeline stage (see tasks/stages.py)."""

from tasks.stages import evaluate, generate_rollouts, prepare_data, run_stage, train_grpo, train_sft

__all__ = ["evaluate", "generate_rollouts", "prepare_data", "run_stage", "train_grpo", "train_sft"]
