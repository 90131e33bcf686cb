"""Is every program its plan, beyond the families sweep's layouts? Each family of `tests/families.py`
under the one-stage memory and sequence choices the sweep does not train (full and selective
recomputation, sequence parallelism, recomputation with a data axis), checked as the build checks
it, without training: rank 0 of the job on a fake process group (collectives return at once, with
rank 0's shapes) plans the layout (`manual_plan`), builds its stage and traces its lowered
program on the example microbatch (`lower_now`), and compares the program's tensor-axis
collectives with the plan's record (`Program.unplanned`).

A cell is `same` (no collective unplanned, none missing), `differs` (the collectives, named as the
build's refusal names them), `interpreted` (the stage did not lower: why), `refused` (the layout
does not apply: `AutoparError`) or `failed` (anything else: its last line). Cells are appended to
`benchmarks/results/program_check.jsonl` as they finish and skipped when there (`--redo` runs
them again); `--table` writes docs/benchmarks/results/program_check.md from that file.

    python benchmarks/program_check.py [--families llama,bert] [--layouts 1,2,1+recompute] [--redo]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _page import table, write  # noqa: E402
from _stamp import stamp  # noqa: E402

from autopar.runtime.lower import mismatch  # noqa: E402
from tests.families import FAMILIES  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "program_check.jsonl"
LAYOUTS = ["1,2,1+recompute", "1,2,1+selective", "1,2,1+sp", "2,2,1+recompute"]


def _cut(args: tuple, parts: int) -> tuple:
    """Rank 0's part of the batch (its first slice, as `parallelize` hands out samples)."""
    return tuple(x.tensor_split(parts)[0] if hasattr(x, "tensor_split") and x.dim() else x for x in args)


def check(name: str, layout: str) -> dict:
    """One cell: the family under `layout`, as rank 0 of its job on the fake group already set up."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.contract.errors import AutoparError
    from autopar.contract.inputs import as_args
    from autopar.cost_models import get_cluster
    from autopar.planner.manual import Layout, manual_plan, manual_search
    from autopar.planner.search import Search
    from autopar.runtime.export import export_as_planned
    from autopar.runtime.lower import NotAsPlanned, lower, lower_now
    from autopar.runtime.sharded_graph import ShardedGraph, defer_partial_grads
    from tests.families import setup

    parsed = Layout.parse(layout)
    world = parsed.dp * parsed.tp * parsed.pp
    w, _ = setup(name, steps=1)
    try:
        plan = manual_plan(manual_search(Search.start(w, get_cluster("cpu-local").with_ranks(world), (1, world))),
                           parsed)
    except AutoparError as exc:
        return {"result": "refused", "why": str(exc).splitlines()[0][:300]}
    stage = plan.stages[0]
    dp, tp = stage.logical_mesh
    args = as_args(w.model.forward, w.example_inputs)
    micro = _cut(_cut(args, dp), plan.num_microbatches)
    ep = export_as_planned(w.model, micro, args)
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))["tp"]
    graph = ShardedGraph(w.model, stage, mesh, ep, layers=[layer["nodes"] for layer in plan.layers])
    program = lower(graph, {"tp": mesh.get_group()}, planned=plan.priced_collectives(stage))
    defer_partial_grads(list(graph.parameters()))  # as `parallelize` runs it (no ZeRO, no compressor here)
    torch.manual_seed(0)
    try:
        lower_now(graph, micro)
    except NotAsPlanned:
        pass
    if program.fallback is not None:
        return {"result": "interpreted", "why": program.fallback[:300]}
    extra, missing = program.unplanned() or ([], [])
    issued = sum(1 for c in program.collectives() if c.axis == "tp")
    if extra or missing:
        return {"result": "differs", "why": mismatch(extra, missing)[:400], "issued": issued}
    return {"result": "same", "issued": issued}


def sweep(names: list[str], layouts: list[str], redo: bool) -> None:
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from autopar.planner.manual import Layout

    torch.set_num_threads(1)
    done = {(r["family"], r["layout"]) for r in _read()}
    for layout in layouts:
        parsed = Layout.parse(layout)
        dist.init_process_group("fake", rank=0, world_size=parsed.dp * parsed.tp * parsed.pp, store=FakeStore())
        try:
            for name in names:
                if (name, layout) in done and not redo:
                    continue
                began = time.perf_counter()
                try:
                    cell = check(name, layout)
                except Exception as exc:  # noqa: BLE001 — one cell's failure is a row, not the sweep's end
                    traceback.print_exc()
                    cell = {"result": "failed", "why": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
                cell = {"family": name, "layout": layout, **cell, "seconds": round(time.perf_counter() - began, 1)}
                print(f"{name:16s} {layout:18s} {cell['result']:12s} {cell.get('why', '')}", flush=True)
                with RESULTS.open("a") as f:
                    f.write(json.dumps(cell) + "\n")
        finally:
            dist.destroy_process_group()


def _read() -> list[dict]:
    if not RESULTS.exists():
        return []
    latest = {}
    for text in RESULTS.read_text().splitlines():
        row = json.loads(text)
        latest[row["family"], row["layout"]] = row
    return list(latest.values())


def write_table(started: dict) -> None:
    rows = sorted(_read(), key=lambda r: (list(FAMILIES).index(r["family"]) if r["family"] in FAMILIES else 999,
                                          LAYOUTS.index(r["layout"]) if r["layout"] in LAYOUTS else 99))
    layouts = [lay for lay in LAYOUTS if any(r["layout"] == lay for r in rows)]
    cells = {(r["family"], r["layout"]): r for r in rows}
    families = list(dict.fromkeys(r["family"] for r in rows))
    counts = {k: sum(1 for r in rows if r["result"] == k) for k in ("same", "differs", "interpreted", "refused", "failed")}
    body = (f"{len(rows)} cells: " + ", ".join(f"{v} {k}" for k, v in counts.items() if v) + ".\n\n"
            + table(["family", *layouts], [[f, *(cells[f, lay]["result"] if (f, lay) in cells else "" for lay in layouts)]
                                           for f in families]))
    notes = [r for r in rows if r["result"] != "same"]
    if notes:
        body += "\n" + table(["family", "layout", "result", "why"],
                             [[r["family"], r["layout"], r["result"], r.get("why", "").replace("|", "/")] for r in notes])
    write("program_check", started, body, "python benchmarks/program_check.py --table")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", help="comma-separated (default: every family)")
    ap.add_argument("--layouts", nargs="+", default=LAYOUTS)
    ap.add_argument("--redo", action="store_true", help="check cells already recorded again")
    ap.add_argument("--table", action="store_true", help="only write the page fragment from the results")
    args = ap.parse_args(argv)
    started = stamp()
    if not args.table:
        names = args.families.split(",") if args.families else list(FAMILIES)
        unknown = [n for n in names if n not in FAMILIES]
        if unknown:
            ap.error(f"unknown families {unknown}; known: {', '.join(FAMILIES)}")
        sweep(names, args.layouts, args.redo)
    write_table(started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
