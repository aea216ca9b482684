"""Fixed timings live in one module, forge_core.timings: no other module of forgeflow defines a seconds constant."""

from __future__ import annotations

import ast
from pathlib import Path

from forge_core import timings

REPO = Path(__file__).resolve().parents[1]


def seconds_constants(path: Path) -> list[str]:
    """Module-level names ending in _S bound to a number in `path`."""
    found = []
    for node in ast.parse(path.read_text()).body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        value = getattr(node, "value", None)
        for target in targets:
            if isinstance(target, ast.Name) and target.id.endswith("_S") and isinstance(value, ast.Constant):
                found.append(f"{target.id} = {value.value!r}")
    return found


def test_no_module_but_timings_defines_a_seconds_constant():
    modules = [p for root in ("forge_core", "tasks", "flows") for p in sorted((REPO / root).rglob("*.py"))]
    elsewhere = [
        f"{p.relative_to(REPO)}: {hit}" for p in modules if p.name != "timings.py" for hit in seconds_constants(p)
    ]
    assert not elsewhere, "move these to forge_core/timings.py (or make them config fields):\n" + "\n".join(elsewhere)


def test_every_timing_is_documented_and_positive():
    source = (REPO / "forge_core" / "timings.py").read_text().splitlines()
    names = [name for name in vars(timings) if name.endswith("_S")]
    assert len(names) >= 25
    for name in names:
        assert getattr(timings, name) > 0, name
        line = next(k for k, text in enumerate(source) if text.startswith(f"{name} ="))
        # Its comment: the line above, or the comment block above a group of related constants.
        above = next(text for text in reversed(source[:line]) if not text.split("=")[0].strip().endswith("_S"))
        assert above.startswith("#"), f"{name}: say what it bounds in a comment above it"


def test_the_check_sees_a_constant(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("POLL_S = 0.5\nLIMIT = 3\n\n\ndef f():\n    WAIT_S = 1.0\n")
    assert seconds_constants(module) == ["POLL_S = 0.5"]
