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

With `--compile`, also each compiled by inductor: the model's generated code under `torch.compile`,
and the lowered stage with `compile=True` (as `parallelize(..., compile=True)` runs it).

Each is timed forward, and forward + backward (the loss on the stage's output, or a sum on a
pipeline stage's; gradients set to None before each, as a step's `zero_grad` leaves them), in
interleaved rounds, the minimum per program; per op = time / the ops of the model's graph that the
stage holds. Writes docs/benchmarks/results/host_overhead.md.

On a GPU (`--device cuda`, issue 38's item 6: models of real size, e.g. `gpt-small` and
`rotary_decoder.py:llama_small`) a call returns once its kernels are queued: each program is timed
twice per round, the *host* time until the call returns and the *step* time until the GPU has
finished (synchronised before and after), the median over rounds; then one forward + backward
under the profiler for the GPU's busy time (its kernels' and copies' own time), the calls that
made the host wait for the GPU and the asynchronous copies issued. Collectives still return at
once (one rank's program, its communication left out). Writes host_overhead-cuda.md.

    python benchmarks/host_overhead.py [--models gpt-tiny,benchmarks/rotary_decoder.py:llama_tiny]
        [--layouts 1,2,1 1,2,2 2,2,1] [--rounds 7] [--device cuda] [--compile]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import traceback
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


def _to(x, device: str):
    return x.to(device) if isinstance(x, torch.Tensor) else x


def _split(inputs: tuple, parts: int) -> tuple:
    return tuple(x.tensor_split(parts)[0] if isinstance(x, torch.Tensor) and x.dim() else x for x in inputs)


def _ops(graph: torch.fx.Graph, names: set[str] | None = None) -> int:
    return sum(1 for n in graph.nodes if n.op == "call_function" and (names is None or n.name in names))


def programs(spec: str, layout: str, world: int, device: str = "cpu",
             compiled: bool = False) -> dict[str, tuple[Callable[[bool], None], int]]:
    """name -> (run(backward), ops of the model's graph it runs), for rank 0 of `world` under `layout`
    on `device`; with `compiled`, also the generated code and the lowered stage compiled by inductor."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    w = load_workload(spec, device="cpu", dtype=torch.float32)
    w.model.to(device)
    w.example_inputs = tuple(_to(x, device) for x in w.example_inputs)
    cluster = get_cluster("cpu-local").with_ranks(world)
    plan = manual_plan(manual_search(Search.start(w, cluster, (1, world))), Layout.parse(layout))
    dp, tp = plan.stages[0].logical_mesh
    inputs = _split(_split(w.example_inputs, dp), plan.num_microbatches)
    target = _split(_split((w.make_batch(w.batch, torch.Generator().manual_seed(1))[1].to(device),), dp),
                    plan.num_microbatches)[0]
    ep = export_as_planned(w.model, inputs, tuple(w.example_inputs))
    plain = ep.module()  # the exported graph's generated code, its own copy of the weights
    mesh = init_device_mesh(device, (world // (dp * tp), dp, tp), mesh_dim_names=("pp", "dp", "tp"))["tp"]
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

    def run_plain(module: Callable, backward: bool) -> None:
        plain.zero_grad(set_to_none=True)
        out = module(*inputs)
        if backward:
            w.loss_fn(out, target).backward()

    def run_stage(program: Program | None, backward: bool) -> None:
        stage.zero_grad(set_to_none=True)
        stage.program = program
        out = stage(*inputs)
        if backward:
            loss(out).backward()

    progs = {"generated code (unsharded)": (partial(run_plain, plain), _ops(ep.graph))}
    if compiled:
        progs["generated code, torch.compile"] = (partial(run_plain, torch.compile(plain)), _ops(ep.graph))
    ops = _ops(ep.graph, stage.part.nodes)
    progs["interpreted"] = (partial(run_stage, None), ops)
    for name, compile in (("lowered", False), ("lowered, compiled", True))[:1 + compiled]:
        program = Program({"tp": mesh.get_group()}, compile=compile)
        run_stage(program, True)  # traced (and compiled): forward and backward
        if program.fallback is not None:
            raise RuntimeError(f"{spec} under {layout} did not lower: {program.fallback}")
        progs[name] = (partial(run_stage, program), ops)
    return progs


def measure(progs: dict, rounds: int, cuda: bool = False) -> dict[str, dict[str, list[float]]]:
    """Per program, forward and forward + backward over interleaved rounds: the host's time until the
    call returns ("forward", "forward_backward") and, on a GPU, until its kernels finish (… "_step")."""
    times = {name: {} for name in progs}
    for name, (run, _) in progs.items():  # warm up: first calls build caches (and compile)
        for _ in range(2):
            run(True)
            run(False)
    for _ in range(rounds):
        for name, (run, _) in progs.items():
            for kind, backward in (("forward", False), ("forward_backward", True)):
                gc.collect()
                if cuda:
                    torch.cuda.synchronize()
                start = time.perf_counter()
                run(backward)
                times[name].setdefault(kind, []).append(time.perf_counter() - start)
                if cuda:
                    torch.cuda.synchronize()
                    times[name].setdefault(kind + "_step", []).append(time.perf_counter() - start)
    return times


WAITS = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy"}


def kernels(progs: dict, times: dict) -> None:
    """Per program, one forward + backward under the profiler: the GPU's busy time (the kernels' and
    copies' own time; "kernels"), the calls that make the host wait for the GPU ("waits") and the
    asynchronous memory copies issued ("copies"), so a step's time can be read as the host's or the GPU's."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    for name, (run, _) in progs.items():
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run(True)
            torch.cuda.synchronize()
        events = prof.key_averages()
        on_gpu = [e for e in events if e.device_type == DeviceType.CUDA]  # not the CPU ops that launched them
        times[name]["kernels"] = [sum(e.self_device_time_total for e in on_gpu) / 1e6]
        calls = {e.key: e.count for e in events}
        times[name]["waits"] = [sum(calls.get(k, 0) for k in WAITS) - 1]  # less our own synchronize
        times[name]["copies"] = [calls.get("cudaMemcpyAsync", 0)]


def main(argv: list[str] | None = None) -> int:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt-tiny,benchmarks/rotary_decoder.py:llama_tiny")
    ap.add_argument("--layouts", nargs="+", default=["1,2,1", "1,2,2", "2,2,1"])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--compile", action="store_true", help="also the programs inductor compiles")
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    torch.set_num_threads(1)
    started = stamp()
    rows = []
    for layout in args.layouts:
        parsed = Layout.parse(layout)
        world = parsed.dp * parsed.tp * parsed.pp
        dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
        try:
            for spec in args.models.split(","):
                try:
                    progs = programs(spec, layout, world, args.device, args.compile)
                    times = measure(progs, args.rounds, cuda)
                    if cuda:
                        kernels(progs, times)
                except Exception as exc:  # one model's failure is a row, not the end of the others
                    traceback.print_exc()
                    rows.append([spec.rsplit(":", 1)[-1], layout, f"failed: {type(exc).__name__}: {exc}"[:200]])
                    continue
                rows += _rows(spec.rsplit(":", 1)[-1], layout, progs, times, cuda)
        finally:
            dist.destroy_process_group()
    if cuda:
        body = table(["model", "layout", "program", "ops", "forward host ms", "forward step ms",
                      "forward + backward host ms", "µs/op", "forward + backward step ms", "GPU busy ms", "host waits",
                      "copies", "step × generated code"], rows, right=tuple(range(3, 13)))
    else:
        body = table(["model", "layout", "program", "ops", "forward ms", "µs/op", "forward + backward ms", "µs/op",
                      "per op × generated code"], rows, right=(3, 4, 5, 6, 7, 8))
    print(body)
    write("host_overhead-cuda" if cuda else "host_overhead", started, body)
    return 0


def _rows(model: str, layout: str, progs: dict, times: dict, cuda: bool) -> list[list[str]]:
    """On the CPU, each program's minimum and its time per op against the generated code's; on a GPU,
    medians, host and step, the step against the generated code's."""
    base = "generated code (unsharded)"
    rows = []
    for name, (_, ops) in progs.items():
        t = {kind: (statistics.median if cuda else min)(v) for kind, v in times[name].items()}
        ms = {kind: f"{v * 1e3:.2f}" for kind, v in t.items()}
        if cuda:
            ratio = t["forward_backward_step"] / statistics.median(times[base]["forward_backward_step"])
            rows.append([model, layout, name, ops, ms["forward"], ms["forward_step"], ms["forward_backward"],
                         f"{t['forward_backward'] / ops * 1e6:.0f}", ms["forward_backward_step"], ms["kernels"],
                         f"{t['waits']:.0f}", f"{t['copies']:.0f}", f"{ratio:.2f}"])
        else:
            per_op = (t["forward_backward"] / ops) / (min(times[base]["forward_backward"]) / progs[base][1])
            rows.append([model, layout, name, ops, ms["forward"], f"{t['forward'] / ops * 1e6:.0f}",
                         ms["forward_backward"], f"{t['forward_backward'] / ops * 1e6:.0f}", f"{per_op:.2f}"])
        print(" | ".join(map(str, rows[-1])), file=sys.stderr, flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(main())
