"""Two stages, registered for the runner tests, whose bodies run until something outside them ends them:

- `wait_forever` (a worker launch): writes the marker file named by `params.marker`, then waits to be killed;
- `wait_for_engines` (an engine client, so run in the task's process): reserves the run's engine actors on the
  Ray cluster (no vLLM starts before an engine serves a policy), writes its marker, then waits until the run's
  engines were stopped (as the engines' own end fails a real stage's calls).

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
    from forge_core.run.resources import FlowResources

    resources = FlowResources.of(ctx.cfg)
    with resources.engine_actors(seed=0) as engines:
        Path(ctx.params["marker"]).write_text("started")
        until = time.monotonic() + BOUND_S
        while resources.flow_engines is engines or engines in resources.stage_engines:
            if time.monotonic() > until:
                raise RuntimeError(f"the run's engines were not stopped within {BOUND_S:g} s")
            time.sleep(0.05)
    raise RuntimeError("the run's engines were stopped while the stage used them")
