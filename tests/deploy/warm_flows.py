"""A flow for tests/deploy/test_warm_start.py: reports the process it ran in, then succeeds, fails or waits."""

from __future__ import annotations

import json
import os
import time

from prefect import flow


@flow(name="warm-probe")
def probe(out: str, mode: str = "ok") -> str:
    facts = {"pid": os.getpid(), "ppid": os.getppid(), "cwd": os.getcwd(), "marker": os.environ.get("WARM_PROBE_MARKER")}
    facts["started_warm"] = os.environ.get("FORGE_STARTED_WARM")
    with open(out + ".tmp", "w") as handle:
        json.dump(facts, handle)
    os.rename(out + ".tmp", out)
    if mode == "fail":
        raise RuntimeError("the probe fails as asked")
    if mode == "wait":
        time.sleep(600)
    return "done"
