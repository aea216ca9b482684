"""Worker of the long-lived GRPO trainer job (`grpo.trainer_lifetime: flow`): one torchrun job per flow run
that trains every GRPO iteration in order, so an iteration no longer pays torchrun, interpreter, import and
process-group start-up. The flow process starts and stops it (forge_core.run.trainer_job); by hand:

    torchrun --standalone --nproc-per-node 2 -m forge_core.run grpo-job --orders <dir> [--device cpu]

Orders: the files `<dir>/<seq>.json` (seq = 000000, 000001, ...), each `{"spec_uri": <the stage's spec>}`
or `{"stop": true}`, written atomically by the flow process. Every rank waits for the next file itself (the
folder is local to this node, so no collective runs while the job idles between iterations), reads the spec
and runs it through the worker scaffold (forge_core.run.scaffold.run_spec, with the job's process group): the
same stage body as the per-stage worker (forge_core.run.grpo.train), which commits the iteration's `grpo`
artifact and resumes from its newest in-stage checkpoint when an earlier attempt left one. The flow process
watches for that commit.

Any exception ends the job (no rank is left waiting in a collective): the launcher's error recording then
tells the waiting task why (a fatal user error, or a retryable crash) and the task's retry starts a new job.
The job also exits by itself when the folder disappears, and ends within seconds of its owner (the flow
process that launched it) like every launched worker (forge_core.launch.owner, started by forge_core.run).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path

from forge_core.engine import destroy_distributed, init_distributed
from forge_core.run.scaffold import run_spec
from forge_core.run.spec import read_spec
from forge_core.run.trainer_job import done_path, order_path
from forge_core.stages import stage_named

log = logging.getLogger(__name__)

POLL_S = 0.05


def wait_for_order(orders: Path, seq: int) -> dict | None:
    """The order `seq` once its file exists; None when the job should end instead (its folder is gone)."""
    path = order_path(orders, seq)
    while not path.exists():
        if not orders.is_dir():
            log.info("order folder %s is gone; stopping", orders)
            return None
        time.sleep(POLL_S)
    return json.loads(path.read_text())


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m forge_core.run grpo-job", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--orders", required=True, help="folder the flow process writes <seq>.json orders into"
    )
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="training.device")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    """Serve GRPO orders until a stop order or the folder's removal (module docstring). The process was set
    up as a worker by forge_core.run (log format, FORGE_FAULT entries ending in @grpo, the owner guard)."""
    args = _parse_args(argv)
    orders = Path(args.orders)
    dist_ctx = init_distributed(args.device)
    try:
        seq = 0
        while (order := wait_for_order(orders, seq)) is not None and not order.get("stop"):
            started = time.perf_counter()
            spec = read_spec(order["spec_uri"])
            if stage_named(spec.stage).flow_runner != "trainer_job":
                raise ValueError(f"order {seq}: {spec.uri} is a {spec.stage} stage, which the trainer job does not run")
            log.info("order %d: GRPO iteration %s -> %s", seq, spec.params.get("iteration"), spec.output_uri)
            run_spec(spec, process_group=dist_ctx, started=started)
            if dist_ctx.is_rank0:
                done_path(orders, seq).touch()
            log.info("order %d done in %.2fs", seq, time.perf_counter() - started)
            seq += 1
    finally:
        destroy_distributed()
