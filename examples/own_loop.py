"""Train a zoo GPT in your own loop: `parallelize` hands back a module, and the rest is PyTorch.

    torchrun --nproc-per-node 4 examples/own_loop.py --plan 2,2,1 --steps 40 --checkpoint-dir ck

Each data-parallel replica reads its own shard (`DistributedSampler` over `pm.data_parallel_size`;
the ranks of one tensor group read the same), accumulates the gradients of `--accumulate` batches
(`no_sync` until the last), clips them by their global norm, and steps AdamW under a linear
warm-up and a cosine. Every `--eval-every` steps it evaluates a held-out batch of another size
under `eval()` and `no_grad`; checkpoints go through `torch.distributed.checkpoint` (model and
optimizer by the model's own names, each rank writing its shards) and are resumed from. `--plan`
is a one-stage layout DP,TP,1 (`+z3` for ZeRO-3) or omitted (searched on rank 0).
"""

from __future__ import annotations

import argparse
import contextlib
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import autopar


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-tiny")
    parser.add_argument("--plan", default=None)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--accumulate", type=int, default=2, help="batches per optimizer step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--checkpoint-every", type=int, default=20)
    args = parser.parse_args()

    torch.manual_seed(0)
    w = autopar.load_workload(args.model, device="cpu", dtype=torch.float32)
    pm = autopar.parallelize(w.model, None, w.example_inputs, plan=args.plan)  # example: one forward's global batch
    opt = torch.optim.AdamW(pm.parameters(), lr=args.lr, weight_decay=0.1)
    warmup = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1 / args.warmup, total_iters=args.warmup)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, args.steps - args.warmup))
    schedule = torch.optim.lr_scheduler.SequentialLR(opt, [warmup, cosine], milestones=[args.warmup])

    (tokens,), targets = w.make_batch(16 * pm.plan.batch, torch.Generator().manual_seed(1))  # a synthetic corpus
    (held_out,), held_out_target = w.make_batch(pm.plan.batch // 2, torch.Generator().manual_seed(2))
    data = TensorDataset(tokens, targets)
    sampler = DistributedSampler(data, num_replicas=pm.data_parallel_size, rank=pm.data_parallel_rank, seed=0)
    loader = DataLoader(data, batch_size=pm.plan.batch // pm.data_parallel_size, sampler=sampler, drop_last=True)

    step = 0
    if args.checkpoint_dir and os.path.exists(os.path.join(args.checkpoint_dir, ".metadata")):
        model_state, optim_state = get_state_dict(pm, opt)
        state = {"model": model_state, "optim": optim_state, "progress": {"step": 0}}
        dcp.load(state, checkpoint_id=args.checkpoint_dir)
        set_state_dict(pm, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        step = state["progress"]["step"]
        for _ in range(step):
            schedule.step()

    def mean(value: torch.Tensor) -> float:  # over the ranks (a tensor group's hold the same value)
        value = value.detach().clone().double()
        dist.all_reduce(value)
        return float(value) / dist.get_world_size()

    batches = iter(())
    while step < args.steps:
        opt.zero_grad()
        total = 0.0
        for k in range(args.accumulate):
            try:
                inputs, target = next(batches)
            except StopIteration:
                sampler.set_epoch(step)
                batches = iter(loader)
                inputs, target = next(batches)
            last = k == args.accumulate - 1
            with contextlib.nullcontext() if last else pm.no_sync():
                loss = w.loss_fn(pm(inputs), target) / args.accumulate
                loss.backward()
            total += mean(loss)
        norm = torch.nn.utils.clip_grad_norm_(pm.parameters(), 1.0)
        opt.step()
        schedule.step()
        step += 1
        if dist.get_rank() == 0:
            print(f"step {step}: loss {total:.4f}, gradient norm {float(norm):.3f}, lr {schedule.get_last_lr()[0]:.2e}")
        if step % args.eval_every == 0:
            pm.eval()
            share = held_out.shape[0] // pm.data_parallel_size
            mine = slice(pm.data_parallel_rank * share, (pm.data_parallel_rank + 1) * share)
            with torch.no_grad():
                evaluated = mean(w.loss_fn(pm(held_out[mine]), held_out_target[mine]))
            pm.train()
            if dist.get_rank() == 0:
                print(f"step {step}: held-out loss {evaluated:.4f}")
        if args.checkpoint_dir and step % args.checkpoint_every == 0:
            model_state, optim_state = get_state_dict(pm, opt)
            dcp.save({"model": model_state, "optim": optim_state, "progress": {"step": step}},
                     checkpoint_id=args.checkpoint_dir)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
