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
