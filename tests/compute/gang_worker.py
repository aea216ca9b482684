"""A gloo worker for the gang tests: `python -m gang_worker --mode success|hang --pid-dir DIR`.

Every rank runs the owner guard a stage worker runs (so its launch ends when the node agent that owns it dies),
joins a gloo group, all-reduces its rank + 1 and prints one line with what it saw. In `hang` mode it then
writes its pid to `--pid-dir` and sleeps, so a test can remove its node or stop the attempt.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist

from forge_core.launch.guard import guard_launched_worker


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["success", "hang"], default="success")
    parser.add_argument("--pid-dir", default=None)
    args = parser.parse_args()
    guard_launched_worker()
    dist.init_process_group("gloo")
    total = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(total)
    print(
        f"gang-rank {dist.get_rank()} of {dist.get_world_size()} node_rank {os.environ.get('GROUP_RANK')} "
        f"sum {total.item():g} cuda_visible {os.environ.get('CUDA_VISIBLE_DEVICES', '')} "
        f"arenas {os.environ.get('MALLOC_ARENA_MAX')} nice {os.getpriority(os.PRIO_PROCESS, 0)} "
        f"threads {torch.get_num_threads()}",
        flush=True,
    )
    if args.mode == "hang":
        with open(os.path.join(args.pid_dir, f"rank{dist.get_rank()}.pid"), "w") as out:
            out.write(str(os.getpid()))
        print(f"gang-rank {dist.get_rank()} waiting", flush=True)
        time.sleep(3600)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
