"""docs/config-reference.md is generated from the schema (`make docs`): it must not drift from it."""

import json
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


def test_every_shipped_config_validates_against_the_json_schema_editors_use():
    import jsonschema
    import yaml

    schema = json.loads((REPO / "docs" / "config.schema.json").read_text())
    validator = jsonschema.Draft202012Validator(schema)
    for path in sorted((REPO / "configs").glob("*.yaml")):
        assert path.read_text().startswith("# yaml-language-server: $schema=../docs/config.schema.json"), path
        assert list(validator.iter_errors(yaml.safe_load(path.read_text()) or {})) == [], path
    refused = list(validator.iter_errors({"sft": {"stesp": 3, "steps": "ten"}}))
    assert sorted(e.validator for e in refused) == ["additionalProperties", "type"]
    assert "optimizer steps" in schema["$defs"]["SFTConfig"]["properties"]["steps"]["description"].lower()
