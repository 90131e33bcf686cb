"""The `autopar` command line. Every command prints a readable report, or JSON with `--json`;
bad input gives one message and exit status 2 (`--debug` adds the traceback)."""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from typing import Any, Callable

import torch
from rich.console import Console
from rich.table import Table

from autopar.errors import AutoparError
from autopar.units import human, human_bytes

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def cmd_clusters(args: argparse.Namespace, out: Console) -> Any:
    from cost_models import PRESETS, ClusterSpec, calibration_file

    clusters = [PRESETS[name]() for name in PRESETS] + [ClusterSpec.load(path) for path in args.files]
    if args.json:
        return {"clusters": [c.to_dict() for c in clusters], "calibration_file": str(calibration_file())}
    table = Table(title="cluster presets")
    for col in ("name", "mesh", "device", "fp16", "fp32", "memory", "intra-host", "inter-host"):
        table.add_column(col, no_wrap=True)
    for c in clusters:
        d = c.device
        table.add_row(
            c.name, f"{c.num_hosts}x{c.devices_per_host}", d.name,
            human(d.flops_for("float16"), "FLOP/s"), human(d.flops_for("float32"), "FLOP/s"),
            human_bytes(d.memory_bytes),
            f"{human(c.intra_host.bandwidth, 'B/s')} {c.intra_host.latency * 1e6:.0f}µs",
            f"{human(c.inter_host.bandwidth, 'B/s')} {c.inter_host.latency * 1e6:.0f}µs",
        )
    out.print(table)
    for c in clusters:
        out.print(f"  {c.name}: {c.description}")
    out.print(f"cpu-local is read from {calibration_file()} when that file exists ($AUTOPAR_CLUSTER overrides).")
    return None


def cmd_inspect(args: argparse.Namespace, out: Console) -> Any:
    from autopar.models import load_workload
    from autopar.summary import inspect_workload

    with Console(stderr=True).status(f"capturing {args.model} …", spinner="dots"):
        workload = load_workload(args.model, batch=args.batch, dtype=DTYPES.get(args.dtype))
        report = inspect_workload(workload)
    if args.json:
        return report
    table = Table(title=f"{report['model']}  (batch {report['batch']}, {report['dtype']})")
    for col in ("#", "layer", "ops", "FLOPs fwd", "FLOPs bwd", "params", "activations"):
        table.add_column(col, justify="left" if col == "layer" else "right")
    for layer in report["layers"]:
        table.add_row(
            str(layer["index"]), layer["name"], str(layer["num_ops"]),
            human(layer["flops_forward"]), human(layer["flops_backward"]),
            human_bytes(layer["param_bytes"]), human_bytes(layer["activation_bytes"]),
        )
    table.add_section()
    table.add_row(
        "", "total", str(report["num_nodes"]), human(report["flops_forward"]), human(report["flops_backward"]),
        human_bytes(report["param_bytes"]), human_bytes(sum(layer["activation_bytes"] for layer in report["layers"])),
    )
    out.print(table)
    out.print(f"{report['num_params']:,} parameters · graph {report['graph_hash']} · "
              f"captured in {report['capture_time_s']:.2f} s")
    for warning in report["warnings"]:
        out.print(f"[yellow]warning:[/] {warning}")
    return None


def cmd_plan(args: argparse.Namespace, out: Console) -> Any:
    from rich.progress import Progress

    from autopar.jsonio import write_json
    from autopar.models import load_workload
    from autopar.planner import parse_mesh, plan_single_stage
    from cost_models import get_cluster

    mesh = parse_mesh(args.mesh)
    if args.stages != 1:
        raise AutoparError("only --stages 1 is planned so far (the intra-op pass); pipeline stages come with "
                           "the inter-op pass")
    cluster = get_cluster(args.cluster)
    limit = args.memory_limit * 2**30 if args.memory_limit else None
    with Progress(console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(f"capturing {args.model}", total=None)
        workload = load_workload(args.model, batch=args.batch)

        def step(logical: tuple[int, int]) -> None:
            bar.update(task, description=f"sharding on logical mesh {logical[0]}x{logical[1]}")

        plan = plan_single_stage(workload, cluster, mesh, memory_limit=limit, time_limit_s=args.time_limit,
                                 progress=step)
    if args.out:
        write_json(args.out, plan)
    if args.json:
        return plan
    _print_plan(plan, out)
    if args.out:
        out.print(f"plan written to {args.out}")
    return None


def _print_plan(plan: dict, out: Console) -> None:
    stage = plan["stages"][0]
    table = Table(title=f"{plan['model']} (batch {plan['batch']}) on {plan['cluster']} {plan['mesh'][0]}x{plan['mesh'][1]}")
    for col in ("logical mesh (dp × tp)", "step time", "memory / device", "solver"):
        table.add_column(col, justify="right")
    for c in sorted((c for c in plan["candidates"] if "step_time_s" in c), key=lambda c: c["step_time_s"]):
        chosen = c["logical_mesh"] == stage["logical_mesh"]
        table.add_row(("→ " if chosen else "") + f"{c['logical_mesh'][0]} × {c['logical_mesh'][1]}",
                      f"{c['step_time_s'] * 1e3:.2f} ms", human_bytes(c["peak_memory_bytes"]), c["solver_status"])
    out.print(table)
    for c in plan["candidates"]:
        if "rejected" in c:
            out.print(f"  {c['logical_mesh'][0]} × {c['logical_mesh'][1]} rejected: {c['rejected']}")
    cost = stage["cost"]
    out.print("predicted step: " + ", ".join(f"{k.removesuffix('_s')} {v * 1e3:.2f} ms" for k, v in cost.items()))
    weights = Table(title="parameter placements [data axis, tensor axis] (biases and norms omitted)")
    weights.add_column("layers")
    weights.add_column("placements")
    for names, text in _placement_runs(stage["params"]):
        weights.add_row(names, text)
    out.print(weights)
    solver = stage["solver"]
    out.print(f"ILP: {solver['status']}, {solver['ilp_nodes']} strategy groups for {solver['anchors']} ops, "
              f"{solver['variables']} variables, solved in {solver['time_s']:.2f} s · planned in "
              f"{plan['planning_time_s']:.1f} s (capture {plan['capture_time_s']:.1f} s)")


def _placement_runs(params: dict[str, list[str]]) -> list[tuple[str, str]]:
    """Weights grouped by layer; consecutive layers with the same placements share one row."""
    by_layer: dict[str, list[str]] = {}
    for fqn, placement in params.items():
        if fqn.endswith(".weight") and len(fqn.split(".")) > 2 and "ln" not in fqn and "norm" not in fqn or \
                fqn.count(".") == 1 and fqn.endswith("weight"):
            parts = fqn.split(".")
            cut = next((i + 1 for i, p in enumerate(parts) if p.isdigit()), 1)
            by_layer.setdefault(".".join(parts[:cut]), []).append(
                f"{'.'.join(parts[cut:])} {'/'.join(placement)}")
    runs: list[tuple[list[str], str]] = []
    for layer, items in by_layer.items():
        text = " · ".join(items)
        if runs and runs[-1][1] == text:
            runs[-1][0].append(layer)
        else:
            runs.append(([layer], text))
    return [(names[0] if len(names) == 1 else f"{names[0]} … {names[-1]} ({len(names)})", text) for names, text in runs]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="autopar", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, func: Callable, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        p.add_argument("--json", action="store_true", help="print JSON for scripts")
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks of errors")
        p.set_defaults(func=func)
        return p

    p = command("clusters", cmd_clusters, "list cluster presets (and check cluster files)")
    p.add_argument("files", nargs="*", help="cluster JSON files to validate and show beside the presets")
    p = command("inspect", cmd_inspect, "capture a model and show per-layer FLOPs, parameters and activations")
    p.add_argument("model", help="zoo name (e.g. gpt-1.3b), FILE.py:FUNCTION or package.module:FUNCTION")
    p.add_argument("--batch", type=int, help="global batch (default: the model's suite default)")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="build zoo models in this dtype")
    p = command("plan", cmd_plan, "plan how to shard a model over a cluster (intra-op ILP per logical mesh)")
    p.add_argument("model", help="zoo name, FILE.py:FUNCTION or package.module:FUNCTION")
    p.add_argument("--cluster", default="cpu-local", help="preset name or cluster JSON file (default cpu-local)")
    p.add_argument("--mesh", required=True, help="HOSTSxDEVICES, e.g. 1x8")
    p.add_argument("--batch", type=int, help="global batch (default: the model's suite default)")
    p.add_argument("--stages", type=int, default=1, help="pipeline stages (only 1 so far)")
    p.add_argument("--memory-limit", type=float, help="GiB per device the plan may use (default: 90%% of memory)")
    p.add_argument("--time-limit", type=float, default=30.0, help="seconds per ILP solve (default 30)")
    p.add_argument("--out", help="write the plan JSON here")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    out = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
    try:
        result = args.func(args, out)
    except AutoparError as exc:
        if args.debug:
            traceback.print_exc()
        Console(stderr=True, highlight=False, soft_wrap=True).print(f"[bold red]error:[/] {exc}", markup=True)
        return 2
    if result is not None:
        sys.stdout.write(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
