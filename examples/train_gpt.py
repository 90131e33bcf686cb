"""Train a zoo GPT under an autopar plan on every rank of a torchrun job.

    torchrun --nproc-per-node 4 examples/train_gpt.py --model gpt-tiny --plan 4,1,1 --steps 10

`--plan` is a layout DP,TP,PP[,MB], a plan JSON written by `autopar plan --out`, or omitted
(searched on rank 0 for this machine), e.g. `--plan 2,2,1` (data × tensor) or `--plan 2,1,2`
(data × pipeline) on 4 ranks.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import autopar


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-tiny")
    parser.add_argument("--plan", default=None)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()

    torch.manual_seed(0)  # the same initial weights on every rank
    w = autopar.load_workload(args.model, device="cpu", dtype=torch.float32)
    pm = autopar.parallelize(w.model, None, w.example_inputs, loss_fn=w.loss_fn, plan=args.plan,
                             optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3))
    data = torch.Generator().manual_seed(1)  # the same global batches on every rank
    for step in range(args.steps):
        inputs, target = w.make_batch(w.batch, data)
        loss = pm.step(inputs, target)
        if dist.get_rank() == 0:
            print(f"step {step}: loss {loss:.4f}  data-parallel bytes {pm.comm_stats()['dp']['bytes_sent']:,}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
