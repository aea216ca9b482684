"""Two stages, registered for the runner tests, whose bodies run until something outside them ends them:

- `wait_forever` (a worker launch): writes the marker file named by `params.marker`, then waits to be killed;
- `wait_for_engines` (served by the flow's engines, so run in the task's process with
  `rollout.engine_lifetime: flow`): writes its marker and the run's engine state folder, then waits until that
  folder is gone (what stopping the flow's engines does, as the engines' own end fails a real stage's calls).

Neither ever finishes by itself, so a runner's deadline or a cancel is the only way they end: whatever the
machine's speed.
"""

from __future__ import annotations

import time
from pathlib import Path

from forge_core.stages import Stage, register_stage

BOUND_S = 600.0  # a body still waiting after this long fails: a test never hangs for good

WAIT_FOREVER = register_stage(
    Stage(name="wait_forever", kind="waited", entry="tests.run.waiting_stages:wait_forever")
)
WAIT_FOR_ENGINES = register_stage(
    Stage(
        name="wait_for_engines",
        kind="waited",
        entry="tests.run.waiting_stages:wait_for_engines",
        lifetime_key="rollout.engine_lifetime",
        flow_runner="task_process",
    )
)


def wait_forever(ctx) -> None:
    Path(ctx.params["marker"]).write_text("started")
    time.sleep(BOUND_S)
    raise RuntimeError(f"wait_forever was not ended within {BOUND_S:g} s")


def wait_for_engines(ctx) -> None:
    from forge_core.rollout.lifetime import engine_state_dir

    engines = engine_state_dir(ctx.cfg)
    engines.mkdir(parents=True, exist_ok=True)
    Path(ctx.params["marker"]).write_text("started")
    until = time.monotonic() + BOUND_S
    while engines.exists():
        if time.monotonic() > until:
            raise RuntimeError(f"the flow's engines were not stopped within {BOUND_S:g} s")
        time.sleep(0.05)
    raise RuntimeError("the flow's engines were stopped while the stage used them")
