"""docs/own-model-and-data.md runs as written: its `walkthrough` blocks are the files this test writes into an
empty folder and the commands it runs there, one after another, as a user would (`forgeflow` and `python` of
this venv on PATH, the pytest run's Prefect API): data and a tiny random Qwen2 made by the doc's own scripts, a
user reward function, validate, run, export, and transformers loading the exported model. ~2 minutes.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

DOC = Path(__file__).resolve().parents[2] / "docs" / "own-model-and-data.md"
BLOCK = re.compile(r"<!-- walkthrough: (\S+) -->\s*```\w*\n(.*?)```", re.DOTALL)
ENDING = ("final policy:", "export it:", "plot:", "flow run:", "summary:", "wandb:", "total:")


def walkthrough() -> tuple[dict[str, str], list[str]]:
    """The doc's files (name -> text) and its commands, in order."""
    blocks = dict(BLOCK.findall(DOC.read_text()))
    commands = [line for line in blocks.pop("commands").splitlines() if line.strip()]
    return blocks, commands


def run_commands(commands: list[str], folder: Path, env: dict) -> dict[str, str]:
    """Each command in a shell of its own, after the `export` lines before it; its stdout by command."""
    exports, printed = [], {}
    for command in commands:
        if command.startswith("export "):
            exports.append(command)
            continue
        done = subprocess.run(
            ["bash", "-c", "\n".join(["set -e", *exports, command])],
            check=False, cwd=folder, env=env, capture_output=True, text=True, timeout=1200,
        )
        assert done.returncode == 0, f"{command} exited {done.returncode}\n{done.stdout}\n{done.stderr[-6000:]}"
        printed[command] = done.stdout
    return printed


def test_the_walkthrough_runs_as_written(prefect_api, tmp_path):
    files, commands = walkthrough()
    assert {"make_data.py", "make_model.py", "my_rewards.py", "reverse.yaml", "load_model.py"} <= set(files)
    assert [c.split()[1] for c in commands if c.startswith("forgeflow ")] == ["validate", "run", "export"]
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "PREFECT_API_URL": prefect_api}

    printed = run_commands(commands, tmp_path, env)

    validate = next(out for command, out in printed.items() if command.startswith("forgeflow validate"))
    assert validate.startswith("reverse.yaml: valid"), validate
    ending = next(out for command, out in printed.items() if command.startswith("forgeflow run"))
    for stage in ("prepare", "sft", "eval-sft", "rollout-1", "grpo-1", "eval-grpo-1"):
        assert re.search(rf"^{stage}\s", ending, re.MULTILINE), ending
    positions = [ending.find(f"\n{label}") for label in ENDING]
    assert -1 not in positions and positions == sorted(positions), ending
    assert "exported" in next(out for command, out in printed.items() if command.startswith("forgeflow export"))
    generated = printed["python load_model.py"].splitlines()
    assert [line.split(" -> ")[0] for line in generated] == ["cat", "dog", "sun"], generated
