"""forgeflow's launcher: runs a worker module under torchrun (or plain python) and owns its process tree.

Usage::

    from forge_core.launch import LaunchSpec, launch, start

    spec = LaunchSpec("forge_core.run", ["sft", "--spec", spec_uri], nproc_per_node=2, deadline_s=3600)
    result = launch(spec, log=logger)             # blocks; or handle = start(spec, log) ... handle.wait()
    result.raise_for_outcome()                    # LaunchFailed(result) with .retryable unless SUCCESS

The command is `sys.executable -m torch.distributed.run --nproc-per-node N --nnodes M --node-rank R
(--standalone | --rdzv-backend c10d --rdzv-endpoint host:port) --max-restarts 0 --log-dir <tmp> --tee 3
-m <module> <args>`, or `sys.executable -m <module> <args>` with `torchrun=False`. The child runs in its own
session; the launcher tracks every descendant (ranks live in their own sessions) and every process whose
environment carries its `FORGE_LAUNCH_ID`, and ends them all: SIGTERM, `kill_grace_s`, then SIGKILL.
Worker output reaches `log` (a callable or a `logging.Logger`) line by line, each torchrun worker line
prefixed `[rank<global rank>]:`; `rank0_only_logs` forwards only rank 0's lines (plus torchrun's and the
launcher's own; on a node without global rank 0 that is no worker line at all). The result's `tail` keeps
the last `tail_lines` lines of every rank. Order is kept per rank and per stream: torchrun tails each rank's
stdout and stderr separately, so a rank's prints and its logging (stderr) may interleave ~0.1 s apart.

Workers wrap their `main` in `record_errors` so a rank's exception lands in its error file, together with
its classification (`errors.classify_exception`: the one classification of a failure, used by workers, this
launcher, the in-process runner, the trainer group and the stage tasks' retry condition alike).

Hung ranks: every launch gets `FORGE_LAUNCH_DEADLINE_S` (a worker's collectives time out later than that:
forge_core.engine.distributed.process_group_timeout_s) and a heartbeat folder (`FORGE_HEARTBEAT_DIR`) that
the trainers' step loop writes into (`heartbeat.py`); a launch stopped at its deadline, or failed by a
collective timeout, ends its `reason` (and `LaunchResult.stall`) with the rank that made no progress:
"rank 1 made no progress since step 1 (last heartbeat 'step 1 done' 56 s before the deadline); rank 0 had
reached 'checkpoint at step 1'".

Orphans: every launch carries `FORGE_LAUNCH_OWNER` (the launching process by pid and start time); a
`forge_core.run` worker rank watches it and, once the launcher is gone, SIGKILLs its whole launch (torchrun's
agent, the other ranks, their children) and itself within ~2 s, and refuses to commit meanwhile (`owner.py`).
Every launch is also recorded in a machine-local registry while it runs (`registry.py`); a flow run starts
with `reap_orphaned_launches()`, which ends what is left of launches whose launcher died (a SIGKILLed flow
process cannot run its own clean-up).

GPUs: a launch sees the GPUs of the process that starts it; on the Ray cluster that is the node agent holding
its bundle's GPUs, whose CUDA_VISIBLE_DEVICES Ray sets (forge_core.compute.gang).

Signals: the first SIGTERM to the launching process ends every live launch (`terminate_all_live`: in
parallel, SIGTERM, `kill_grace_s`, SIGKILL; bounded by the largest kill grace + 10 s); a second SIGTERM
meanwhile SIGKILLs every tree at once (`kill_all_live`).

Outcome mapping (first rule that applies):

==========  ===================================================================================
CANCELLED   `handle.cancel()`, the `cancel_event`, `terminate_all_live()` (flow cancel/crash,
            interpreter exit, SIGTERM to the launching process). Not to be retried.
RETRYABLE   the launcher's `deadline_s` passed (the tree is ended first); the reason names the hung rank.
RETRYABLE   the root's exit status was lost because something else reaped it (Popen would report 0);
            FATAL instead if a rank recorded a fatal exception. Never SUCCESS.
SUCCESS     exit code 0 and the launcher stopped nothing.
FATAL       some rank raised an exception classified fatal (`errors.classify_exception`), with the fix
            in the reason: access denied or a missing bucket (`StorageAccessError`, EACCES/EPERM), a
            corrupted or missing input artifact (`ArtifactCorrupted`, `ArtifactNotCommitted`), a full
            disk or quota (ENOSPC/EDQUOT: free space, lower storage.keep_checkpoints / the policy
            cache), a read-only file system, a missing path or one of the wrong kind (ENOENT, EISDIR,
            ENOTDIR: the path named), out of memory (`torch.OutOfMemoryError`, `MemoryError`:
            the fix names micro_batch_size, max_seq_len, activation_checkpoint, rollout.kv_cache_gib /
            max_num_seqs), or a fatal type by class hierarchy: `FatalStageError`, `ValueError` (so
            `ConfigError` and other user errors), `TypeError`, `LookupError`, `AttributeError`,
            `NameError`, `ImportError`, `SyntaxError`, `AssertionError`, `NotImplementedError`,
            `ArithmeticError`; or exited with code 78 (`EXIT_FATAL`, sysexits EX_CONFIG) without an
            exception. `reason` = "rank 1: ValueError: <message>[. Fix: <fix>]"; the traceback tail is
            in `rank_errors[1]`.
RETRYABLE   some rank was killed by a signal (SIGKILL/OOM killer, SIGSEGV, preemption), raised an
            exception classified retryable (`RetryableStageError`, `StorageUnavailable`, transient
            storage and connection errors and other `OSError`s but a missing path, a collective timeout: gloo's
            "Timed out waiting", NCCL's watchdog, `torch.distributed.DistError`; rendezvous errors,
            torchrun's `SignalException`, vLLM's `EngineDeadError`), or exited with code 75
            (`EXIT_RETRYABLE`, EX_TEMPFAIL); also torchrun failing on its own (lost rendezvous/node)
            with no rank error. A collective timeout's reason also names the rank that fell behind.
FATAL       some rank raised any other Python exception (e.g. a plain RuntimeError) and no rank
            died from a signal or a retryable error (then it is taken as that death's collateral).
RETRYABLE   a non-zero exit with no information at all.
==========  ===================================================================================

Reserved child environment: `FORGE_LAUNCH_ID`, `FORGE_LAUNCH_OWNER`, `FORGE_LAUNCH_DEADLINE_S`,
`FORGE_HEARTBEAT_DIR`, `TORCHELASTIC_ERROR_FILE`, `TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE` (set by the
launcher; a `LaunchSpec.env` naming them is rejected).
`PYTHONUNBUFFERED=1` is added unless the environment already sets it.
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
