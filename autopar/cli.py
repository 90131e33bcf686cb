"""The `autopar` command line. Every command prints a readable report, or JSON with `--json`;
bad input gives one message and exit status 2 (`--debug` adds the traceback)."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from autopar.contract import schedules
from autopar.contract.errors import AutoparError
from autopar.contract.jsonio import read_json, write_json
from autopar.contract.limits import MAX_MEMORY_BYTES, MAX_SECONDS, check_counts
from autopar.contract.placements import Placement
from autopar.contract.plan import Plan
from autopar.contract.precision import parse_precision
from autopar.contract.units import human, human_bytes, human_time, printable, span
from autopar.cost_models import PRESETS, ClusterSpec, calibration_file, collective_time, get_cluster
from autopar.models import load_workload
from autopar.planner.auto import plan_auto
from autopar.planner.manual import Layout, deepspeed_moe_plan, has_experts, layout_grid, manual_plan, manual_search
from autopar.planner.plan_cache import asked, cached
from autopar.planner.search import RESERVE, Search, parse_mesh, plan_compressed, warn_time_limited, warn_unmeasured
from autopar.planner.unruled import warn_replicated
from autopar.summary import inspect_workload

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def cmd_clusters(args: argparse.Namespace, out: Console) -> Any:
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
    with Console(stderr=True).status(f"capturing {escape(printable(args.model))} …", spinner="dots"):
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
        out.print(Text.assemble(("warning:", "yellow"), f" {warning}"))
    return None


def _search(args: argparse.Namespace):
    for flag, value, most in (("--time-limit", args.time_limit, MAX_SECONDS),
                              ("--memory-limit", args.memory_limit, MAX_MEMORY_BYTES / 2**30)):
        if value is not None and not 0 < value <= most:
            raise AutoparError(f"{flag} must be a positive number, got {value:g} (at most {most:g})")
    mesh = parse_mesh(args.mesh)
    cluster = get_cluster(args.cluster)
    workload = load_workload(args.model, batch=args.batch)
    limit = args.memory_limit * 2**30 if args.memory_limit else None
    return Search.start(workload, cluster, mesh, memory_limit=limit, schedule=args.schedule,
                        time_limit_s=args.time_limit, precision=parse_precision(args.mixed_precision))


def _progress(description: str):
    from rich.progress import Progress

    bar = Progress(console=Console(stderr=True), transient=True)
    description = escape(printable(description))  # a model path may hold "[", which rich reads as markup
    task = bar.add_task(description, total=None)
    return bar, lambda text: bar.update(task, description=f"{description}: {escape(printable(text))}")


def _check_out(flag: str, path: str | None, folder_ok: bool = False, make: bool = False) -> None:
    """An output path that can be written, said before the work that fills it (a plan found in
    minutes is not lost to a typo): not an existing folder (unless `folder_ok`), in a folder that
    exists (or that `make` creates) and this user can write."""
    if path is None:
        return
    target = Path(path)
    if target.is_dir() and not folder_ok:
        raise AutoparError(f"{flag} {path} is a folder: give a file name")
    if target.exists() and not target.is_dir() and folder_ok:
        raise AutoparError(f"{flag} {path} is a file: give a folder")
    parent = target if folder_ok else target.parent
    existing = next((p for p in (parent, *parent.parents) if p.exists()), Path("."))
    if not make and existing != parent:
        raise AutoparError(f"{flag} {path}: the folder {parent} does not exist")
    if not (existing.is_dir() and os.access(existing, os.W_OK | os.X_OK)):
        raise AutoparError(f"{flag} {path}: {existing} is not a folder this user can write")


def cmd_plan(args: argparse.Namespace, out: Console) -> Any:
    import time

    _check_out("--out", args.out)

    start = time.perf_counter()
    bar, step = _progress(f"planning {args.model}")
    say = Console(stderr=True, highlight=False, soft_wrap=True).print if args.json else out.print  # JSON alone on stdout
    with bar:
        step("capturing")
        search = _search(args)
        if args.stages is not None and not 1 <= args.stages <= min(len(search.layers), search.cluster.num_devices):
            raise AutoparError(f"--stages {args.stages}: {args.model} has {len(search.layers)} layers and the mesh "
                               f"{search.cluster.num_devices} devices; choose 1 to {min(len(search.layers), search.cluster.num_devices)}")
        if args.virtual is not None and (not args.manual or not 1 <= args.virtual <= len(search.layers)):
            raise AutoparError(f"--virtual {args.virtual}: the stages per device group of a --manual layout, 1 to "
                               f"{len(search.layers)} (the search chooses it itself)")
        if args.sequence_parallel and not args.manual:
            raise AutoparError("--sequence-parallel lays out a --manual layout; the search weighs sequence "
                               "parallelism itself")
        if (args.zero or args.offload) and not args.manual:
            raise AutoparError("--zero and --offload lay out a --manual layout; the search weighs ZeRO-1/2 and "
                               "offloading per stage itself")
        if args.tune is not None:
            if args.manual or args.compression or args.stages:
                raise AutoparError("--tune measures the best predicted layouts of the free search: leave out "
                                   "--manual, --compression and --stages")
            from autopar.bench import tune_locally

            plan = tune_locally(search, args.model, args.tune, args.batch, progress=step)
        elif args.manual:
            layout = Layout.parse(args.manual, args.recompute, args.virtual or 1, args.sequence_parallel, args.zero or 0,
                                  args.offload)
            plan = cached(search, asked(layout, None, args.compression),
                          lambda: plan_compressed(search, args.compression,
                                                  lambda s: manual_plan(manual_search(s), layout), step), say)
        else:
            plan = cached(search, asked(None, args.stages, args.compression),
                          lambda: plan_compressed(search, args.compression,
                                                  lambda s: plan_auto(s, stages=args.stages, progress=step), step),
                          say)
    elapsed = time.perf_counter() - start
    warn_replicated(search.graph, plan)
    warn_unmeasured(plan, sum(math.prod(search.graph.params[f].shape) for f in search.graph.trainable))
    if args.out:
        plan.save(args.out)
    if args.json:
        return {**plan.to_dict(), "planning_time_s": round(elapsed, 3)}
    _print_plan(plan, out)
    if "cached" not in plan.search:
        out.print(f"planned in {elapsed:.1f} s ({plan.search.get('ilp_solves', 0)} ILP solves, "
                  f"{plan.search.get('cache_hits', 0)} cache hits)" + (f" · written to {args.out}" if args.out else ""))
    elif args.out:
        out.print(f"written to {args.out}")
    return None


def cmd_show(args: argparse.Namespace, out: Console) -> Any:
    _check_out("--png", args.png)
    plan = Plan.load(args.plan)
    if args.png:
        _picture(plan, args.png)
    if args.json:
        return {**plan.to_dict(), **({"png": args.png} if args.png else {})}
    _print_plan(plan, out)
    if args.png:
        out.print(f"schedule, device map and memory drawn to {args.png}")
    return None


def _picture(plan, path: str) -> None:
    from autopar.draw import save

    try:
        limit = get_cluster(plan.cluster).device.memory_bytes * (1 - RESERVE)
    except AutoparError:  # a cluster file the plan names only by name: no limit line
        limit = None
    try:
        save(plan, path, limit)
    except ImportError:
        raise AutoparError("drawing needs matplotlib: pip install -e \".[plot]\"") from None
    except OSError as exc:
        raise AutoparError(f"cannot write {path}: {exc}") from None


def cmd_compare(args: argparse.Namespace, out: Console) -> Any:
    bar, step = _progress(f"comparing layouts for {args.model}")
    with bar:
        step("capturing")
        search = _search(args)
        auto = plan_auto(search, progress=step)
        warn_time_limited(auto, search.costs.time_limit_s)
        manual_view = manual_search(search)
        manual = []
        for layout in layout_grid(manual_view, (True,) if args.recompute else (False, True)):
            step(layout.name)
            plan = manual_plan(manual_view, layout)
            manual.append({"name": plan.name, "dp": layout.dp, "tp": layout.tp, "pp": layout.pp,
                           "recompute": layout.recompute, "num_microbatches": plan.num_microbatches,
                           **_estimate(plan)})
        if has_experts(search):  # the layout Alpa compared its MoE results against
            step("deepspeed-moe")
            plan = deepspeed_moe_plan(search)
            devices = search.mesh[0] * search.mesh[1]
            manual.append({"name": plan.name, "dp": devices, "tp": 1, "pp": 1, "recompute": False,
                           "num_microbatches": plan.num_microbatches, **_estimate(plan)})
    manual.sort(key=lambda r: (not r["fits"], r["step_time_s"]))
    result = {"model": args.model, "batch": search.workload.batch, "cluster": search.cluster.name,
              "mesh": list(search.mesh),
              "auto": {"stages": [{"layers": list(s.layers), "submesh": list(s.submesh),
                                   "logical_mesh": list(s.logical_mesh), "recompute": s.recompute,
                                   "recompute_layers": s.recompute_layers,
                                   "recompute_granularity": s.recompute_granularity, "zero": _zero_level(s),
                                   "offload": bool(s.offload)}
                                  for s in auto.stages],
                       "num_microbatches": auto.num_microbatches, "schedule": auto.schedule, "virtual": auto.virtual,
                       # the stage DP's plan, or the hand-written layout the floor priced faster (`planner.auto`)
                       "found_by": auto.search.get("floor") or "stage DP", **_estimate(auto)},
              "manual": manual}
    if args.json:
        return result
    table = Table(title=f"{args.model} (batch {result['batch']}) on {printable(result['cluster'])} {args.mesh}: predicted")
    for col in ("layout", "dp", "tp", "pp", "microbatches", "step time", "TFLOP/s per device", "memory", "fits"):
        table.add_column(col, justify="left" if col == "layout" else "right")
    rows = [{"name": "auto (" + ", ".join(f"{s.submesh[0]}x{s.submesh[1]}" for s in auto.stages) + f"; {auto.schedule}"
             + (f" v{auto.virtual}" if auto.virtual > 1 else "") + ")",
             "dp": "", "tp": "", "pp": len(auto.stages), "num_microbatches": auto.num_microbatches,
             **result["auto"]}] + manual
    for r in sorted(rows, key=lambda r: (not r["fits"], r["step_time_s"])):
        table.add_row(r["name"], str(r["dp"]), str(r["tp"]), str(r["pp"]), str(r["num_microbatches"]),
                      human_time(r["step_time_s"]), f"{r['tflops_per_device']:.1f}",
                      human_bytes(r["peak_memory_bytes"]), "yes" if r["fits"] else Text("no", style="red"))
    out.print(table)
    return None


def cmd_calibrate(args: argparse.Namespace, out: Console) -> Any:
    import torch

    from autopar.calibrate import calibrate, cluster_spec, term_spread

    _check_out("--out", args.out, make=True)
    if args.from_bench:
        return _fit(args, out)
    if args.nproc < (1 if torch.cuda.is_available() else 2):
        raise AutoparError(f"--nproc {args.nproc}: links are measured between ranks; use at least 2 "
                           "(one rank is measured alone on a GPU only)")
    if args.repeats < 1:
        raise AutoparError(f"--repeats must be at least 1, got {args.repeats}")
    bar, step = _progress("calibrating")
    with bar:
        measured = calibrate(args.nproc, step, args.repeats)
    spec = cluster_spec(measured, args.nproc)
    terms = term_spread(measured, args.nproc)
    path = args.out or str(calibration_file())
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    spec.save(path)
    link, shared = spec.intra_host, max(1.0, args.nproc / (spec.cores_per_host or args.nproc))
    rows = [{"ranks": n, "collective": kind, "bytes": nbytes, "measured_s": t,
             "fitted_s": collective_time(kind, nbytes, n, link) * max(1.0, n / (spec.cores_per_host or n))}
            for n, fits in measured["links"].items() for kind, fit in fits.items()
            for nbytes, t in zip(fit["sizes"], fit["times"])]
    if args.json:
        return {"cluster": spec.to_dict(), "path": path, "conv2d_flops": measured["device"]["conv2d_flops"],
                "matmul_peak_flops": measured["device"].get("matmul_peak_flops", {}),
                "overlap": measured["overlap"], "runtime": measured["runtime"], "collectives": rows,
                "terms": terms, "repeats": args.repeats, "pinned": measured["pinned"]}
    dev = spec.device
    out.print("linear layers " + ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s (half of it at {dev.half_flops_for(k) / 1e6:.1f}"
                                           f" MFLOP)" for k, v in dev.peak_flops.items())
              + "; square matmuls at best " + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in
                                                        measured["device"].get("matmul_peak_flops", {}).items())
              + f" GFLOP/s; loss {dev.loss_bandwidth / 1e9:.1f} GB/s of logits; conv2d "
              + ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s" for k, v in measured["device"]["conv2d_flops"].items())
              + f"; memory {dev.memory_bandwidth / 1e9:.1f} GB/s")
    out.print(f"per op: {human_time(dev.op_overhead_s)}, in a lowered sharded stage "
              f"{human_time(dev.lowered_op_overhead_s)} more, on DTensors {human_time(dev.sharded_op_overhead_s)} more "
              f"(an optimizer step {human_time(dev.optimizer_dtensor_s)} more per DTensor parameter); "
              f"{args.nproc} ranks on {spec.cores_per_host} cores (each at 1/{shared:g} when all compute); "
              f"an all-reduce hides {link.overlap:.0%} behind computation; ranks drift ±{dev.jitter * 1e3:.1f} ms over "
              f"1 s of computation, ±{dev.jitter * 1e3 * 0.1:.1f} ms over 10 ms (the square root of the time)")
    if dev.compressor_s:
        out.print("gradient compressors, per tensor (a bucket for fp16, randk, topk, signsgd) + per Mi elements: "
                  + ", ".join(f"{k} {human_time(a)} + {human_time(b * 2**20)}" for k, (a, b) in dev.compressor_s.items()))
    table = Table(title=f"collectives on {args.nproc} local ranks: measured, and the ring formulas with "
                        f"α {human_time(link.latency)}, {link.bandwidth / 1e9:.2f} GB/s fitted to the all-reduces, "
                        f"all-gathers × {link.gather_factor:.2f}, reduce-scatters × {link.scatter_factor:.2f}")
    for col in ("ranks", "collective", "bytes", "measured", "fitted"):
        table.add_column(col, justify="right")
    for r in rows:
        if r["bytes"] in (min(x["bytes"] for x in rows if x["ranks"] == r["ranks"] and x["collective"] == r["collective"]),
                          max(x["bytes"] for x in rows if x["ranks"] == r["ranks"] and x["collective"] == r["collective"])):
            table.add_row(str(r["ranks"]), r["collective"], human_bytes(r["bytes"]), human_time(r["measured_s"]),
                          human_time(r["fitted_s"]))
    out.print(table)
    spread = Table(title=f"the calibrated terms over {args.repeats} starts of the ranks: each measured number the "
                         "median of its starts; spread (max - min) / median of the term from each start alone")
    for col in ("term", "value", "spread"):
        spread.add_column(col, justify="left" if col == "term" else "right")
    for name, t in terms.items():
        spread.add_row(name, f"{t['value']:.4g}", f"{t['spread']:.1%}")
    out.print(spread)
    out.print(f"each rank on a core of its own ({', '.join(map(str, measured['pinned']))})" if measured["pinned"] else
              f"{args.nproc} ranks share this machine's cores ({spec.cores_per_host}): give each a core for times "
              "a GPU cluster's ranks would see")
    out.print(f"written to {path}" + (" (cpu-local reads it)" if path == str(calibration_file()) else
                                      f" (use it with --cluster {path})"))
    return None


def _fit(args: argparse.Namespace, out: Console) -> Any:
    """`calibrate --from BENCH.json`: the cluster's parameters fitted to a bench's measurements."""
    from autopar.fit import fit

    try:
        bench = read_json(args.from_bench, "bench file")
    except (OSError, ValueError) as exc:
        raise AutoparError(f"--from {args.from_bench}: not a readable JSON file ({exc}); give what "
                           "`autopar bench ... --json` printed") from None
    if not isinstance(bench, dict) or not {"model", "nproc", "layouts"} <= set(bench):
        raise AutoparError(f"--from {args.from_bench}: not the JSON of `autopar bench` (model, nproc, layouts)")
    cluster = get_cluster(args.cluster or str(calibration_file()))
    bar, step = _progress("fitting")
    with bar:
        result = fit(bench, cluster, step)
    path = args.out or str(calibration_file())
    result["cluster"].save(path)
    result = {**result, "cluster": result["cluster"].to_dict(), "path": path}
    if args.json:
        return result
    table = Table(title=f"{bench['model']} on {bench['nproc']} ranks: measured, calibrated and fitted predictions")
    for col in ("layout", "measured", "calibrated", "fitted", "held out"):
        table.add_column(col, justify="left" if col == "layout" else "right")
    for r in result["layouts"]:
        table.add_row(r["name"], human_time(r["measured_step_time_s"]), human_time(r["calibrated_s"]),
                      human_time(r["fitted_s"]), "yes" if r["held_out"] else "")
    out.print(table)
    out.print("factors on each parameter's time: " + ", ".join(f"{k} ×{v:.2f}" for k, v in result["factors"].items()))
    b, a = result["error_before"], result["error_after"]
    out.print(f"median |error|: fitted layouts {b['fitted']:.0%} → {a['fitted']:.0%}, held-out layouts "
              f"{b['held_out']:.0%} → {a['held_out']:.0%}; written to {path}")
    return None


def cmd_bench(args: argparse.Namespace, out: Console) -> Any:
    from autopar.bench import bench

    check_counts(args.nproc, args.steps, args.warmup, args.launches)
    if args.launches < 1:
        raise AutoparError(f"--launches must be at least 1, got {args.launches}")
    _check_out("--breakdown", args.breakdown, folder_ok=True, make=True)
    cluster = get_cluster(args.cluster)
    cluster = cluster.with_ranks(args.nproc)  # local ranks sharing fewer cores: plan for what runs
    bar, step = _progress(f"benchmarking {args.model}")
    with bar:
        result = bench(args.model, args.nproc, cluster, args.batch, args.warmup, args.steps, step,
                       args.mixed_precision, breakdown=args.breakdown is not None, compile=args.compile,
                       launches=args.launches)
    if args.breakdown:
        os.makedirs(args.breakdown, exist_ok=True)
        for r in result["layouts"]:
            write_json(os.path.join(args.breakdown, r["name"].replace(" ", "_").replace(",", "-") + ".json"),
                       {"model": args.model, "cluster": cluster.name, **r})
    if args.json:
        return result
    table = Table(title=f"{args.model} on {args.nproc} local ranks: predicted ({printable(cluster.name)}) and measured "
                        "(peak: tensors of the rank holding most)")
    for col in ("layout", "microbatches", "predicted", "measured", "spread", "measured / fastest", "predicted peak",
                "measured peak", "measured / predicted", "stages lowered"):
        table.add_column(col, justify="left" if col == "layout" else "right")
    fastest = min(r["measured_step_time_s"] for r in result["layouts"])
    for r in sorted(result["layouts"], key=lambda r: r["measured_step_time_s"]):
        table.add_row(r["name"], str(r["num_microbatches"]), human_time(r["predicted_step_time_s"]),
                      human_time(r["measured_step_time_s"]), f"{r['spread']:.1%}",
                      f"{r['measured_step_time_s'] / fastest:.2f}",
                      human_bytes(r["predicted_peak_bytes"]), human_bytes(r["measured_peak_bytes"]),
                      f"{r['measured_peak_bytes'] / r['predicted_peak_bytes']:.2f}",
                      f"{sum(p['runs'] != 'interpreted' for p in r['programs'])}/{len(r['programs'])}")
    out.print(table)
    noise, pinned = result["noise"], result["pinned"]
    out.print(f"Spearman rank correlation {result['spearman']:.2f} over {len(result['layouts'])} layouts; "
              f"the searched plan measures {result['auto_vs_fastest']:.2f}× the fastest"
              + (" (a tie: their launches overlap)" if result["auto_tied_with_fastest"] else ""))
    out.print(f"noise over {result['launches']} launches (each a median of {args.steps} steps): spread (max - min) / "
              f"median {noise['median_spread']:.1%} median, {noise['max_spread']:.1%} at most; {noise['ties']} of "
              f"{noise['pairs']} layout pairs tied, {noise['ordered']:.0%} of the others predicted in their measured "
              f"order; "
              + (f"each rank on a core of its own ({', '.join(map(str, pinned))})" if pinned else
                 f"{args.nproc} ranks share this machine's cores: the times rank the layouts, their scale is not a "
                 "GPU cluster's"))
    for r in result["refused"]:
        out.print(f"[bold]{printable(r['name'])}[/bold] refused when built, not measured: {printable(r['why'])}")
    return None


def cmd_train(args: argparse.Namespace, out: Console) -> Any:
    from autopar.runtime.memory import CATEGORIES
    from autopar.train import TrainJob, launch

    job = TrainJob(args.model, args.nproc, args.steps, args.plan, args.batch, args.cluster, args.compression,
                   args.delay, args.checkpoint_dir, args.checkpoint_every, args.resume, args.timeout,
                   args.mixed_precision, args.memory_limit * 2**30 if args.memory_limit is not None else None,
                   args.resume_from, args.compile)
    with Console(stderr=True).status(f"training {escape(printable(args.model))} on {args.nproc} rank(s)"):
        result = launch(job, quiet=not args.debug)
    if args.json:
        return result
    extra = (f", {result['compression']}" if result["compression"] else "") + (
        f", averaging delayed {result['delay']} steps" if result["delay"] else "")
    table = Table(title=f"{args.model}, plan {result['plan']}{extra}, {args.nproc} rank(s), global batch {result['batch']}")
    table.add_column("step", justify="right")
    table.add_column("loss", justify="right")
    for i, loss in enumerate(result["losses"]):
        table.add_row(str(i) + (" (checkpoint)" if i < result["start_step"] else ""), f"{loss:.4f}")
    out.print(table)
    if result["step_time_s"] is not None:
        out.print(f"{human_time(result['step_time_s'])} per step (median), {result['samples_per_s']:.1f} samples/s")
    for p in result["programs"]:
        said = {"lowered": "lowered: {n} collectives per microbatch (forward and backward)",
                "interpreted": "interpreted, DTensor per op: {why}", "eager": "the model's own module (no tensor axis)"}
        out.print(f"stage {p['stage']}: " + said[p["runs"]].format(n=len(p.get("collectives") or []), why=p["why"]))
    if result["peak_tensor_bytes"][0] is not None:
        memory = Table(title="peak live tensor bytes of the last step, per rank (RSS: the whole process)")
        for column in ("rank", *CATEGORIES, "total", "RSS"):
            memory.add_column(column, justify="right")
        for rank, (tensors, rss) in enumerate(zip(result["peak_tensor_bytes"], result["peak_rss_bytes"])):
            memory.add_row(str(rank), *(human_bytes(tensors[c]) for c in (*CATEGORIES, "total")), human_bytes(rss))
        out.print(memory)
    return None


def _estimate(plan) -> dict[str, Any]:
    e = plan.estimate
    return {"step_time_s": e.step_time_s, "tflops_per_device": e.tflops_per_device,
            "peak_memory_bytes": e.peak_memory_bytes, "bubble_fraction": e.bubble_fraction, "fits": e.fits}


def _zero_level(stage) -> int:
    """The ZeRO level a stage runs: its own (1, 2), 3 where its weights are sharded on dp (S(0)), else 0."""
    return stage.zero or (3 if any(p[0] == "S(0)" for p in stage.params.values()) else 0)


def _print_plan(plan, out: Console) -> None:
    out.print(plan.summary())
    table = Table(title="stages")
    for col in ("#", "layers", "submesh", "dp × tp", "recompute", "ZeRO", "fwd / mb", "bwd / mb", "send", "grad sync",
                "model states"):
        table.add_column(col, justify="right")
    for i, s in enumerate(plan.stages):
        names = [plan.layers[k]["name"] for k in range(*s.layers)]
        c = {k: s.cost.get(k, 0.0) for k in ("forward_s", "backward_s", "send_s", "grad_sync_s", "state_bytes")}
        table.add_row(str(i), span(names), f"{s.submesh[0]}x{s.submesh[1]}", f"{s.logical_mesh[0]} × {s.logical_mesh[1]}",
                      (f"first {s.recompute_layers}" if s.recompute_layers else s.recompute_granularity or "yes")
                      if s.recompute else "",
                      f"{_zero_level(s) or ''}{'+offload' if s.offload else ''}", human_time(c["forward_s"]), human_time(c["backward_s"]),
                      human_time(c["send_s"]), human_time(c["grad_sync_s"]), human_bytes(c["state_bytes"]))
    out.print(table)
    if any(s.collectives for s in plan.stages):
        issued = Table(title="tensor-axis collectives each stage's program issues per microbatch (from its placements)")
        for col in ("#", "forward", "backward"):
            issued.add_column(col, justify="right" if col == "#" else "left")
        for i, s in enumerate(plan.stages):
            issued.add_row(str(i), *(_collective_counts([c for c in s.collectives or () if c["phase"] == phase])
                                     for phase in ("forward", "backward")))
        out.print(issued)
    first = plan.stages[0]
    weights = Table(title="stage 0 parameter placements [data axis, tensor axis] (biases and norms omitted)")
    weights.add_column("layers")
    weights.add_column("placements")
    for names, text in _placement_runs(first.params):
        weights.add_row(names, text)
    out.print(weights)
    if plan.search.get("tuned"):
        tuned = Table(title="tuned: the best predicted layouts, measured on this machine's ranks")
        for col in ("plan", "microbatches", "predicted", "measured"):
            tuned.add_column(col, justify="left" if col == "plan" else "right")
        for t in sorted(plan.search["tuned"], key=lambda t: t["measured_step_time_s"] or float("inf")):
            tuned.add_row(t["name"], str(t["num_microbatches"]), human_time(t["predicted_step_time_s"]),
                          human_time(t["measured_step_time_s"]) if t["measured_step_time_s"] else "did not run")
        out.print(tuned)


def _collective_counts(collectives: list[dict]) -> str:
    """"12 all_reduce (384.0 KiB) · 2 all_gather (64.0 KiB)": each kind's count and bytes handed in."""
    kinds: dict[str, list[float]] = {}
    for c in collectives:
        kinds.setdefault(c["kind"], []).append(c["bytes"])
    return " · ".join(f"{len(b)} {k} ({human_bytes(sum(b))})" for k, b in sorted(kinds.items())) or "none"


def _placement_runs(params: dict[str, list[Placement]]) -> list[tuple[str, str]]:
    """Weights grouped by layer; consecutive layers with the same placements share one row."""
    by_layer: dict[str, list[str]] = {}
    for fqn, placement in params.items():
        parts = fqn.split(".")
        if parts[-1] == "bias" or any("ln" in p or "norm" in p for p in parts):
            continue
        cut = next((i + 1 for i, p in enumerate(parts) if p.isdigit()), 1)
        by_layer.setdefault(".".join(parts[:cut]), []).append(f"{'.'.join(parts[cut:])} {'/'.join(map(str, placement))}")
    runs: list[tuple[list[str], str]] = []
    for layer, items in sorted(by_layer.items(), key=lambda kv: _natural(kv[0])):
        text = " · ".join(items)
        if runs and runs[-1][1] == text:
            runs[-1][0].append(layer)
        else:
            runs.append(([layer], text))
    return [(names[0] if len(names) == 1 else f"{names[0]} … {names[-1]} ({len(names)})", text) for names, text in runs]


def _natural(name: str) -> list:
    return [int(p) if p.isdigit() else p for p in name.split(".")]


def _precision_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mixed-precision", choices=["bf16", "fp16", "fp32"],
                   help="train in mixed precision (autocast; fp32 master weights and optimizer state; fp16 scales "
                        "the loss); default: the plan's, fp32 when searching")


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
    def planning(p: argparse.ArgumentParser) -> None:
        p.add_argument("model", help="zoo name, FILE.py:FUNCTION or package.module:FUNCTION")
        p.add_argument("--cluster", default="cpu-local", help="preset name or cluster JSON file (default cpu-local)")
        p.add_argument("--mesh", required=True, help="HOSTSxDEVICES, e.g. 8x8")
        p.add_argument("--batch", type=int, help="global batch (default: the model's suite default)")
        p.add_argument("--schedule", choices=["auto", *schedules.SCHEDULES], default="auto",
                       help="pipeline schedule (default auto: the search weighs 1f1b, interleaved-zb, interleaved-1f1b "
                            "and zbv; a --manual layout runs 1f1b unless told)")
        p.add_argument("--recompute", action="store_true",
                       help="hand-written layouts recompute activations (compare: only those that do)")
        p.add_argument("--memory-limit", type=float, help="GiB per device a plan may use (default: 90%% of memory)")
        p.add_argument("--time-limit", type=float, default=30.0, help="seconds per ILP solve (default 30)")
        _precision_flag(p)

    p = command("plan", cmd_plan, "search the parallel layout of a model on a cluster (or price a hand-written one)")
    planning(p)
    p.add_argument("--stages", type=int, help="exactly this many pipeline stages (default: searched)")
    p.add_argument("--manual", metavar="DP,TP,PP[,MB]", help="evaluate a hand-written Megatron-style layout")
    p.add_argument("--virtual", type=int, metavar="V", help="with --manual: V stages per device group (pp·V stages; "
                   "interleaved-1f1b, interleaved-zb or zbv, which needs 2)")
    p.add_argument("--sequence-parallel", action="store_true", help="with --manual: Megatron-LM's sequence "
                   "parallelism (norms and residual adds split along the sequence on the tensor axis; also DP,TP,PP+sp)")
    p.add_argument("--zero", type=int, choices=(1, 2), help="with --manual: ZeRO-1 (optimizer states sharded over the "
                   "data axis, as Megatron-LM's --use-distributed-optimizer) or ZeRO-2 (gradients too; one stage); "
                   "also DP,TP,PP+z1")
    p.add_argument("--offload", action="store_true", help="with --manual and --zero: the shards in host memory "
                   "(FSDP2's CPUOffloadPolicy; Adam steps on the host); also DP,TP,PP+z1+offload")
    p.add_argument("--compression", metavar="SPEC|auto",
                   help="price the data axis's gradient averaging through a compressor (e.g. dgc:0.999, "
                        "powersgd:2), or 'auto': weigh none and the methods the convergence sweep found within "
                        "their accuracy target, and keep the fastest")
    p.add_argument("--tune", type=int, metavar="K", help="run the K best predicted plans (distinct layouts) for a "
                   "few steps on this machine's ranks and keep the measured fastest (plan.search.tuned: both times)")
    p.add_argument("--out", help="write the plan JSON here")
    p = command("show", cmd_show, "show a plan file: stages, meshes, shardings, prediction")
    p.add_argument("plan", help="plan JSON written by `autopar plan --out`")
    p.add_argument("--png", metavar="FILE", help="draw the pipeline schedule (Gantt), stage-to-device map and "
                   "per-stage memory against the device limit")
    p = command("compare", cmd_compare, "the searched plan against every valid hand-written 3D layout")
    planning(p)
    p = command("bench", cmd_bench, "run the searched plan and hand-written layouts for real; predicted vs measured")
    p.add_argument("model", help="zoo name, or FILE.py:FUNCTION returning (model, inputs, loss_fn, make_batch)")
    p.add_argument("--nproc", type=int, required=True, help="processes (ranks) on this machine")
    p.add_argument("--cluster", default="cpu-local", help="cluster the predictions are for (default cpu-local)")
    p.add_argument("--batch", type=int, help="global batch (default: the model's suite default)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per layout (default 2)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per layout, median taken (default 5)")
    p.add_argument("--launches", type=int, default=3, help="starts of the ranks, each timing every layout; a "
                   "layout's time is the median, its spread (max - min) / median (default 3)")
    p.add_argument("--breakdown", metavar="DIR", help="time one more step per layout op by op and phase by phase "
                   "and write DIR/LAYOUT.json: measured per rank beside the prediction per stage")
    _precision_flag(p)
    p.add_argument("--compile", action="store_true", help="inductor compiles each stage's lowered graphs (paid "
                   "once per shape, at the first step)")
    p = command("calibrate", cmd_calibrate, "measure this machine's ranks: matmul, memory, collectives (α, β)")
    p.add_argument("--nproc", type=int, default=2, help="local ranks to measure (default 2; 1 on a GPU measures the device alone)")
    p.add_argument("--out", help="cluster JSON to write (default: the file cpu-local reads)")
    p.add_argument("--repeats", type=int, default=3, help="starts of the ranks, each measuring everything; each "
                   "number the median, each term's spread reported (default 3)")
    p.add_argument("--from", dest="from_bench", metavar="BENCH.json", help="instead of measuring, fit the cluster "
                   "file's parameters to the step times of `autopar bench ... --json` (half the layouts; the "
                   "error on the other half is reported)")
    p.add_argument("--cluster", help="with --from: the cluster file to start from (default: the one cpu-local reads)")
    p = command("train", cmd_train, "train for real on synthetic data, launched through torchrun's launcher")
    p.add_argument("model", help="zoo name, or FILE.py:FUNCTION returning (model, inputs, loss_fn, make_batch)")
    p.add_argument("--nproc", type=int, required=True, help="processes (ranks) on this machine")
    p.add_argument("--plan", help="plan JSON, or a layout DP,TP,PP[,MB] (default: searched)")
    p.add_argument("--compression", metavar="SPEC|auto", help="compress the data axis's gradients (e.g. dgc:0.999, "
                   "powersgd:2, topk:0.01; 'auto': the planner weighs a few)")
    p.add_argument("--delay", type=int, default=0, help="delayed gradient averaging: apply averages D steps late")
    p.add_argument("--steps", type=int, default=5, help="training steps (default 5)")
    p.add_argument("--batch", type=int, help="global batch (default: the model's suite default)")
    p.add_argument("--cluster", help="cluster the search plans for (default cpu-local)")
    p.add_argument("--checkpoint-dir", metavar="DIR", help="write checkpoints here (step-N directories, "
                   "torch.distributed.checkpoint; any plan can load them)")
    p.add_argument("--checkpoint-every", type=int, default=0, metavar="N",
                   help="checkpoint every N steps (default 0: after the last step only)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in --checkpoint-dir whose files match its manifest "
                        "(under this run's plan) to --steps")
    p.add_argument("--resume-from", metavar="step-N", help="continue from this checkpoint (a folder in "
                   "--checkpoint-dir, or a path) instead of the latest")
    p.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS",
                   help="a collective waiting longer fails the job: a rank died or hangs (default 300)")
    _precision_flag(p)
    p.add_argument("--memory-limit", type=float, metavar="GIB",
                   help="GiB of tensors per rank: the search plans within it and the run is held to it (the first "
                        "step is measured; on CUDA the allocator is capped too)")
    p.add_argument("--compile", action="store_true", help="inductor compiles each stage's lowered graphs (paid "
                   "once per shape, at the first step)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # markup off: model, layer and cluster names from files are shown as written (`printable` escapes
    # the control characters among them)
    out = Console(highlight=False, markup=False, width=None if sys.stdout.isatty() else 160)
    try:
        with _stdout_to_stderr(getattr(args, "json", False)):
            result = args.func(args, out)
    except AutoparError as exc:
        if args.debug:
            traceback.print_exc()
        Console(stderr=True, highlight=False, soft_wrap=True).print(Text.assemble(("error:", "bold red"),
                                                                                  f" {printable(str(exc))}"))
        return 2
    if result is not None:
        sys.stdout.write(json.dumps(result, indent=2) + "\n")
    return 0


@contextlib.contextmanager
def _stdout_to_stderr(active: bool):
    """Keep stdout for the JSON alone: native code (HiGHS) sometimes prints to file descriptor 1."""
    if not active:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def run() -> None:
    """Console entry point: exits without interpreter teardown once the output is flushed.

    Tearing down torch._dynamo (imported by torch.export) takes about 1 s after every command
    that captured a model; nothing autopar holds needs finalizing (files are written atomically
    and closed before this point).
    """
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
