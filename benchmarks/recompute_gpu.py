"""Recomputation on one CUDA device (NCCL, a job of one): the same plan with and without
`recompute`, losses and CUDA's peak allocated bytes of a step, beside the planner's prediction of
the stage's activations.

No test depends on a GPU; this script is what the GPU recomputation figures of docs/memory.md come from
(recorded on an H100; not re-run since).
fp32 with TF32 off; `--steps` steps of SGD with momentum, the peak of the last step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

import autopar
from autopar.cost_models import get_cluster
from autopar.planner.manual import Layout, manual_plan, manual_search
from autopar.planner.search import Search


def run(model: str, batch: int, recompute: bool, steps: int) -> dict:
    torch.manual_seed(0)
    w = autopar.load_workload(model, batch=batch, device="cuda", dtype=torch.float32)
    cluster = dataclasses.replace(get_cluster("a100-dgx"), devices_per_host=1)
    plan = manual_plan(manual_search(Search.start(w, cluster, (1, 1))), Layout(1, 1, 1, 1, recompute))
    pm = autopar.parallelize(w.model, (1, 1), w.example_inputs, loss_fn=w.loss_fn, plan=plan,
                             optimizer=lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9))
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        inputs, target = w.make_batch(batch, gen)
        inputs = tuple(x.cuda() if isinstance(x, torch.Tensor) else x for x in inputs)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        losses.append(pm.step(inputs, target.cuda()))
        torch.cuda.synchronize()
    stage = plan.stages[0]
    return {"model": model, "batch": batch, "recompute": recompute, "losses": losses,
            "peak_allocated_bytes": torch.cuda.max_memory_allocated(), "allocated_before_step_bytes": before,
            "step_peak_above_start_bytes": torch.cuda.max_memory_allocated() - before,
            "predicted_peak_bytes": plan.estimate.peak_memory_bytes, "predicted_stage": stage.cost}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-small")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    rows = [run(args.model, args.batch, rc, args.steps) for rc in (False, True)]
    worst = max(abs(a - b) / abs(b) for a, b in zip(rows[0]["losses"], rows[1]["losses"]))
    print(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows, "max_rel_diff": worst}, indent=1))


if __name__ == "__main__":
    main()
