"""Host time per op of a plan's stage, against the model's own generated code at the same shapes.

One process plays rank 0 of a job of N ranks on a fake process group (collectives return at once,
with rank 0's shapes), one thread, tiny shapes, so that what is timed is the host's work per op:
dispatch, autograd, and the runtime's own (today, DTensor's sharding propagation on every op
that touches a split value). For each model and layout:

- *generated code*: the model exported at rank 0's microbatch shape (`ep.module()`), plain tensors,
  unsharded: what torch itself runs per op;
- *interpreted*: the plan's stage run op by op (`ShardedGraph.interpret` over rank 0's part of the
  graph, its parameters DTensors on the tensor axis): the runtime before issue 38, and today's
  fallback for a stage the lowering cannot trace;
- *lowered*: the same stage as the runtime runs it now (`runtime/lower.py`: its forward and
  backward graphs over local tensors with functional collectives, traced once before timing).

Each is timed forward, and forward + backward (the loss on the stage's output, or a sum on a
pipeline stage's; gradients set to None before each, as a step's `zero_grad` leaves them), in
interleaved rounds, the minimum per program; per op = time / the ops of the model's graph that the
stage holds. Writes docs/benchmarks/results/host_overhead.md.

    python benchmarks/host_overhead.py [--models gpt-tiny,benchmarks/rotary_decoder.py:llama_tiny]
        [--layouts 1,2,1 1,2,2 2,2,1] [--rounds 7]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist
from _page import table, write
from _stamp import stamp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from autopar.cost_models import get_cluster
from autopar.models import load_workload
from autopar.planner.manual import Layout, manual_plan, manual_search
from autopar.planner.search import Search
from autopar.runtime.export import export_as_planned
from autopar.runtime.lower import Program
from autopar.runtime.sharded_graph import ShardedGraph, cut


def _split(inputs: tuple, parts: int) -> tuple:
    return tuple(x.tensor_split(parts)[0] if isinstance(x, torch.Tensor) and x.dim() else x for x in inputs)


def _ops(graph: torch.fx.Graph, names: set[str] | None = None) -> int:
    return sum(1 for n in graph.nodes if n.op == "call_function" and (names is None or n.name in names))


def programs(spec: str, layout: str, world: int) -> dict[str, tuple[Callable[[bool], None], int]]:
    """name -> (run(backward), ops of the model's graph it runs), for rank 0 of `world` under `layout`."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    w = load_workload(spec, device="cpu", dtype=torch.float32)
    cluster = get_cluster("cpu-local").with_ranks(world)
    plan = manual_plan(manual_search(Search.start(w, cluster, (1, world))), Layout.parse(layout))
    dp, tp = plan.stages[0].logical_mesh
    inputs = _split(_split(w.example_inputs, dp), plan.num_microbatches)
    target = _split(_split((w.make_batch(w.batch, torch.Generator().manual_seed(1))[1],), dp),
                    plan.num_microbatches)[0]
    ep = export_as_planned(w.model, inputs, tuple(w.example_inputs))
    plain = ep.module()  # the exported graph's generated code, its own copy of the weights
    mesh = init_device_mesh("cpu", (world // (dp * tp), dp, tp), mesh_dim_names=("pp", "dp", "tp"))["tp"]
    sig = ep.graph_signature
    user = [n.name for n in ep.graph.nodes if n.op == "placeholder" and n.name in sig.user_inputs]
    part = cut(ep.graph, plan, user, sig.user_outputs[0])[0] if len(plan.stages) > 1 else None
    stage = ShardedGraph(w.model, plan.stages[0], mesh, ep, part,
                         layers=[plan.layers[k]["nodes"] for k in range(*plan.stages[0].layers)])
    last = part is None

    def loss(out) -> torch.Tensor:
        if last:
            return w.loss_fn(out, target)
        return sum(o.float().sum() for o in (out if isinstance(out, tuple) else (out,)))

    program = Program({"tp": mesh.get_group()})

    def run_plain(backward: bool) -> None:
        plain.zero_grad(set_to_none=True)
        out = plain(*inputs)
        if backward:
            w.loss_fn(out, target).backward()

    def run_stage(lowered: bool, backward: bool) -> None:
        stage.zero_grad(set_to_none=True)
        stage.program = program if lowered else None
        out = stage(*inputs)
        if backward:
            loss(out).backward()

    run_stage(True, True)  # traced: forward and backward
    if program.fallback is not None:
        raise SystemExit(f"{spec} under {layout} did not lower: {program.fallback}")
    ops = _ops(ep.graph, stage.part.nodes)
    return {"generated code (unsharded)": (run_plain, _ops(ep.graph)),
            "interpreted": (partial(run_stage, False), ops), "lowered": (partial(run_stage, True), ops)}


def measure(progs: dict, rounds: int) -> dict[str, dict[str, float]]:
    """Per program, the minimum over interleaved rounds of forward and of forward + backward."""
    best = {name: {"forward": float("inf"), "forward_backward": float("inf")} for name in progs}
    for name, (run, _) in progs.items():  # warm up: first calls build caches
        run(True)
        run(False)
    for _ in range(rounds):
        for name, (run, _) in progs.items():
            for kind, backward in (("forward", False), ("forward_backward", True)):
                gc.collect()
                start = time.perf_counter()
                run(backward)
                best[name][kind] = min(best[name][kind], time.perf_counter() - start)
    return best


def main(argv: list[str] | None = None) -> int:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt-tiny,benchmarks/rotary_decoder.py:llama_tiny")
    ap.add_argument("--layouts", nargs="+", default=["1,2,1", "1,2,2", "2,2,1"])
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    started = stamp()
    rows = []
    for layout in args.layouts:
        parsed = Layout.parse(layout)
        world = parsed.dp * parsed.tp * parsed.pp
        dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
        try:
            for spec in args.models.split(","):
                progs = programs(spec, layout, world)
                best = measure(progs, args.rounds)
                base = best["generated code (unsharded)"]
                for name, (_, ops) in progs.items():
                    fwd, both = best[name]["forward"], best[name]["forward_backward"]
                    rows.append([spec.rsplit(":", 1)[-1], layout, name, ops, f"{fwd * 1e3:.2f}", f"{fwd / ops * 1e6:.0f}",
                                 f"{both * 1e3:.2f}", f"{both / ops * 1e6:.0f}",
                                 f"{(both / ops) / (base['forward_backward'] / progs['generated code (unsharded)'][1]):.2f}"])
                    print(" | ".join(map(str, rows[-1])), file=sys.stderr, flush=True)
        finally:
            dist.destroy_process_group()
    body = table(["model", "layout", "program", "ops", "forward ms", "µs/op", "forward + backward ms", "µs/op",
                  "per op × generated code"], rows, right=(3, 4, 5, 6, 7, 8))
    print(body)
    write("host_overhead", started, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
