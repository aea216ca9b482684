"""Two torchrun ranks on this host, for tests of collectives and multi-rank stages.

    result = torchrun_two_ranks(str(WORKER), "arg")                       # a worker script
    result = torchrun_two_ranks("-m", "forge_core.run", "sft", "--spec", spec_uri, env={"FORGE_FAULT": ...})
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def torchrun_two_ranks(*target: str, env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run `target` (a script and its arguments, or `-m module ...`) on two ranks of `torchrun --standalone`
    from the repository root, with this environment plus `env` and the repository importable; the completed
    process, its output captured as text (not checked)."""
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *target],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
