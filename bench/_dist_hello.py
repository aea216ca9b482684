"""The smallest torchrun worker for the dispatch benchmarks: join a gloo group, all-reduce once, exit."""

import torch
import torch.distributed as dist

from forge_core.launch.guard import guard_launched_worker

if __name__ == "__main__":
    guard_launched_worker()
    dist.init_process_group("gloo")
    dist.all_reduce(torch.ones(1))
    dist.destroy_process_group()
