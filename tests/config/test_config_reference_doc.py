"""docs/config-reference.md is generated from the schema (`make docs`): it must not drift from it."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_config_reference_matches_the_schema():
    checker = [sys.executable, str(REPO / "docs" / "config_reference.py"), "--check"]
    result = subprocess.run(checker, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr


def test_every_schema_key_is_in_the_reference():
    from forge_core.config import config_to_dict, load_config

    def keys(tree, prefix=""):
        for name, value in tree.items():
            if isinstance(value, dict):
                yield from keys(value, f"{prefix}{name}.")
            else:
                yield f"{prefix}{name}"

    text = (REPO / "docs" / "config-reference.md").read_text()
    missing = [key for key in keys(config_to_dict(load_config(None))) if f"`{key}`" not in text]
    assert missing == []
