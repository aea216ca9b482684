"""Every shipped config validates; the demo file is the embedded default; the CLI checker works."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from forge_core.config import RunConfig, describe_config, load_config
from forge_core.config.describe import field_help

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


def test_the_three_documented_configs_exist():
    assert {p.name for p in CONFIGS} >= {"demo_cpu.yaml", "tiny_test.yaml", "qwen3_1_7b_gsm8k.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_file_validates(path):
    assert isinstance(load_config(path), RunConfig)


def test_demo_cpu_is_the_embedded_default():
    assert load_config(CONFIGS[0].parent / "demo_cpu.yaml") == load_config(None)


def test_gpu_example_targets_the_gpu_pool():
    cfg = load_config(CONFIGS[0].parent / "qwen3_1_7b_gsm8k.yaml")
    assert (cfg.model.family, cfg.data.layout, cfg.training.mixed_precision) == ("qwen3", "gsm8k", "bf16")
    assert cfg.storage.root.startswith("s3://")
    assert (cfg.launch.sft.pool, cfg.launch.sft.nproc_per_node) == ("gpu-a", 8)


def test_describe_lists_every_key_with_type_and_default():
    text = describe_config()
    defaults = RunConfig()
    assert f"| `sft.optimizer.lr` | `float` | `{json.dumps(defaults.sft.optimizer.lr)}` |" in text
    assert f"| `grpo.optimizer.lr` | `float` | `{json.dumps(defaults.grpo.optimizer.lr)}` |" in text
    assert f"| `launch.sft.nproc_per_node` | `int` | `{defaults.launch.sft.nproc_per_node}` |" in text
    assert "| `rollout.rewards.<i>.name` | `str` |" in text
    assert "| `model.hf_path` | `str \\| null` | `null` |" in text
    documented = {line.split("`")[1] for line in text.splitlines() if line.startswith("| `")}
    assert {
        "seed",
        "storage.root",
        "data.demo.num_digits",
        "grpo.loss.clip_high",
        "logging.wandb_mode",
    } <= documented


@dataclasses.dataclass
class CommentedExample:
    """An example section."""

    # Above the field,
    # over two lines.
    first: int = 1
    second: str = "x"  # after the field
    third: float = 0.5


def test_field_help_comes_from_the_source_comments():
    assert field_help(CommentedExample) == {
        "first": "Above the field, over two lines.",
        "second": "after the field",
        "third": "",
    }


def test_cli_check_reports_all_problems_with_exit_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("sft:\n  stepz: 1\nseed: x\n")
    proc = subprocess.run(
        [sys.executable, "-m", "forge_core.config", "check", str(bad), "data.eval_fraction=2"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2
    assert "3 problems in" in proc.stderr and "did you mean 'sft.steps'?" in proc.stderr
