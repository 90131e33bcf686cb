"""The catalogue sweep: every family of `tests/families.py` trained under each layout against one
process, on 2 gloo ranks (DP, TP, PP, the searched plan) and on 4 (DP, TP, PP, DP×TP, DP×PP,
TP×PP, the searched plan).

A cell is `equal` (losses and final parameters within rel 1e-5, absolute 1e-6 where the reference
is smaller), `refused` (`parallelize` raised `AutoparError` on every rank: its message), or a
failure: `differs`, `crashed` (a rank raised later: the first rank's last line), `hung`. Families
whose forward couples samples are compared against one process run on the same slices the job's
losses saw (`tests.families.single`). Each cell's result is appended to
`benchmarks/results/families.jsonl` as it finishes, and cells already there are skipped, so a
sweep stops and resumes (`--redo failed` runs the failures again). `--table` writes
`docs/families.md` from that file. `--cuda`: each family on one CUDA device through `parallelize`
against the same model trained eagerly there (fp32, TF32 off). `--floor`: how far float32
rounding alone takes each family from its float64 run, in units of the tolerance (the families
past half of it run in float64).

    python benchmarks/families.py                   # the whole sweep (hours on 2 cores), then the table
    python benchmarks/families.py --families llama,bert --world 2
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from autopar.runtime.lower import mismatch  # noqa: E402
from benchmarks._stamp import line, stamp  # noqa: E402
from tests.families import FAMILIES  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "families.jsonl"
TABLE = ROOT / "docs" / "families.md"
LAYOUTS = {2: {"dp": "2,1,1", "tp": "1,2,1", "pp": "1,1,2,2", "searched": None},
           4: {"dp": "4,1,1", "tp": "1,4,1", "pp": "1,1,4,4", "dp-tp": "2,2,1,2", "dp-pp": "2,1,2,2",
               "tp-pp": "1,2,2,2", "searched": None}}
TITLES = {"dp": "DP", "tp": "TP", "pp": "PP", "dp-tp": "DP×TP", "dp-pp": "DP×PP", "tp-pp": "TP×PP",
          "searched": "searched"}


def load() -> dict[tuple[str, int, str], dict]:
    """The latest result of every cell recorded."""
    cells = {}
    if RESULTS.exists():
        for text in RESULTS.read_text().splitlines():
            if text.strip():
                r = json.loads(text)
                cells[(r["family"], r["world"], r["layout"])] = r
    return cells


def record(result: dict) -> None:
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with RESULTS.open("a") as f:
        f.write(json.dumps(result) + "\n")


def _last_line(text: str) -> str:
    lines = [x for x in str(text).strip().splitlines() if x.strip()]
    return lines[-1].strip() if lines else str(text)


def _judge(name: str, value: dict, references: dict) -> tuple[str, str, float]:
    """(status, message, worst relative loss difference) of one rank's result against one process."""
    from tests.families import differences, single

    if "refused" in value:
        return "refused", value["refused"], 0.0
    slices = value["slices"] if FAMILIES[name].coupled else 1
    if slices is None:
        return "n/a", f"its stages cut the batch differently ({value['plan']}), and its forward couples samples " \
                      f"({FAMILIES[name].coupled}): no one process computes the same", None
    if slices not in references:
        references[slices] = single(name, slices=slices)
    losses, params = references[slices]
    worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(value["losses"], losses))
    diff = differences(value["losses"], value["params"], losses, params)
    return ("differs", "; ".join(diff[:3]), worst) if diff else ("equal", "", worst)


def _saved(path: Path) -> list:
    """What a rank saved of its cases (nothing where it was killed before, or while, saving)."""
    import torch

    try:
        return torch.load(path, weights_only=False)
    except (OSError, EOFError, RuntimeError):
        return []


def run_family(name: str, world: int, layouts: list[str], timeout: float) -> list[dict]:
    """Run the family's pending cells on `world` ranks in one start (a cell that fails ends the
    start; the next start runs the cells after it)."""

    pending, out, references = list(layouts), [], {}
    while pending:
        work = Path(tempfile.mkdtemp(prefix="autopar-families-"))
        start = time.perf_counter()
        cmd = [sys.executable, __file__, "--worker", name, "--world", str(world), "--layouts", ",".join(pending),
               "--dir", str(work)]
        with open(work / "log.txt", "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
            try:
                proc.wait(timeout=timeout * len(pending) + 60)
                hung = False
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                hung = True
        ranks = [_saved(work / "ranks" / f"{r}.pt") for r in range(world)]
        seconds = time.perf_counter() - start
        done = 0
        for j, layout in enumerate(pending):
            got = [ranks[r][j] if j < len(ranks[r]) else None for r in range(world)]
            if all(g is None for g in got) and j > 0:
                break  # not reached: the next start runs it
            failed = [(r, g[1]) for r, g in enumerate(got) if g is not None and not g[0]]
            if failed:
                r, text = failed[0]
                status, message, worst = "crashed", f"rank {r}: {_last_line(text)}", None
            elif any(g is None for g in got):
                status, message, worst = ("hung" if hung else "crashed"), (
                    f"ranks {[r for r, g in enumerate(got) if g is None]} gave no result"
                    + (f" within {timeout * len(pending) + 60:.0f} s" if hung else f": {_last_line((work / 'log.txt').read_text())}")), None
            else:
                values = [g[1] for g in got]
                refusals = {v.get("refused") for v in values}
                if len(refusals) > 1:
                    status, message, worst = "crashed", f"ranks disagree: {sorted(map(str, refusals))[:2]}", None
                else:
                    status, message, worst = _judge(name, values[0], references)
            ran = {p["stage"]: p for g in got if g and g[0] and isinstance(g[1], dict) for p in g[1].get("programs", [])}
            result = {"family": name, "world": world, "layout": layout, "status": status, "message": message[:700],
                      "max_rel_loss_diff": worst, "coupled": FAMILIES[name].coupled or None,
                      "plan": got[0][1].get("plan") if got[0] and got[0][0] else None,
                      # how each stage ran: lowered, or interpreted and why (the fallbacks, target: none)
                      "interpreted": {str(s): p["why"] for s, p in sorted(ran.items()) if p["runs"] == "interpreted"},
                      # a lowered stage's collectives the plan did not price, or priced and it does not issue
                      "unplanned": {str(s): {"unplanned": p["unplanned"], "missing": p["missing"]}
                                    for s, p in sorted(ran.items()) if p.get("unplanned") or p.get("missing")},
                      "seconds": round(seconds / len(pending), 1), **stamp()}
            record(result)
            out.append(result)
            print(f"{name:14s} {world} ranks {layout:9s} {status:8s} {message[:100]}", flush=True)
            done = j + 1
            if status not in ("equal", "refused", "n/a"):
                break  # the ranks stopped here
        shutil.rmtree(work, ignore_errors=True)
        pending = pending[max(done, 1):]
    return out


def worker(name: str, world: int, layouts: list[str], directory: Path) -> None:
    from tests.distributed import _spawn
    from tests.families import train_parallel

    jobs = [(train_parallel, (name, LAYOUTS[world][k])) for k in layouts]
    _spawn(jobs, world, directory)


def sweep(names: list[str], worlds: list[int], redo: str | None, timeout: float,
          layouts: list[str] | None = None) -> None:
    cells = load()
    for name in names:
        for world in worlds:
            todo = [k for k in LAYOUTS[world] if (layouts is None or k in layouts) and (
                (name, world, k) not in cells or redo == "all" or (
                redo == "failed" and cells[(name, world, k)]["status"] not in ("equal", "refused", "n/a")))]
            if todo:
                run_family(name, world, todo, timeout)


def _note(message: str) -> str:
    """A cell's message as one footnote line, the same for every layout it applies to."""
    return " ".join(re.sub(r"\blayout \S+", "the layout", message).split())


def write_table() -> str:
    """docs/families.md from the recorded results."""
    cells = load()
    names = [n for n in FAMILIES if any(k[0] == n for k in cells)]
    columns = [(w, k) for w in LAYOUTS for k in LAYOUTS[w]]
    notes: dict[str, int] = {}
    mark = {"equal": "=", "refused": "refused", "n/a": "n/a", "differs": "✗ differs", "crashed": "✗ crashed",
            "hung": "✗ hung"}
    rows = []
    for n in names:
        row = []
        for w, k in columns:
            r = cells.get((n, w, k))
            if r is None:
                row.append("·")
                continue
            text = mark[r["status"]] if r["status"] != "equal" or not r.get("coupled") else "≈"
            if r.get("interpreted"):  # stages the lowering left to the interpreter, with why
                note = _note("interpreted: " + "; ".join(sorted(set(r["interpreted"].values()))))
                notes.setdefault(note, len(notes) + 1)
                text += f" ◦[{notes[note]}]"
            if r.get("unplanned"):  # the program is not the plan: which collectives, where
                note = _note("not as priced: " + "; ".join(mismatch(m["unplanned"], m["missing"])
                                                        for m in r["unplanned"].values()))
                notes.setdefault(note, len(notes) + 1)
                text += f" ≠[{notes[note]}]"
            if r["message"]:
                note = _note(r["message"])
                notes.setdefault(note, len(notes) + 1)
                text += f" [{notes[note]}]"
            row.append(text)
        coupled = f" (coupled: {FAMILIES[n].coupled})" if FAMILIES[n].coupled else ""
        rows.append(f"| {n}{coupled} | {FAMILIES[n].model} | " + " | ".join(row) + " |")
    recorded = [r for r in cells.values() if r["family"] in names]
    counts = {s: sum(r["status"] == s for r in recorded) for s in mark}
    seconds = sum(r["seconds"] for r in recorded)
    latest = max(recorded, key=lambda r: r["date"]) if recorded else None
    text = [
        "# Model families",
        "",
        "Generated by `python benchmarks/families.py` (results in `benchmarks/results/families.jsonl`; "
        "`--table` rewrites this page). Every family is built from a small config of the class `transformers` "
        "ships (`tests/families.py`), trained 2 SGD steps under each layout on gloo ranks, and compared against "
        "one process from the same seed: losses and final parameters within rel 1e-5 (absolute 1e-6 where the "
        "reference is below it).",
        "",
        f"**{len(names)} families, {len(recorded)} cells: {counts['equal']} equal, {counts['refused']} refused, "
        f"{counts['n/a']} without a one-process reference, {counts['differs']} differ, {counts['crashed']} crashed, "
        f"{counts['hung']} hung.** "
        f"Run time of the recorded cells: {seconds / 60:.0f} min, at commits "
        f"{', '.join(sorted({r['commit'] for r in recorded}))}" + (f"; latest: {line(latest)}." if latest else "."),
        "",
        "`=` equal to one process; `≈` equal to one process run on the same slices of each batch the job's "
        "losses saw (the family's forward couples samples: BatchNorm, an in-batch loss, expert capacity); "
        "`refused`: `parallelize` refused the layout on every rank, with the message below; `n/a`: a coupled "
        "family under a plan whose stages cut the batch differently, which no one process computes; `·`: not run; "
        "`◦`: some stage ran interpreted (DTensor per op), not lowered, for the reason in the note (cells recorded "
        "before the lowering say nothing of it); `≠`: a lowered stage's collectives are not those its plan priced "
        "(the note names them; target: none).",
        "",
        "| family | model class | " + " | ".join(f"{TITLES[k]} ({w})" for w, k in columns) + " |",
        "|---|---|" + "---|" * len(columns),
        *rows,
        "",
        *[f"[{i}] {message}  " for message, i in notes.items()],
        "",
    ]
    TABLE.write_text("\n".join(text))
    return "\n".join(text)


def floor_rows(names: list[str]) -> list[dict]:
    """How far float32 rounding alone takes each family's one-process run from its float64 run, in
    units of the comparison's tolerance (rel 1e-5, abs 1e-6): the noise floor of its cells. Where
    it passes half (the parallel run's own rounding may double it), the catalogue runs the family
    in float64 (`Family.dtype`)."""
    import dataclasses

    import torch

    import tests.families as catalogue

    rows = []
    for name in names:
        family = catalogue.FAMILIES[name]
        runs = {}
        try:
            for dtype in (torch.float32, torch.float64):
                catalogue.FAMILIES[name] = dataclasses.replace(family, dtype=dtype)
                runs[dtype] = catalogue.single(name, slices=2 if family.coupled else 1)
        except RuntimeError as exc:  # a kernel without float64 (transformers' grouped matmul)
            rows.append({"family": name, "params": None, "losses": None, "why": str(exc).splitlines()[0][:80]})
            continue
        finally:
            catalogue.FAMILIES[name] = family
        (l32, p32), (l64, p64) = runs[torch.float32], runs[torch.float64]
        params = max(((p32[k].double() - p64[k]).abs() / (1e-6 + 1e-5 * p64[k].abs())).max().item() for k in p64)
        losses = max(abs(a - b) / abs(b) for a, b in zip(l32, l64)) / 1e-5
        rows.append({"family": name, "params": params, "losses": losses, "dtype": str(family.dtype)})
    return rows


def cuda_rows(steps: int) -> list[dict]:
    """Each family on one CUDA device (NCCL, a job of one) through `parallelize`, against the same
    model trained eagerly on that device."""
    import torch

    import autopar
    from tests.families import optimizer, setup, single

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    rows = []
    for name in FAMILIES:
        eager, _ = single(name, steps, "cuda")
        w, batches = setup(name, steps=steps, device="cuda")
        start = time.perf_counter()
        pm = autopar.parallelize(w.model, (1, 1), w.example_inputs, loss_fn=w.loss_fn, optimizer=optimizer,
                                 plan="1,1,1")
        got = [pm.step(inputs, target) for inputs, target in batches]
        torch.cuda.synchronize()
        rows.append({"family": name, "losses": got, "eager": eager,
                     "max_rel_diff": max(abs(a - b) / abs(b) for a, b in zip(got, eager)),
                     "seconds": round(time.perf_counter() - start, 2)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", help="comma-separated names (default: all of tests/families.py)")
    parser.add_argument("--world", type=int, choices=sorted(LAYOUTS), help="2 or 4 ranks only (default: both)")
    parser.add_argument("--redo", choices=["failed", "all"], help="run recorded cells again")
    parser.add_argument("--timeout", type=float, default=180, help="seconds per cell before it counts as hung")
    parser.add_argument("--table", action="store_true", help="only write docs/families.md from the results")
    parser.add_argument("--cuda", action="store_true", help="each family on one CUDA device against eager")
    parser.add_argument("--floor", action="store_true",
                        help="each family's float32 rounding, one process, in units of the comparison's tolerance")
    parser.add_argument("--steps", type=int, default=3, help="steps of --cuda")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--layouts", help="comma-separated layouts only (of dp, tp, pp, dp-tp, dp-pp, tp-pp, searched): "
                        "re-run the cells a change touches, e.g. --redo all --layouts dp,dp-pp,searched")
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.world, args.layouts.split(","), Path(args.dir))
        return
    if args.floor:
        rows = floor_rows(args.families.split(",") if args.families else list(FAMILIES))
        if args.json:
            print(json.dumps({**stamp(), "rows": rows}, indent=1))
        for r in rows:
            print(f"{r['family']:14s} " + (f"parameters {r['params']:.3g}  losses {r['losses']:.3g}  (runs in "
                                            f"{r['dtype'].removeprefix('torch.')})" if r["params"] is not None
                                            else f"no float64: {r['why']}"))
        return
    if args.cuda:
        import torch

        rows = cuda_rows(args.steps)
        if args.json:
            print(json.dumps({"device": torch.cuda.get_device_name(), **stamp(), "rows": rows}, indent=1))
        for r in rows:
            print(f"{r['family']:14s} max rel diff {r['max_rel_diff']:.1e}")
        return
    if not args.table:
        names = args.families.split(",") if args.families else list(FAMILIES)
        unknown = [n for n in names if n not in FAMILIES]
        if unknown:
            parser.error(f"unknown families {unknown}: the catalogue has {', '.join(FAMILIES)}")
        print(f"load average at the start: {os.getloadavg()[0]:.2f}", flush=True)
        layouts = args.layouts.split(",") if args.layouts else None
        known = {k for w in LAYOUTS.values() for k in w}
        if layouts and not set(layouts) <= known:
            parser.error(f"unknown layouts {sorted(set(layouts) - known)}: the sweep has {', '.join(sorted(known))}")
        sweep(names, [args.world] if args.world else sorted(LAYOUTS), args.redo, args.timeout, layouts)
    table = write_table()
    if args.json:
        print(json.dumps(sorted(load().values(), key=lambda r: (r["family"], r["world"], r["layout"])), indent=1))
    else:
        print(table)


if __name__ == "__main__":
    main()
