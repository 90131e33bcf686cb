"""Predicted against measured memory: every layout `autopar bench` runs (recomputing and bf16
ones included), each rank's peak of live tensor bytes in a step (`runtime.memory`, by category)
beside the planner's prediction for its stage (states + activations in flight + transient).

    python benchmarks/memory_truth.py --model gpt-small --nproc 4 [--json]
    python benchmarks/memory_truth.py --model benchmarks/rotary_decoder.py:llama_small

AdamW; one warm-up step (the optimizer's state exists from then on), then the measured one. Prints
a Markdown table and writes it, with a picture of predicted against measured peaks, to
docs/benchmarks/results/memory_truth.md (and .png); not with `--json`, whose output is for programs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _page import against, picture, table, write
from _stamp import stamp

from autopar.runtime.backend import join_local, local_store


def _rank(rank: int, world: int, port: int, model: str, batch: int | None, plans: list[str], out: str) -> None:
    import autopar
    from autopar.contract.plan import Plan
    from autopar.runtime.memory import measured_step

    torch.set_num_threads(1)
    join_local("gloo", port, rank, world)
    rows = []
    for text in plans:
        plan = Plan.from_json(text)
        torch.manual_seed(0)
        w = autopar.load_workload(model, batch=batch, device="cpu", dtype=torch.float32)
        pm = autopar.parallelize(w.model, (1, world), w.example_inputs, loss_fn=w.loss_fn, plan=plan,
                                 optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4),
                                 mixed_precision=plan.precision or "fp32")
        gen = torch.Generator().manual_seed(1)
        pm.step(*w.make_batch(w.batch, gen))
        _, measured = measured_step(pm, *w.make_batch(w.batch, gen))
        stage = getattr(pm, "stage_index", 0)
        cost = plan.stages[stage].cost
        rows.append({"layout": plan.name, "microbatches": plan.num_microbatches, "recompute": plan.stages[stage].recompute,
                     "precision": plan.precision or "fp32", "stage": stage, "predicted": cost["peak_bytes"],
                     "predicted_states": cost["state_bytes"], "predicted_transient": cost.get("transient_bytes", 0.0),
                     "measured": measured})
        del pm
    gathered = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        torch.save(gathered, out)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    from autopar.bench import candidate_plans
    from autopar.cost_models import get_cluster

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-small")
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--layouts", default="", help="only the layouts whose name matches this regular expression "
                        "(their table goes to the terminal, not the docs)")
    args = parser.parse_args()
    started = stamp()
    cluster = get_cluster("cpu-local").with_ranks(args.nproc)
    plans = [p for p in candidate_plans(args.model, args.nproc, cluster, args.batch)
             if re.search(args.layouts, f"{p.name} {p.schedule}")]
    with tempfile.TemporaryDirectory() as tmp, local_store() as port:
        out = os.path.join(tmp, "rows.pt")
        mp.spawn(_rank, args=(args.nproc, port, args.model, args.batch, [p.to_json() for p in plans], out),
                 nprocs=args.nproc, join=True)
        per_rank = torch.load(out, weights_only=False)
    rows = []
    for i in range(len(plans)):  # one row per layout: its rank of the largest measured peak
        worst = max((ranks[i] for ranks in per_rank), key=lambda r: r["measured"]["total"])
        worst["ratio"] = worst["measured"]["total"] / worst["predicted"]
        rows.append(worst)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    body = table(HEADER, [_row(r) for r in rows], right=(2, 3, 4, 5, 6, 7))
    print(body)
    if args.layouts:  # a subset: not the record
        return
    name = "memory_truth-" + re.sub(r"[^a-z0-9]+", "-", Path(args.model).stem.lower() if ":" not in args.model
                                     else args.model.rsplit(":", 1)[1].lower()) + f"-{args.nproc}-ranks"
    against(picture(name), {"layouts": ([r["predicted"] / 1e6 for r in rows],
                                        [r["measured"]["total"] / 1e6 for r in rows])},
            "peak MB", f"peak memory per layout: {args.model}, {args.nproc} ranks")
    write(name, started, body + f"\n![predicted against measured peak memory per layout](results/{name}.png)\n")


HEADER = ["layout", "precision", "stage", "predicted MB", "measured MB", "measured / predicted",
          "states MB predicted / measured", "activations + temporaries MB predicted / measured"]


def _row(r: dict) -> list:
    m = r["measured"]
    states = m["parameters"] + m["gradients"] + m["optimizer"]
    rest = r["predicted"] - r["predicted_states"]
    return [r["layout"], r["precision"], r["stage"], f"{r['predicted'] / 1e6:.2f}", f"{m['total'] / 1e6:.2f}",
            f"{r['ratio']:.2f}", f"{r['predicted_states'] / 1e6:.1f} / {states / 1e6:.1f}",
            f"{rest / 1e6:.1f} / {(m['activations'] + m['temporaries']) / 1e6:.1f}"]


if __name__ == "__main__":
    main()
