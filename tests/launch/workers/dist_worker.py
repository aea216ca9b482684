"""A real gloo worker for the launcher tests: `python -m dist_worker --mode <mode> [--target-rank R]`.

Every rank joins a gloo group and all-reduces (so the group is really up), prints `--lines` numbered
lines, then the target rank(s) behave as `--mode` says while the others wait at a barrier.
Pids of every process it creates go to `--pid-dir` so tests can check that nothing survives.

`--mode stall` runs like a trainer instead: the group comes from forge_core's `init_distributed` (its
collectives time out after `--pg-timeout-s`, default: above the launch's deadline), every rank sends the
heartbeats of one optimizer step, then the target rank stops while the others send "step 2" and wait for it
in an all-reduce.
"""

import argparse
import os
import signal
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from forge_core.launch import record_errors


def parse_args(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--mode", choices=["success", "raise-value", "sigkill", "hang", "stall"], default="success"
    )
    parser.add_argument("--pg-timeout-s", type=float, default=None, help="stall mode's collective timeout")
    parser.add_argument("--target-rank", type=int, default=-1, help="-1 = every rank")
    parser.add_argument("--lines", type=int, default=0)
    parser.add_argument("--pid-dir", default=None)
    parser.add_argument("--ignore-sigterm", action="store_true")
    return parser.parse_args(argv)


def write_pid(pid_dir, name, pid):
    if pid_dir:
        with open(os.path.join(pid_dir, f"{name}.pid"), "w") as f:
            f.write(str(pid))


def spawn_descendants(pid_dir, rank):
    """A child in its own session, and an orphan that only FORGE_LAUNCH_ID can find."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    write_pid(pid_dir, f"rank{rank}-child", child.pid)
    out = subprocess.run(
        ["sh", "-c", "sleep 600 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True, check=True
    )
    write_pid(pid_dir, f"rank{rank}-orphan", int(out.stdout.strip()))


def stall(args, rank):
    from forge_core.engine.distributed import init_distributed, process_group_timeout_s
    from forge_core.launch.heartbeat import beat

    init_distributed("cpu", timeout_s=args.pg_timeout_s)
    print(f"collectives time out after {args.pg_timeout_s or process_group_timeout_s():g} s", flush=True)
    beat(rank, 0, "step 1")
    beat(rank, 1, "step 1 done")
    if args.target_rank in (-1, rank):
        print(f"stalling rank={rank}", flush=True)
        while True:
            time.sleep(1)
    beat(rank, 1, "step 2")
    dist.all_reduce(torch.ones(1))


@record_errors
def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    write_pid(args.pid_dir, f"rank{rank}", os.getpid())
    if args.mode == "stall":
        return stall(args, rank)
    dist.init_process_group("gloo")
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    assert total.item() == world * (world + 1) / 2, total
    print(f"all_reduce ok rank={rank} sum={total.item():g}")
    for i in range(args.lines):
        print(f"line {i} of rank {rank}")
    targeted = args.target_rank in (-1, rank)
    if targeted and args.mode == "raise-value":
        raise ValueError(f"optimizer.lr=-1.0 on rank {rank}: must be > 0; set optimizer.lr to e.g. 3e-4")
    if targeted and args.mode == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if targeted and args.mode == "hang":
        spawn_descendants(args.pid_dir, rank)
        if args.ignore_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print(f"hanging rank={rank}")
        while True:
            time.sleep(1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
