"""Memory choices on this machine: hand-written layouts planned against a cluster (this machine's
calibration, by default `cpu-local`), run on local ranks started once (`autopar.bench.measure`:
AdamW, 2 warm-up and 5 timed steps, the slowest rank's median, the largest rank's peak of live
tensors), beside the plan's predicted step time and peak. A layout is `DP,TP,PP[,MB]` with `+z1`
/ `+z2` for ZeRO-1/2, `+recompute` / `+selective` for recomputation of whole layers / attention,
or `zero3:` before it for every weight sharded over the data axis. Prints a Markdown table and
writes it to docs/benchmarks/results/NAME.md (`--name`, default memory_choices).

    autopar calibrate --nproc 2 --out cal.json
    python benchmarks/memory_choices.py --cluster cal.json --nproc 2 --model gpt-small --name memory_choices-zero \\
        2,1,1,4 2,1,1,4+z1 2,1,1,4+z2 zero3:2,1,1,4 2,1,1,1 2,1,1,1+z1
    python benchmarks/memory_choices.py --cluster cal.json --nproc 2 --model gpt-small-eager \\
        --name memory_choices-recompute 2,1,1,4 2,1,1,4+selective 2,1,1,4+recompute 2,1,1,1 \\
        2,1,1,1+selective 2,1,1,1+recompute
"""

from __future__ import annotations

import argparse
import dataclasses
import os

import torch
from _page import table, write
from _stamp import stamp

from autopar.bench import measure
from autopar.cost_models import get_cluster
from autopar.models import load_workload
from autopar.planner.manual import Layout, manual_plan, manual_search
from autopar.planner.search import Search

HEADER = ["layout", "microbatches", "predicted ms", "measured ms", "predicted peak MiB", "measured peak MiB"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("layouts", nargs="+")
    parser.add_argument("--model", default="gpt-small")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--cluster", default="cpu-local")
    parser.add_argument("--name", default="memory_choices", help="the page fragment to write (one per study)")
    args = parser.parse_args()
    started = stamp()
    cluster = dataclasses.replace(get_cluster(args.cluster), devices_per_host=args.nproc)
    w = load_workload(args.model, device="cpu", dtype=torch.float32)
    search = Search.start(w, cluster, (1, args.nproc))
    plain, sharded = manual_search(search), manual_search(search, zero3=True)
    plans = [manual_plan(sharded if text.startswith("zero3:") else plain, Layout.parse(text.removeprefix("zero3:")))
             for text in args.layouts]
    print(f"load average at the start: {os.getloadavg()[0]:.2f}")
    rows = [[text, plan.num_microbatches, f"{plan.estimate.step_time_s * 1e3:.0f}", f"{step * 1e3:.0f}",
             f"{plan.estimate.peak_memory_bytes / 2**20:.1f}", f"{peak / 2**20:.1f}"]
            for text, plan, (step, peak, *_) in zip(args.layouts, plans, measure(args.model, args.nproc, None, plans))]
    body = table(HEADER, rows, right=(1, 2, 3, 4, 5))
    print(body)
    write(args.name, started, body)


if __name__ == "__main__":
    main()
