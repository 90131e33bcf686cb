"""Runtime overhead: autopar's data- and tensor-parallel runtime against what people write by hand.

Same model (zoo `gpt-tiny`, host-bound, and `gpt-small` by default), same ranks (gloo, one thread
each), same global batch:
- pure DP: `parallelize(plan="N,1,1")` against `torch.nn.parallel.DistributedDataParallel`, by
  `step` and as a module in the user's own loop (`pm(x)`, `loss.backward()`, `opt.step()`);
- pure TP: `parallelize(plan="1,N,1")` — the lowered program (the runtime's default), the same
  stage interpreted op by op through DTensor (the runtime before the lowering, and its fallback),
  the module in the user's loop, and with `--compile` the lowered program compiled by inductor —
  against `parallelize_module` with
  torchtitan's layout (column-parallel Q/K/V and fc1, row-parallel proj and fc2,
  vocabulary-parallel embedding and output layer, local head count in attention).
With `--compile`, also the data-parallel plan with `compile=True` (no graph to lower: the module
blocks each under `torch.compile`, `parallel.compile_blocks`).
All are built first; then each step of the batches runs every runtime in turn (in an order
shuffled from step to step, so that a drift of the machine's speed reaches them alike), `--warmup` steps
(the first lowers, or compiles) and `--steps` timed ones, in `--runs` separate starts of the ranks; a row gives the median of the runs' medians and their spread (the
noise floor), and the ratio against the hand-written baseline. Run it alone: other work on the
cores skews the times. Prints the table and writes it to docs/benchmarks/results/runtime_overhead.md
(not with `--json`, whose output is for programs).

    python benchmarks/runtime_overhead.py [--models gpt-tiny,gpt-small] [--nproc 2] [--steps 20]
        [--runs 3] [--compile] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
import types

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from _page import table, write
from _stamp import stamp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from autopar.runtime.backend import join_local, local_store


def _optimizer(params):
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def _local_heads(self, x):
    """Attention with this rank's heads (what a hand-written TP model does, e.g. torchtitan)."""
    b, t, c = x.shape
    hd = c // self.heads
    q, k, v = (lin(x).view(b, t, -1, hd).transpose(1, 2) for lin in (self.q, self.k, self.v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return self.proj(y.transpose(1, 2).reshape(b, t, -1))


def _hand_tp(model, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (world,))
    layout = {"wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
              "lm_head": ColwiseParallel(output_layouts=Replicate())}
    for i, block in enumerate(model.h):
        block.attn.forward = types.MethodType(_local_heads, block.attn)
        for name in ("attn.q", "attn.k", "attn.v", "mlp.fc1"):
            layout[f"h.{i}.{name}"] = ColwiseParallel()
        for name in ("attn.proj", "mlp.fc2"):
            layout[f"h.{i}.{name}"] = RowwiseParallel()
    parallelize_module(model, mesh, layout)
    model.lm_head.weight = model.wte.weight  # both Shard(0) over the vocabulary: tie them again
    return model


def _rank(rank, world, port, out, args):
    join_local("gloo", port, rank, world)
    torch.set_num_threads(1)
    import autopar

    gen = torch.Generator().manual_seed(1)
    first = autopar.load_workload(args.model, batch=args.batch, device="cpu")
    batches = [first.make_batch(first.batch, gen) for _ in range(args.warmup + args.steps)]
    steps = {}
    for kind in args.kinds:
        torch.manual_seed(0)
        w = autopar.load_workload(args.model, batch=args.batch, device="cpu")
        if kind.endswith("-module"):  # the user's own loop around the module parallelize returns
            plan = f"{world},1,1" if kind.startswith("autopar-dp") else f"1,{world},1"
            pm = autopar.parallelize(w.model, (1, world), w.example_inputs, plan=plan)
            opt = _optimizer(list(pm.parameters()))
            dp, index = pm.data_parallel_size, pm.data_parallel_rank

            def step(inputs, target, pm=pm, opt=opt, loss_fn=w.loss_fn, dp=dp, index=index):
                opt.zero_grad(set_to_none=True)
                loss = loss_fn(pm(*(x.tensor_split(dp)[index] for x in inputs)), target.tensor_split(dp)[index])
                loss.backward()
                opt.step()
                return loss.item()
        elif kind.startswith("autopar"):
            plan = f"{world},1,1" if kind.startswith("autopar-dp") else f"1,{world},1"
            pm = autopar.parallelize(w.model, (1, world), w.example_inputs, loss_fn=w.loss_fn, optimizer=_optimizer,
                                     plan=plan, compile=kind.endswith("-compiled"))
            if kind == "autopar-tp-interpreted":
                pm.graph.program = None  # op by op through DTensor
            step = pm.step
        else:
            if kind == "ddp":
                model = torch.nn.parallel.DistributedDataParallel(w.model)
                part = lambda t: t.tensor_split(world)[rank]
            else:
                model = _hand_tp(w.model, world)
                part = lambda t: t
            opt = _optimizer(list(model.parameters()))

            def step(inputs, target, model=model, opt=opt, part=part, loss_fn=w.loss_fn):
                opt.zero_grad(set_to_none=True)
                loss = loss_fn(model(*(part(x) for x in inputs)), part(target))
                loss.backward()
                opt.step()
                return loss.item()
        steps[kind] = step
    # step by step, every runtime in turn: a drift of the machine's speed during the run reaches them
    # all alike, as `farm-bench --vs` pairs its runs. In an order shuffled every step (the same on
    # every rank): a fixed rotation has each runtime follow the same one nearly every step, and the
    # one after the interpreted runtime (whose dispatch churns caches and the allocator) measured
    # 8 % slower than the same program after another (gpt-tiny, 2026-11-27)
    times = {kind: [] for kind in args.kinds}
    for i, (inputs, target) in enumerate(batches):
        order = list(args.kinds)
        random.Random(i).shuffle(order)
        for kind in order:
            dist.barrier()
            start = time.perf_counter()
            steps[kind](inputs, target)
            if i >= args.warmup:
                times[kind].append(time.perf_counter() - start)
    results = {kind: statistics.median(t) for kind, t in times.items()}
    if rank == 0:
        for kind, t in results.items():
            print(f"  {kind}: {t * 1e3:.1f} ms per step", file=sys.stderr, flush=True)
    if rank == 0:
        torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()


KINDS = {"data parallel": ("ddp", "DistributedDataParallel", ["autopar-dp", "autopar-dp-module", "autopar-dp-compiled"]),
         "tensor parallel": ("hand-tp", "parallelize_module",
                             ["autopar-tp-interpreted", "autopar-tp", "autopar-tp-module", "autopar-tp-compiled"])}
NAMES = {"autopar-dp": "autopar", "autopar-dp-module": "autopar as a module (your loop)",
         "autopar-dp-compiled": "autopar, compiled", "autopar-tp-interpreted": "autopar, interpreted (DTensor per op)",
         "autopar-tp": "autopar, lowered", "autopar-tp-module": "autopar, lowered, as a module (your loop)",
         "autopar-tp-compiled": "autopar, lowered + compiled"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt-tiny,gpt-small")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="also the lowered program compiled by inductor")
    ap.add_argument("--kinds", default=None, help="only these runtimes, comma-separated (e.g. ddp,autopar-dp,"
                    "autopar-dp-module): a study of one row; the page is not written")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    chosen = args.kinds
    args.kinds = ["ddp", "autopar-dp", "autopar-dp-module", "hand-tp", "autopar-tp-interpreted", "autopar-tp",
                  "autopar-tp-module"] + (
        ["autopar-dp-compiled", "autopar-tp-compiled"] if args.compile else [])
    if chosen:
        args.kinds = chosen.split(",")
    started = stamp()
    rows, body_rows, module_rows = [], [], []
    for model in args.models.split(","):
        args.model = model
        runs = []
        for run in range(args.runs):
            out = os.path.join(tempfile.mkdtemp(), "times.pt")
            print(f"{model} on {args.nproc} gloo ranks, {args.steps} timed steps each, run {run + 1} of {args.runs}",
                  file=sys.stderr)
            with local_store() as port:
                mp.spawn(_rank, args=(args.nproc, port, out, args), nprocs=args.nproc)
            runs.append(torch.load(out))
        for layout, (base, base_name, kinds) in KINDS.items():
            if base not in args.kinds:
                continue
            b = [r[base] for r in runs]
            for kind in (k for k in kinds if k in args.kinds):
                a = [r[kind] for r in runs]
                ratios = [x / y for x, y in zip(a, b)]
                rows.append({"model": model, "layout": layout, "baseline": base_name, "runtime": NAMES[kind],
                             "baseline_s": statistics.median(b), "autopar_s": statistics.median(a),
                             "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)})
                r = rows[-1]
                body_rows.append([model, layout, base_name, f"{r['baseline_s'] * 1e3:.1f}", r["runtime"],
                                  f"{r['autopar_s'] * 1e3:.1f}", f"{r['ratio']:.2f}",
                                  f"{r['ratio_min']:.2f}–{r['ratio_max']:.2f}"])
        for axis, (stepped, called) in {"data parallel": ("autopar-dp", "autopar-dp-module"),
                                        "tensor parallel": ("autopar-tp", "autopar-tp-module")}.items():
            if stepped not in args.kinds or called not in args.kinds:
                continue
            ratios = [r[called] / r[stepped] for r in runs]  # the module path against `step`, run by run
            module_rows.append([model, axis, f"{statistics.median(r[stepped] for r in runs) * 1e3:.1f}",
                                f"{statistics.median(r[called] for r in runs) * 1e3:.1f}",
                                f"{statistics.median(ratios):.2f}", f"{min(ratios):.2f}–{max(ratios):.2f}"])
            rows.append({"model": model, "layout": axis, "baseline": "pm.step", "runtime": NAMES[called],
                         "ratio_to_step": statistics.median(ratios)})
    if args.json:
        print(json.dumps({"models": args.models, "nproc": args.nproc, "runs": args.runs, "rows": rows}))
        return 0
    body = table(["model", f"layout ({args.nproc} ranks)", "baseline", "baseline ms/step", "autopar runtime",
                  "autopar ms/step", "ratio (median of runs)", "ratio over runs"], body_rows, right=(3, 5, 6, 7))
    body += ("\nThe module path (`pm(x)`, `loss.backward()`, `opt.step()` in your loop) against `pm.step` on the "
             "same plan:\n\n" + table(["model", f"layout ({args.nproc} ranks)", "pm.step ms/step", "module ms/step",
                                        "ratio (median of runs)", "ratio over runs"], module_rows, right=(2, 3, 4, 5)))
    print(body)
    if chosen is None:
        write("runtime_overhead", started, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
