"""Train a zoo GPT under an autopar plan: the loop a user writes, on every rank of a torchrun job.

    torchrun --nproc-per-node 4 examples/train_gpt.py --plan 2,2,1 --steps 40 --checkpoint-dir ck

Each rank loads only its data-parallel shard (a `DistributedSampler` over `pm.data_parallel_size`
replicas), the learning rate warms up linearly and then follows a cosine, gradients are clipped by
their global norm over every axis, a held-out batch is evaluated with `predict` every
`--eval-every` steps, and checkpoints (any plan can load them) are written and resumed from.
`--plan` is a layout DP,TP,PP[,MB], a plan JSON written by `autopar plan --out`, or omitted
(searched on rank 0 for this machine).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import autopar
from autopar.runtime import checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-tiny")
    parser.add_argument("--plan", default=None)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=5, help="steps of linear warm-up before the cosine")
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--checkpoint-every", type=int, default=20)
    args = parser.parse_args()

    torch.manual_seed(0)
    w = autopar.load_workload(args.model, device="cpu", dtype=torch.float32)
    pm = autopar.parallelize(w.model, None, w.example_inputs, loss_fn=w.loss_fn, plan=args.plan,
                             optimizer=lambda params: torch.optim.AdamW(params, lr=args.lr, weight_decay=0.1),
                             max_grad_norm=args.max_grad_norm)
    warmup = torch.optim.lr_scheduler.LinearLR(pm.optimizer, start_factor=1 / args.warmup, total_iters=args.warmup)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(pm.optimizer, T_max=max(1, args.steps - args.warmup))
    schedule = torch.optim.lr_scheduler.SequentialLR(pm.optimizer, [warmup, cosine], milestones=[args.warmup])

    # a synthetic corpus; each data-parallel replica reads its own shard of every epoch
    (tokens,), targets = w.make_batch(8 * pm.plan.batch, torch.Generator().manual_seed(1))
    held_out_inputs, held_out_target = w.make_batch(pm.plan.batch, torch.Generator().manual_seed(2))
    sampler = DistributedSampler(TensorDataset(tokens, targets), num_replicas=pm.data_parallel_size,
                                 rank=pm.data_parallel_rank, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(TensorDataset(tokens, targets), batch_size=pm.plan.batch // pm.data_parallel_size,
                        sampler=sampler, drop_last=True)

    step = 0
    if args.checkpoint_dir and (found := checkpoint.agreed_latest(args.checkpoint_dir)) is not None:
        saved = checkpoint.load(pm, found)
        step = saved["step"]
        schedule.load_state_dict(saved["schedule"])
    epoch, done = divmod(step, len(loader))  # a resumed run goes on where the data was
    while step < args.steps:
        sampler.set_epoch(epoch)
        for i, (batch_tokens, batch_targets) in enumerate(loader):
            if i < done:
                continue
            if step == args.steps:
                break
            loss = pm.step((batch_tokens,), batch_targets, local=True)  # this replica's shard only
            schedule.step()
            step += 1
            if dist.get_rank() == 0:
                print(f"step {step}: loss {loss:.4f}  grad norm {pm.last_grad_norm:.3f}  "
                      f"lr {schedule.get_last_lr()[0]:.2e}")
            if step % args.eval_every == 0 or step == args.steps:
                held_out = w.loss_fn(pm.predict(held_out_inputs), held_out_target)  # the global batch, every rank
                if dist.get_rank() == 0:
                    print(f"step {step}: held-out loss {held_out.item():.4f}")
            if args.checkpoint_dir and (step % args.checkpoint_every == 0 or step == args.steps):
                checkpoint.save(pm, args.checkpoint_dir, step, {"schedule": schedule.state_dict()})
        epoch, done = epoch + 1, 0
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
