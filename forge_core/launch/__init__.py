"""forgeflow's launcher: runs a worker module under torchrun (or plain python) and owns its process tree.

Usage::

    from forge_core.launch import LaunchSpec, launch, start

    spec = LaunchSpec("forge_core.run", ["sft", "--spec", spec_uri], nproc_per_node=2, deadline_s=3600)
    result = launch(spec, log=logger)             # blocks; or handle = start(spec, log) ... handle.wait()
    result.raise_for_outcome()                    # LaunchFailed(result) with .retryable unless SUCCESS

The child runs in its own session under `torch.distributed.run --max-restarts 0` (retries belong to the
caller), or as `python -m <module>` with `torchrun=False`. The launcher tracks every descendant and every
process whose environment carries its `FORGE_LAUNCH_ID`, and ends them all: SIGTERM, `kill_grace_s`, SIGKILL.
Worker output reaches `log` (a callable or a `logging.Logger`) line by line, torchrun worker lines prefixed
`[rank<global rank>]:`; `rank0_only_logs` forwards only rank 0's lines (plus torchrun's and the launcher's
own). The result's `tail` keeps the last `tail_lines` lines of every rank. Order is kept per rank and per
stream only: a rank's stdout and stderr may interleave.

Workers wrap their `main` in `record_errors`, so a rank's exception lands in its error file together with
its classification (`errors.classify_exception`, the one classification of a failure).

Hung ranks: a launch stopped at its deadline, or failed by a collective timeout, ends its `reason` (and
`LaunchResult.stall`) with the rank that made no progress, read from the ranks' heartbeats (`heartbeat.py`).

Orphans: a `forge_core.run` worker rank ends its whole launch once its launcher is gone and never commits
meanwhile (`owner.py`). A flow run starts with `reap_orphaned_launches()` (`registry.py`), which ends what is
left of launches whose launcher died without cleaning up.

GPUs: a launch sees the GPUs of the process that starts it.

Signals: the first SIGTERM to the launching process ends every live launch (`terminate_all_live`, bounded
by the largest kill grace + 10 s); a second one meanwhile SIGKILLs every tree at once (`kill_all_live`).

Outcome mapping (first rule that applies):

==========  ===================================================================================
CANCELLED   `handle.cancel()`, the `cancel_event`, `terminate_all_live()` (flow cancel/crash,
            interpreter exit, SIGTERM to the launching process). Not to be retried.
RETRYABLE   the launcher's `deadline_s` passed (the tree is ended first); the reason names the hung rank.
RETRYABLE   the root's exit status was lost because something else reaped it (Popen would report 0);
            FATAL instead if a rank recorded a fatal exception. Never SUCCESS.
SUCCESS     exit code 0 and the launcher stopped nothing.
FATAL       some rank raised an exception `errors.classify_exception` classifies fatal, or exited with
            code 78 (`EXIT_FATAL`) without one. `reason` = "rank 1: ValueError: <message>[. Fix: <fix>]";
            the traceback tail is in `rank_errors[1]`.
RETRYABLE   some rank was killed by a signal, raised an exception classified retryable, or exited with
            code 75 (`EXIT_RETRYABLE`); also torchrun failing on its own with no rank error.
FATAL       some rank raised any other Python exception and no rank died from a signal or a retryable
            error (then it is taken as that death's collateral).
RETRYABLE   a non-zero exit with no information at all.
==========  ===================================================================================

Reserved child environment, set by the launcher (a `LaunchSpec.env` naming them is rejected):
`FORGE_LAUNCH_ID`, `FORGE_LAUNCH_OWNER`, `FORGE_LAUNCH_DEADLINE_S`, `FORGE_HEARTBEAT_DIR`,
`TORCHELASTIC_ERROR_FILE`, `TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE`. `PYTHONUNBUFFERED=1` is added unless set.
"""

from forge_core.launch.errors import (
    EXIT_FATAL,
    EXIT_RETRYABLE,
    Category,
    Classification,
    FatalStageError,
    RetryableStageError,
    classify_exception,
    record_errors,
)
from forge_core.launch.handle import (
    LaunchHandle,
    add_stop,
    install_sigterm_handler,
    kill_all_live,
    launch,
    live_handles,
    start,
    terminate_all_live,
)
from forge_core.launch.registry import reap_orphaned_launches
from forge_core.launch.result import LaunchFailed, LaunchResult, Outcome, RankError
from forge_core.launch.spec import LAUNCH_ID_ENV, LaunchSpec

__all__ = [
    "EXIT_FATAL",
    "EXIT_RETRYABLE",
    "LAUNCH_ID_ENV",
    "Category",
    "Classification",
    "FatalStageError",
    "LaunchFailed",
    "LaunchHandle",
    "LaunchResult",
    "LaunchSpec",
    "Outcome",
    "RankError",
    "RetryableStageError",
    "add_stop",
    "classify_exception",
    "install_sigterm_handler",
    "kill_all_live",
    "launch",
    "live_handles",
    "reap_orphaned_launches",
    "record_errors",
    "start",
    "terminate_all_live",
]
