"""A gloo job that exits without destroy_process_group (after pytorch/pytorch#190489): the minimal
reproducer of the exit crash, without autopar. Under `benchmarks/repeat_jobs.py`, e.g.
`--runs 200 --nproc 4 -- benchmarks/exit_without_destroy.py` (add `destroy` to destroy the group)."""

import sys

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.full((1 << 16,), float(dist.get_rank()))
for _ in range(20):
    work = dist.all_reduce(t, async_op=True)
    work.wait()
out = [torch.empty(1 << 16) for _ in range(dist.get_world_size())]
dist.all_gather(out, t)
if len(sys.argv) > 1 and sys.argv[1] == "destroy":
    dist.destroy_process_group()
