"""What `forgeflow validate` and `forgeflow run` print for a new user's own config: no GPU talk for a config that
asks for no GPU, a model the CPU engine cannot run named before anything starts, a reward dry run that fails
shows what the reward saw and the settings that change it, a misbehaving reward is a problem like any other,
and a typo'd key is one clean message without a traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import transformers

from forge_core.config import load_config
from forge_core.rewards.dry_run import reward_problems

ROOT = Path(__file__).resolve().parents[2]
REWARDS = "tests.rollout.rewards_for_tests"
REVERSE = [
    {"prompt": f"Reverse the word {w}.", "completion": f"Reversed, it reads <answer>{w[::-1]}</answer>", "answer": w[::-1]}
    for w in ("cat", "dog", "sun", "map", "pen", "cup", "hat", "box", "jar", "fox", "owl", "bus")
]


def _forgeflow(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", *args], capture_output=True, text=True, timeout=600, check=False,
        cwd=ROOT,
    )


@pytest.fixture(scope="module")
def reverse_source(tmp_path_factory):
    """The reverse-a-word task of a new user: completions end in `<answer>...</answer>`, a bare `answer` column."""
    path = tmp_path_factory.mktemp("reverse") / "reverse.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in REVERSE))
    return path


@pytest.fixture(scope="module")
def head_dim_16_model(tmp_path_factory):
    """A random Qwen2 (hidden 64, 4 heads: head_dim 16) as save_pretrained writes it."""
    folder = tmp_path_factory.mktemp("qwen2-head16")
    config = transformers.Qwen2Config(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True,
    )
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def test_validate_of_a_cpu_config_says_nothing_about_gpus(tmp_path):
    done = _forgeflow("validate", "configs/demo_cpu.yaml", f"storage.root=file://{tmp_path}/store")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "valid" in done.stdout
    assert "gpu" not in (done.stdout + done.stderr).lower(), done.stdout + done.stderr
    # A problem list is headed neutrally: the problem here is the missing file, not the host.
    failed = _forgeflow(
        "validate", "configs/demo_cpu.yaml", f"storage.root=file://{tmp_path}/store",
        f"data.source={tmp_path}/missing.jsonl",
    )
    assert failed.returncode == 2, failed.stderr[-3000:]
    assert "missing.jsonl" in failed.stderr and "gpu" not in failed.stderr.lower(), failed.stderr


def test_validate_names_a_head_size_the_cpu_engine_cannot_run(tmp_path, head_dim_16_model):
    done = _forgeflow(
        "validate", "configs/tiny_test.yaml", f"storage.root=file://{tmp_path}/store", "model.family=qwen2",
        "model.flavor=auto", f"model.hf_path={head_dim_16_model}",
    )
    assert done.returncode == 2, (done.stdout[-2000:], done.stderr[-3000:])
    (problem,) = [line for line in done.stderr.splitlines() if "head_dim" in line]
    assert f"model.hf_path='{head_dim_16_model}'" in problem and "head_dim=16" in problem, problem
    assert "32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512" in problem and "CPU" in problem, problem
    assert "launch.rollout.gpus_per_node" in problem, problem  # the other way out: vLLM on a GPU


def test_a_failed_dry_run_shows_what_the_reward_saw_and_the_settings_that_change_it(reverse_source, tmp_path):
    """exact_answer compares the tagged answer with a bare ground truth; without data.ground_truth_field the
    ground truth of this layout is the whole completion."""
    overrides = [
        f"storage.root=file://{tmp_path}/store", f"data.source={reverse_source}", "data.layout=prompt_completion",
        "data.tokenizer.vocab_size=300", "rollout.rewards=[{name: exact_answer}]", "sft.verifier=null",
        "sft.select_metric=loss",
    ]
    (problem,) = reward_problems(load_config("configs/tiny_test.yaml", overrides))
    assert problem.startswith("rollout.rewards[0].name='exact_answer': scored 0 on all 12 reference answers")
    completion = "'Reversed, it reads <answer>tac</answer>'"
    assert f"completion:   {completion}" in problem, problem
    assert f"ground truth: {completion}" in problem, problem  # the layout's ground truth: the completion itself
    assert "data.ground_truth_field" in problem and "unset" in problem, problem
    assert "rollout.rewards[0].kwargs" in problem and "tag='answer'" in problem, problem
    # The setting it named is the fix: a column with the bare answer.
    assert reward_problems(load_config("configs/tiny_test.yaml", [*overrides, "data.ground_truth_field=answer"])) == []


def test_a_length_reward_passes_the_dry_run_under_the_runs_length_cap(tmp_path):
    """overlong's window (default 4 tokens) must fit under max_new_tokens: the dry run gives it the run's cap."""
    overrides = [
        f"storage.root=file://{tmp_path}/store", "rollout.sampling.max_new_tokens=32",
        "rollout.rewards=[{name: exact_answer}, {name: overlong, kwargs: {window: 4}}]",
    ]
    assert reward_problems(load_config("configs/tiny_test.yaml", overrides)) == []
    (problem,) = reward_problems(
        load_config("configs/tiny_test.yaml", [*overrides, "rollout.sampling.max_new_tokens=3"])
    )
    assert "kwargs.window=4 must be in [1, max_new_tokens=3]" in problem, problem


def test_validate_reports_a_reward_that_ends_its_process_and_exits_normally(tmp_path):
    done = _forgeflow(
        "validate", "configs/tiny_test.yaml", f"storage.root=file://{tmp_path}/store", "rollout.reward_timeout_s=2",
        f"rollout.rewards=[{{name: {REWARDS}:exits_always}}]",
    )
    assert done.returncode == 2, (done.returncode, done.stdout[-2000:], done.stderr[-3000:])
    assert "exits_always" in done.stderr and "crash" in done.stderr.lower(), done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]


def test_run_with_a_typo_prints_the_clean_message_only(tmp_path):
    done = _forgeflow(
        "run", "configs/tiny_test.yaml", f"storage.root=file://{tmp_path}/store", "sft.stpes=3"
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert "sft.stpes=3: unknown key; did you mean 'sft.steps'?" in done.stderr, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "temporary server" not in done.stderr  # refused before any Prefect server starts
