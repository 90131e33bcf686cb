"""What a user writes: build, parallelize, train, fall off the end (no destroy_process_group).
Under `benchmarks/repeat_jobs.py --runs 100 --nproc 2 -- benchmarks/exit_tp_script.py 1,2,1`."""
import sys

import torch

import autopar

plan = sys.argv[1] if len(sys.argv) > 1 else "1,2,1"
torch.manual_seed(0)
w = autopar.load_workload("gpt-tiny", device="cpu", dtype=torch.float32)
pm = autopar.parallelize(w.model, None, w.example_inputs, loss_fn=w.loss_fn, plan=plan,
                         optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
g = torch.Generator().manual_seed(1)
for _ in range(3):
    pm.step(*w.make_batch(w.batch, g))
