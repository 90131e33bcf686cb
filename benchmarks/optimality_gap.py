"""How far the stage DP (`plan_dp`) is from the best plan of its own space, on small random instances.

Each instance is a small GPT of the zoo's form (`autopar.zoo.gpt`) at random shapes, few enough
blocks that the graph has at most 8 module layers, on a random preset cluster and mesh (at most 16
devices), a random global batch and a random memory limit (a fraction of what the whole model
needs on one device, so memory binds in about half the instances). On it:

- the DP: `plan_dp` with the 1F1B schedule (Alpa's eq. 2-5 over the clustered layers, each
  microbatch count, the simulator deciding between them);
- the floor: `plan_auto`, the DP's plan or a hand-written layout priced in the same space;
- the exact search (`exact_search`): every cut of the module layers into contiguous stages × every
  ordered assignment of submesh shapes using every device × every microbatch count, each stage at
  the fastest option (`Search.fastest`: any logical mesh, sharding, recomputation and ZeRO level)
  that fits the memory its place in that pipeline holds, recomputing as little as fits
  (`recompute_less`) and simulated (`assemble`): the fastest that fits. It prices with the DP's
  own `StageCosts`, so every ILP solve is shared. A candidate is simulated only where
  `autopar.planner.auto._step_bound` (each stage's least forward and backward over its logical
  meshes and shardings, nothing recomputed, no ZeRO: a bound below any option's) is below the best
  so far; candidates go in order of that bound, seeded with the DP's plan, so the search stops at
  the first bound that reaches the best. "Exact" means: the optimum over cuts, shapes and
  microbatch counts with each stage's option chosen as the DP chooses (fastest that fits), or the
  DP's plan where nothing in that space beats it.

Where the DP is slower, the cause named is the first that holds: "clustering" (the exact plan
cuts where the DP's clustered layers cannot), "DP memory guess" (the DP's table has no entry for a
stage of the exact plan: the DP does not know the pipeline's length when it checks memory, and
checkpoints its own layers when recomputing), "microbatch bound" (the exact plan's slowest stage
runs its microbatches for at least the best simulated step of a larger microbatch count, so the DP
did not search it: `stage_dp`'s bound, which should never cut a faster plan), "t_max grid"
(the DP's total at that count is worse, within its tolerance `DP_TOLERANCE`), "eq. 2 vs simulator"
(the DP's plan at that count is as good or better by eq. 2; the simulator disagrees), else
"unexplained". A clustering gap can hide another: there the exact search runs again cutting only
where the DP's layers begin, and what the DP loses within its own layers gets its cause too.

Prints a Markdown table (an instance a row, then a summary) and writes it to
docs/benchmarks/results/optimality_gap.md. Each finished instance is kept in a JSON record
(`--record`), so a rerun resumes where the last one stopped.

    python benchmarks/optimality_gap.py [--instances 50] [--seed 0] [--record /tmp/optimality_gap.json] [--no-page]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import random
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _page import table, write
from _stamp import stamp
from rich.console import Console
from rich.progress import Progress

from autopar.contract.errors import AutoparError
from autopar.contract.plan import Plan
from autopar.contract.workload import Workload
from autopar.cost_models import get_cluster
from autopar.planner.auto import _hand_written_floor, _step_bound, _work
from autopar.planner.graph import OpGraph
from autopar.planner.inter_op import INF, microbatch_counts, stage_dp, submesh_shapes
from autopar.planner.manual import module_layers
from autopar.planner.search import DP_TOLERANCE, Search, assemble, plan_dp, recompute_less
from autopar.zoo import gpt
from autopar.zoo.gpt import GPTConfig

CLUSTERS = ("v100-p3", "a100-dgx", "h100-dgx")  # not cpu-local: it depends on the machine
MESHES = ((1, 2), (1, 4), (2, 2), (2, 4), (1, 8), (2, 8))
BATCHES = (8, 16, 32, 64)
BLOCKS = (1, 2, 3, 4)  # a GPT has 4 module layers besides its blocks (wte, wpe, ln_f, lm_head): at most 8
HIDDEN = (64, 128, 256)
SEQ = (32, 64, 128)
VOCAB = (512, 2048, 8192)
MEMORY = (0.3, 1.5)  # the memory limit, as a fraction of the whole model's need on one device
SAME = 1e-9  # relative: a gap below this is rounding


@dataclass(frozen=True)
class Instance:
    """One random problem: a GPT's shape, where it runs, its batch and memory."""

    index: int
    blocks: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    cluster: str
    mesh: tuple[int, int]
    batch: int
    memory: float  # fraction of the single-device need

    @property
    def model(self) -> str:
        return f"gpt {self.blocks}×{self.hidden}/{self.heads}h s{self.seq} v{self.vocab}"


def draw(seed: int, index: int) -> Instance:
    """Instance `index` of the sequence `seed`: its own generator, so a rerun that skips some draws
    the others alike. On 16 devices at most 3 blocks and batch 32: the exact search may simulate
    every candidate where the bound is loose (an optimizer-bound tiny model), and 8 module layers ×
    7 microbatch counts there are 68,320 of them (~3 ms each), against 16,704 so."""
    rng = random.Random(f"optimality-gap/{seed}/{index}")
    hidden = rng.choice(HIDDEN)
    cluster = rng.choice(CLUSTERS)
    per_host = get_cluster(cluster).devices_per_host
    mesh = rng.choice([m for m in MESHES if m[1] <= per_host])
    large = mesh[0] * mesh[1] > 8
    return Instance(index=index, blocks=rng.choice(BLOCKS[:3] if large else BLOCKS), hidden=hidden,
                    heads=rng.choice([h for h in (2, 4, 8) if hidden // h >= 16]), seq=rng.choice(SEQ),
                    vocab=rng.choice(VOCAB), cluster=cluster, mesh=mesh,
                    batch=rng.choice(BATCHES[:3] if large else BATCHES), memory=round(rng.uniform(*MEMORY), 3))


def workload(inst: Instance) -> Workload:
    """The zoo's GPT at the instance's shape, on the meta device (as `load_workload` builds it)."""
    cfg = GPTConfig(vocab=inst.vocab, seq=inst.seq, hidden=inst.hidden, layers=inst.blocks, heads=inst.heads)
    with torch.device("meta"):
        model = gpt.build(cfg)
    return Workload(name=inst.model, model=model, example_inputs=gpt.example_inputs(cfg, inst.batch, "meta"),
                    batch=inst.batch, loss_fn=gpt.loss_fn, make_batch=lambda b, g: gpt.make_batch(cfg, b, g))


def single_device_need(search: Search) -> float:
    """Bytes the whole model needs on one device, one microbatch, nothing recomputed, its fastest
    sharding: what the instance's memory limit is a fraction of."""
    n = len(search.graph.layer_list)
    return search.costs.option_for((0, n), (1, 1), (1, 1), 0, False, 1).memory(1)


@dataclass
class Exact:
    """The exact search's answer and how much of the space it had to price."""

    plan: Plan | None  # the fastest that fits (the seed where nothing beat it; None: nothing fits)
    cuts: list[int]  # its stage boundaries in module layers (atoms), [0, …, n]
    from_seed: bool  # nothing in the space beat the seed
    candidates: int  # (cuts, submeshes, microbatches) with a finite bound
    priced: int  # of those, stages priced (the rest stopped by the bound)
    simulated: int  # of those, assembled and simulated


def exact_search(search: Search, seed: Plan | None = None, counts: list[int] | None = None,
                 boundaries: list[int] | None = None) -> Exact:
    """The fastest plan over every cut of the graph's module layers × every ordered assignment of
    submesh shapes that uses every device × every microbatch count (`counts`: only those), each
    stage at `Search.fastest` within its budget in that pipeline. `seed` (the DP's plan) starts the
    bound; `boundaries` (atoms): cut only there (the DP's clustered layers', to tell what clustering
    costs from what the DP misses in its own layers). Priced on `search.costs` with the module layers
    as the layers and the DP's own units (what a recomputing stage checkpoints): the DP's space."""
    view = Search(search.workload, search.cluster, search.mesh, search.graph, module_layers(search), search.costs,
                  search.memory_limit, "1f1b", units=search.unit_starts)
    return _exact(view, seed, counts or microbatch_counts(search.workload.batch), boundaries)


def _exact(view: Search, seed: Plan | None, counts: list[int], boundaries: list[int] | None) -> Exact:
    hosts, per_host = view.mesh
    shapes = submesh_shapes(hosts, per_host)
    sizes = [h * d for h, d in shapes]
    devices = hosts * per_host
    n = len(view.layers)
    inside = sorted(set(boundaries or range(n)) - {0, n})  # where a stage may begin
    work = {m: [least_work(view, shape, m) for shape in shapes] for m in counts}
    candidates = []  # (bound, cuts, shapes, m), searched in order of the bound
    for stages in range(1, min(n, devices) + 1):
        assignments = _assignments(sizes, devices, stages)
        for inner in itertools.combinations(inside, stages - 1):
            cuts = (0, *inner, n)
            for m in counts:
                w = work[m]
                for ks in assignments:
                    bound = _step_bound([float(w[k][i, j]) for k, i, j in zip(ks, cuts, cuts[1:])], m)
                    if math.isfinite(bound):
                        candidates.append((bound, cuts, ks, m))
    candidates.sort(key=lambda c: c[0])
    fits = seed is not None and seed.estimate.fits
    best, best_cuts = (seed, atom_cuts(seed, view.graph)) if fits else (None, [])
    best_step = seed.estimate.step_time_s if fits else INF
    fastest: dict[tuple, Any] = {}
    priced = simulated = 0
    for bound, cuts, ks, m in candidates:
        if bound >= best_step:
            break  # sorted: every later bound is as large
        priced += 1
        chosen = []
        for s, (i, j, k) in enumerate(zip(cuts, cuts[1:], ks)):
            in_flight, limit = view.budget(s, len(ks), m)
            key = (i, j, k, m, in_flight)
            if key not in fastest:
                fastest[key] = view.fastest(i, j, shapes[k], m, in_flight, limit)
            if fastest[key] is None:
                break
            chosen.append(((i, j), shapes[k], fastest[key]))
        else:
            chosen = recompute_less(view, chosen, m)
            if _step_bound([_work(option) for _, _, option in chosen], m) >= best_step:
                continue
            simulated += 1
            plan = assemble(view, chosen, m, name="exact")
            if plan.estimate.fits and plan.estimate.step_time_s < best_step:
                best, best_cuts, best_step = plan, list(cuts), plan.estimate.step_time_s
    return Exact(best, best_cuts, best is seed, len(candidates), priced, simulated)


def least_work(view: Search, shape: tuple[int, int], m: int) -> np.ndarray:
    """[i, j]: the least forward + backward per microbatch of layers [i, j) on `shape` over every
    logical mesh and sharding, nothing recomputed and no ZeRO (inf: no option). Recomputation adds
    the forward again and ZeRO-2 its reduce-scatters, never less, so it is below every option
    `Search.fastest` can return; read from `variant_table`, the table `option_for` reads its entry
    from (`tests/test_exact.py` checks they agree)."""
    n = len(view.layers)
    bounds = np.array([layer.atoms[0] for layer in view.layers] + [view.layers[-1].atoms[1]])
    out = np.full((n + 1, n + 1), INF)
    for variant in view.costs.variants(shape, m, recompute=(False,), zeros=(0,)):
        t = view.costs.variant_table(bounds, shape, variant, m)
        work = np.broadcast_to(t["forward"] + t["backward"], t["time"].shape)
        out = np.minimum(out, np.where(np.isfinite(t["time"]) & np.isfinite(work), work, INF))
    return np.where(np.triu(np.ones((n + 1, n + 1), dtype=bool), k=1), out, INF)


def _assignments(sizes: list[int], devices: int, stages: int) -> list[tuple[int, ...]]:
    """Every ordered tuple of `stages` submesh indices whose sizes sum to `devices` (stage_dp's
    rule: the stages use every device)."""
    out: list[tuple[int, ...]] = []
    smallest = min(sizes)

    def extend(prefix: tuple[int, ...], left: int) -> None:
        if len(prefix) == stages:
            if left == 0:
                out.append(prefix)
            return
        for k, size in enumerate(sizes):
            if size + (stages - len(prefix) - 1) * smallest <= left:
                extend((*prefix, k), left - size)

    extend((), devices)
    return out


def atom_cuts(plan: Plan, graph: OpGraph) -> list[int]:
    """A plan's stage boundaries as atom (module layer) indices: the atom of each stage's first node."""
    where = {name: k for k, atom in enumerate(graph.layer_list) for name in atom.nodes}
    return [where[plan.layers[s.layers[0]]["nodes"][0]] for s in plan.stages] + [len(graph.layer_list)]


def cause(search: Search, exact: Plan, cuts: list[int]) -> str:
    """Why the DP missed the exact plan: the first reason in the module's docstring that holds."""
    starts = [layer.atoms[0] for layer in search.layers] + [search.layers[-1].atoms[1]]
    if not set(cuts) <= set(starts):
        return "clustering"
    index = {a: i for i, a in enumerate(starts)}
    hosts, per_host = search.mesh
    shapes = submesh_shapes(hosts, per_host)
    sizes = [h * d for h, d in shapes]
    devices, m, p = hosts * per_host, exact.num_microbatches, len(exact.stages)
    depth = min(len(search.layers), devices)

    def table(count: int) -> np.ndarray:  # the DP's on-device table (offloading aside)
        return search.times(shapes, count, depth)[0][0]

    t = table(m)
    own = [float(t[p - s, index[a], index[b], shapes.index(tuple(stage.submesh))])
           for s, (stage, a, b) in enumerate(zip(exact.stages, cuts, cuts[1:]))]
    if not all(math.isfinite(x) for x in own):
        return "DP memory guess"
    total = sum(own) + (m - 1) * max(own)
    bound = INF  # the DP searches counts from the most microbatches down, each bounded by the best simulated step so far
    for count in (c for c in microbatch_counts(search.workload.batch)[::-1] if c > m):
        try:
            plan = plan_dp(search, num_microbatches=count)
        except AutoparError:
            continue
        if plan.estimate.fits:
            bound = min(bound, plan.estimate.step_time_s)
    if m * max(own) >= bound:
        return "microbatch bound"
    found = stage_dp(t, sizes, devices, m, tolerance=DP_TOLERANCE, bound=bound)[0]
    if found <= total:
        return "eq. 2 vs simulator"
    return "t_max grid" if found <= total * (1 + DP_TOLERANCE) else "unexplained"


def describe(plan: Plan | None, cuts: list[int]) -> str:
    """'0-3 1x2 (2,1) · 3-6 1x2 (1,2) rc, 8 mb': each stage's module layers, submesh, logical mesh
    and memory choices, then the microbatches."""
    if plan is None:
        return "–"
    parts = []
    for stage, a, b in zip(plan.stages, cuts, cuts[1:]):
        extra = ((" sel" if stage.recompute_granularity else f" rc{stage.recompute_layers or ''}")
                 if stage.recompute else "") + (f" z{stage.zero}" if stage.zero else "") + (" off" if stage.offload else "")
        parts.append(f"{a}-{b} {stage.submesh[0]}x{stage.submesh[1]} ({stage.logical_mesh[0]},{stage.logical_mesh[1]})"
                     f"{extra}")
    return " · ".join(parts) + f", {plan.num_microbatches} mb"


def run_instance(inst: Instance, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Plan the instance three ways and say where and why the DP falls short."""
    say = log or (lambda text: None)
    out: dict[str, Any] = {"instance": dataclasses.asdict(inst), "seconds": {}}
    clock = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        out["seconds"][name] = round(now - clock, 2)
        clock = now

    say("capture")
    w = workload(inst)
    search = Search.start(w, get_cluster(inst.cluster), inst.mesh, schedule="1f1b")
    need = single_device_need(search)
    # the same search at the instance's memory limit (the cost model does not depend on it: its solves are kept)
    search = dataclasses.replace(search, memory_limit=inst.memory * need)
    n = len(search.graph.layer_list)
    out.update(need_bytes=need, memory_limit=search.memory_limit, module_layers=n,
               clustered=[layer.atoms[0] for layer in search.layers] + [n])
    lap("capture")
    try:
        say("stage DP")
        dp = plan_dp(search)
    except AutoparError as exc:
        out.update(status="nothing fits", why=str(exc).splitlines()[0])
        lap("dp")
        return out
    lap("dp")
    say("floor")
    auto = _hand_written_floor(search, dp)  # plan_auto(search) without running the DP again
    lap("floor")
    say("exact search")
    exact = exact_search(search, seed=dp)
    lap("exact")
    dp_cuts, auto_cuts = atom_cuts(dp, search.graph), atom_cuts(auto, search.graph)
    out.update(status="ok", dp_s=dp.estimate.step_time_s, dp_fits=dp.estimate.fits, auto_s=auto.estimate.step_time_s,
               auto_fits=auto.estimate.fits, auto_floor=auto.search.get("floor"), dp_eq2_s=dp.search.get("eq2_total_s"),
               dp_plan=describe(dp, dp_cuts), auto_plan=describe(auto, auto_cuts),
               candidates=exact.candidates, priced=exact.priced, simulated=exact.simulated)
    if exact.plan is None:
        out.update(status="nothing fits", why="neither the DP's plan nor any of the exact search's fits")
        return out
    step = exact.plan.estimate.step_time_s
    gap = dp.estimate.step_time_s / step - 1 if dp.estimate.fits else None
    out.update(exact_s=step, exact_from_dp=exact.from_seed, exact_plan=describe(exact.plan, exact.cuts),
               gap=gap, auto_gap=auto.estimate.step_time_s / step - 1 if auto.estimate.fits else None)
    if gap is None:  # no gap to measure: the DP's answer is no plan
        out.update(status="DP plan does not fit", why=f"the exact search's best: {_ms(step)} ms")
    elif gap > SAME:
        say("why")
        out["cause"] = cause(search, exact.plan, exact.cuts)
        if out["cause"] == "clustering":  # and within the DP's own layers: the same search, cut where they begin
            say("exact search in the DP's layers")
            within = exact_search(search, seed=dp, boundaries=out["clustered"])
            inner = dp.estimate.step_time_s / within.plan.estimate.step_time_s - 1
            out.update(in_layers_s=within.plan.estimate.step_time_s, in_layers_gap=inner,
                       in_layers_plan=describe(within.plan, within.cuts))
            if inner > SAME:
                out["in_layers_cause"] = cause(search, within.plan, within.cuts)
        lap("why")
    return out


def _ms(x: float | None) -> str:
    return "–" if x is None else f"{x * 1e3:.3f}"


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{x:+.2%}"


HEADER = ["#", "model", "cluster", "mesh", "batch", "memory", "DP ms", "exact ms", "auto ms", "DP gap", "auto gap",
          "cause", "DP plan", "exact plan", "simulated", "s"]


def report(records: list[dict[str, Any]]) -> str:
    """The table, an instance a row, and the summary below it."""
    rows = []
    for r in records:
        inst = r["instance"]
        head = [inst["index"], Instance(**{**inst, "mesh": tuple(inst["mesh"])}).model, inst["cluster"],
                "x".join(map(str, inst["mesh"])), inst["batch"], f"{inst['memory']:.2f}×"]
        seconds = f"{r.get('seconds', {}).get('total', 0.0):.0f}"
        if r["status"] != "ok":
            rows.append(head + ["–"] * 5 + [r["status"], r.get("why", "").replace("|", "\\|"), "–", "–", seconds])
            continue
        rows.append(head + [_ms(r["dp_s"]), _ms(r["exact_s"]), _ms(r["auto_s"]), _pct(r["gap"]), _pct(r["auto_gap"]),
                            _cause(r), r["dp_plan"], "(the DP's)" if r["exact_from_dp"] else r["exact_plan"],
                            f"{r['simulated']}/{r['candidates']}", seconds])
    body = table(HEADER, rows, right=(0, 4, 6, 7, 8, 9, 10, 15))
    return body + "\n" + summary(records)


def summary(records: list[dict[str, Any]]) -> str:
    """Median and worst gap, how many instances have one and why, of the DP and of the floor."""
    ok = [r for r in records if r["status"] == "ok" and r.get("gap") is not None]
    lines = [f"{len(records)} instances: {len(ok)} planned, {len(records) - len(ok)} not "
             f"({', '.join(sorted({r['status'] for r in records if r not in ok})) or 'none'})."]
    for name, key in (("DP (`plan_dp`)", "gap"), ("floor (`plan_auto`)", "auto_gap")):
        gaps = [r[key] for r in ok if r.get(key) is not None]
        if gaps:
            lines.append(f"- {name} against the exact optimum: median gap {_pct(statistics.median(gaps))}, worst "
                         f"{_pct(max(gaps))}, slower on {sum(g > SAME for g in gaps)} of {len(gaps)}"
                         + (f", faster on {sum(g < -SAME for g in gaps)} (a plan outside the exact search's space)"
                            if any(g < -SAME for g in gaps) else "") + ".")
    slower = [r for r in ok if r["gap"] > SAME]
    if slower:
        lines.append(f"- the DP's gaps by cause: {_tally(r['cause'] for r in slower)}.")
    clustered = [r for r in slower if r["cause"] == "clustering"]
    inner = [r for r in clustered if r["in_layers_gap"] > SAME]
    if clustered:
        lines.append(f"- of the {len(clustered)} clustering gap(s), the DP also loses within its own layers (the exact "
                     f"search cutting only where they begin) in {len(inner)}" + (
                         f": median {_pct(statistics.median(r['in_layers_gap'] for r in inner))}, worst "
                         f"{_pct(max(r['in_layers_gap'] for r in inner))}; {_tally(r['in_layers_cause'] for r in inner)}"
                         if inner else "") + ".")
    walls = [r["seconds"]["total"] for r in records if "total" in r.get("seconds", {})]
    exact = [r["seconds"]["exact"] for r in records if "exact" in r.get("seconds", {})]
    if walls:
        lines.append(f"- time per instance: median {statistics.median(walls):.0f} s, longest {max(walls):.0f} s"
                     + (f"; of it the exact search: median {statistics.median(exact):.1f} s, longest {max(exact):.0f} s"
                        if exact else "") + ".")
    return "\n".join(lines) + "\n"


def _tally(causes: Iterable[str]) -> str:
    """'clustering 3, microbatch bound 1': how often each cause, the most frequent first."""
    counts: dict[str, int] = {}
    for c in causes:
        counts[c] = counts.get(c, 0) + 1
    return ", ".join(f"{c} {k}" for c, k in sorted(counts.items(), key=lambda x: (-x[1], x[0])))


def _cause(r: dict[str, Any]) -> str:
    """The table's cause cell: with clustering, what the DP loses within its own layers too."""
    why = r.get("cause", "")
    if why == "clustering" and r.get("in_layers_gap", 0.0) > SAME:
        why += f"; {_pct(r['in_layers_gap'])} within its layers: {r['in_layers_cause']}"
    return why


def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _save(path: Path, record: dict[str, Any]) -> None:
    """Written whole and renamed into place: an interrupted run leaves the last complete record."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(record, indent=1, sort_keys=True))
    tmp.replace(path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--instances", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--record", type=Path, default=Path("/tmp/optimality_gap.json"),
                        help="finished instances, read back to resume")
    parser.add_argument("--no-page", action="store_true", help="print the table, do not write the docs fragment")
    args = parser.parse_args(argv)
    started = stamp()
    record = _load(args.record)
    console = Console(stderr=True)
    keys = [f"{args.seed}:{i}" for i in range(args.instances)]
    todo = [k for k in keys if k not in record]
    if len(todo) < len(keys):
        console.log(f"{len(keys) - len(todo)} instance(s) already in {args.record}: skipped")
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("optimality gap", total=len(todo))
        for key in todo:
            inst = draw(args.seed, int(key.split(":")[1]))
            start = time.perf_counter()
            try:
                result = run_instance(inst, lambda text, i=inst: progress.update(
                    task, description=f"{i.index}: {i.model}, {i.cluster} {i.mesh[0]}x{i.mesh[1]}: {text}"))
            except Exception as exc:  # recorded and shown: one broken instance does not end the run
                result = {"instance": dataclasses.asdict(inst), "status": "error",
                          "why": f"{type(exc).__name__}: {exc}".splitlines()[0], "seconds": {},
                          "traceback": traceback.format_exc()}
            wall = time.perf_counter() - start
            result.setdefault("seconds", {})["total"] = round(wall, 2)
            result["seconds"] = {"total": result["seconds"].pop("total"), **result["seconds"]}
            record[key] = result
            _save(args.record, record)
            console.log(f"instance {inst.index} ({inst.model}, {inst.cluster} {inst.mesh[0]}x{inst.mesh[1]}, batch "
                        f"{inst.batch}, memory {inst.memory:.2f}×): {result['status']}"
                        + (f", gap {_pct(result.get('gap'))}" + (f" ({result['cause']})" if result.get("cause") else "")
                           if result["status"] == "ok" else f": {result.get('why', '')}")
                        + f", {wall:.1f} s ({', '.join(f'{k} {v}' for k, v in result['seconds'].items() if k != 'total')})")
            progress.advance(task)
    body = report([record[k] for k in keys])
    print(body)
    if not args.no_page:
        write("optimality_gap", started, body)


if __name__ == "__main__":
    main(sys.argv[1:])
