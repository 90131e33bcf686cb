"""`autopar bench`: run the searched plan and hand-written 3D layouts for real, next to what the
cost model predicted for them, and say how well the prediction ranks them (Spearman).

All layouts run in one start of the ranks (each gets a fresh model with the same weights), a few
warm-up steps then timed ones; a step's time is the slowest rank's, and a launch's time for a
layout the median over its timed steps, then one more step counts its tensors (`runtime.memory`):
the peak of the rank that holds most, beside the plan's predicted peak. Each rank runs on a core
of its own where the machine has enough (`runtime.backend.rank_cores`: a GPU never shares its
device with a second rank), and the ranks are started `launches` times (3 by default, the layouts
in a rotated order each time): a layout's time is the median of its launches, its spread
(max - min) / median the noise its ranking is judged against. Layouts differ in (dp, tp, pp) and
microbatches; each (dp, tp, pp) runs once more recomputing its activations, once more in bf16
mixed precision (planned for it), and with a data axis once more with ZeRO-3, at its most
microbatches (`runtime.recompute`, `runtime.precision`, `runtime.parallel.shard_data_axis`), with a
tensor axis once more with sequence parallelism (`planner.manual.MEGATRON_SP`); with
a pipeline, once more under each other schedule that fits its blocks (ZB-H1, interleaved 1F1B and
zero-bubble with 2 stages per rank, ZB-V).
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autopar.api import parallelize
from autopar.contract.errors import AutoparError
from autopar.contract.plan import SELECTIVE, Plan
from autopar.contract.precision import parse_precision
from autopar.models import load_workload
from autopar.planner.auto import plan_auto
from autopar.planner.manual import Layout, check, manual_plan, manual_search
from autopar.planner.search import Search, replay
from autopar.planner.tune import candidates, choose
from autopar.runtime.backend import join_local, local_store, pin, rank_cores, same_hash_order
from autopar.runtime.breakdown import measuring, summarise
from autopar.runtime.loop import time_steps
from autopar.runtime.memory import measured_step

log = logging.getLogger(__name__)


def candidate_plans(model: str, nproc: int, cluster: Any, batch: int | None, precision: str | None = None,
                    choices: dict | None = None, pin: bool = False) -> list[Any]:
    """The searched plan first, then every valid hand-written layout × microbatch count (in
    `precision`), and per (dp, tp, pp) its most microbatches recomputing (whole layers, and attention
    only where the model has attention), in bf16, with ZeRO-1/2/3
    and with sequence parallelism.
    `choices` / `pin` (`StageCosts`): record the shardings chosen, or price them again on this
    cluster (the hand-written layouts only: the search would choose again)."""
    import dataclasses


    w = load_workload(model, batch=batch, device="cpu", dtype=torch.float32)
    search = Search.start(w, cluster, (1, nproc), precision=precision, choices=choices, pin=pin)
    plans = [] if pin else [dataclasses.replace(plan_auto(search), name="auto")]
    view = manual_search(search)
    half = manual_search(Search.start(w, cluster, (1, nproc), graph=search.graph, precision="bf16",
                                      choices=choices, pin=pin)) if precision is None else None
    sharded = manual_search(search, zero3=True)
    for tp in (t for t in range(1, nproc + 1) if nproc % t == 0):
        for pp in (p for p in range(1, nproc // tp + 1) if (nproc // tp) % p == 0):
            valid = [Layout(nproc // (tp * pp), tp, pp, m, False) for m in (1, 2, 4, 8)]
            valid = [layout for layout in valid if check(view, layout) is None]
            plans += [manual_plan(view, layout) for layout in valid]
            if valid:  # recomputing, where it saves most: the most microbatches in flight; attention only too
                for recompute in (True, SELECTIVE):
                    layout = dataclasses.replace(valid[-1], recompute=recompute)
                    if check(view, layout) is None:
                        plans.append(manual_plan(view, layout))
            if valid and half is not None:
                plan = manual_plan(half, valid[-1])
                plans.append(dataclasses.replace(plan, name=f"{plan.name} bf16"))
            if valid and pp > 1:  # the other schedules (and 2 stages per rank where the blocks split so)
                for name, virtual in (("interleaved-zb", 1), ("interleaved-1f1b", 2), ("interleaved-zb", 2), ("zbv", 2)):
                    layout, other = dataclasses.replace(valid[-1], virtual=virtual), dataclasses.replace(view, schedule=name)
                    if check(other, layout) is None:
                        plan = manual_plan(other, layout)
                        plans.append(dataclasses.replace(plan, name=f"{plan.name} {name}"))
            if valid and tp > 1:  # Megatron's sequence parallelism
                plans.append(manual_plan(view, dataclasses.replace(valid[-1], sequence_parallel=True)))
            if valid and valid[-1].dp > 1:  # ZeRO-3 (FSDP2, a unit per layer), ZeRO-1, ZeRO-2 in one stage
                plan = manual_plan(sharded, valid[-1])
                plans.append(dataclasses.replace(plan, name=f"{plan.name} zero3"))
                plans += [manual_plan(view, dataclasses.replace(valid[-1], zero=z)) for z in ((1, 2) if pp == 1 else (1,))]
                # ZeRO-1 with its shards in host memory (on a CPU host: FSDP2's offload path, nothing moves)
                plans.append(manual_plan(view, dataclasses.replace(valid[-1], zero=1, offload=True)))
    return plans


def _rank(rank: int, world: int, port: int, model: str, batch: int | None, plans: list[str], warmup: int,
          steps: int, out: str, breakdown: bool, compile: bool = False, cores: list[int] | None = None) -> None:
    pin(cores, rank)
    torch.set_num_threads(1)
    join_local("gloo", port, rank, world)
    times: list[tuple] = []
    for text in plans:
        torch.manual_seed(0)
        w = load_workload(model, batch=batch, device="cpu", dtype=torch.float32)
        plan = Plan.from_json(text)
        try:
            pm, why = parallelize(w.model, (1, world), w.example_inputs, loss_fn=w.loss_fn, plan=plan,
                                  optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                                  mixed_precision=plan.precision or "fp32", compile=compile), None
        except AutoparError as exc:  # refused when built (its program is not the one priced, ...)
            pm, why = None, str(exc)
        refused = [None] * world
        dist.all_gather_object(refused, why)  # every rank skips it where one refused it
        if any(refused):
            times.append(next(r for r in refused if r))
            continue
        gen = torch.Generator().manual_seed(1)
        median = time_steps(pm, lambda: w.make_batch(w.batch, gen), warmup, steps)
        parts = None
        if breakdown:  # one more step, its ops and phases timed (apart: the timing costs time)
            inputs, target = w.make_batch(w.batch, gen)
            dist.barrier()
            with measuring() as mode:
                start = time.perf_counter()
                pm.step(inputs, target)
                wall = time.perf_counter() - start
            parts = [None] * world
            dist.all_gather_object(parts, summarise(mode, wall))
        _, tensors = measured_step(pm, *w.make_batch(w.batch, gen))
        peak = torch.tensor([tensors["total"]], dtype=torch.float64)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        ran: list = [None] * world  # how each stage ran: lowered (its collectives) or interpreted (why)
        dist.all_gather_object(ran, pm.programs())
        times.append((median, float(peak), parts,
                      sorted({p["stage"]: p for r in ran for p in r}.values(), key=lambda p: p["stage"])))
    if rank == 0:
        torch.save(times, out)
    dist.barrier()
    dist.destroy_process_group()


def measure(model: str, nproc: int, batch: int | None, plans: list[Any], warmup: int = 2, steps: int = 5,
            breakdown: bool = False, compile: bool = False) -> list[tuple[float, float, list | None, list]]:
    """Each plan run on `nproc` local ranks started once, each on a core of its own where there are
    enough (`rank_cores`): (median step time, the largest rank's peak tensor bytes, the per-rank
    breakdown or None, how each stage ran: `runtime.lower.programs`)."""
    same_hash_order()
    cores = rank_cores(nproc)
    if cores is None:
        log.warning("%d ranks on %d cores: they share cores, so their times rank the layouts but measure the "
                    "scheduler too; use at most %d ranks to give each a core", nproc, len(os.sched_getaffinity(0)),
                    len(os.sched_getaffinity(0)))
    with tempfile.TemporaryDirectory() as tmp, local_store() as port:
        out = os.path.join(tmp, "times.pt")
        mp.spawn(_rank, args=(nproc, port, model, batch, [p.to_json() for p in plans], warmup, steps, out, breakdown,
                              compile, cores), nprocs=nproc, join=True)
        return torch.load(out, weights_only=False)


def spearman(a: list[float], b: list[float]) -> float:
    """Rank correlation (average ranks for ties)."""
    def ranks(x: list[float]) -> np.ndarray:
        x = np.asarray(x)
        order = x.argsort()
        r = np.empty(len(x))
        r[order] = np.arange(len(x))
        for v in np.unique(x):
            r[x == v] = r[x == v].mean()
        return r

    ra, rb = ranks(a), ranks(b)
    return float(np.corrcoef(ra, rb)[0, 1]) if len(a) > 1 else 1.0


def predicted_breakdown(plan: Plan) -> list[dict[str, float]]:
    """Per device group (a stage, or a rank's v stages), the plan's prediction in the terms
    `runtime.breakdown` measures, from the simulator's replay (durations as replayed: ranks sharing
    cores run slower): forward and backward of all microbatches (a split backward's two parts
    together), the exposed data-axis synchronisation, the optimizer, and the time the pipeline
    leaves the group idle or sending."""
    sim = replay(plan)
    out = []
    for group in range(plan.groups):
        mine = [e for e in sim.events if e.rank == group]
        costs = [s.cost for s, r in zip(plan.stages, plan.stage_ranks) if r == group]

        def spent(*kinds: str) -> float:
            return sum(e.end - e.start for e in mine if e.kind in kinds)

        sync = sum(c.get("grad_sync_s", 0.0) for c in costs)
        optimizer = sum(c.get("optimizer_s", 0.0) for c in costs)
        last = max(e.end for e in mine if e.kind in ("B", "I", "W"))
        end = max(e.end for e in mine if e.kind in ("B", "I", "W", "sync"))
        tail, backward = spent("sync"), spent("B", "I", "W")
        out.append({"step_s": sim.step_time_s, "forward_s": spent("F"), "backward_s": backward,
                    "dp_sync_s": tail * sync / (sync + optimizer) if sync + optimizer else 0.0,
                    "optimizer_s": tail * optimizer / (sync + optimizer) if sync + optimizer else 0.0,
                    "pipeline_s": max(0.0, last - spent("F") - backward), "other_s": sim.step_time_s - end})
    return out


def bench(model: str, nproc: int, cluster: Any, batch: int | None = None, warmup: int = 2, steps: int = 5,
          progress: Callable[[str], None] | None = None, precision: str | None = None,
          breakdown: bool = False, compile: bool = False, launches: int = 3) -> dict[str, Any]:

    precision = parse_precision(precision)
    if progress:
        progress("planning the searched and hand-written layouts")
    plans = candidate_plans(model, nproc, cluster, batch, precision)
    runs = []  # per launch, per plan (in the plans' order)
    for k in range(launches):
        if progress:
            progress(f"running {len(plans)} layouts on {nproc} ranks (launch {k + 1} of {launches})")
        shift = k * len(plans) // launches  # each launch starts elsewhere: drift and order spread, not bias
        order = [*range(shift, len(plans)), *range(shift)]
        try:
            got = measure(model, nproc, batch, [plans[i] for i in order], warmup, steps, breakdown and k == 0, compile)
        except mp.ProcessExitedException as exc:  # a rank killed by a signal: the launch once more, said
            log.warning("launch %d of %d: %s; starting it again", k + 1, launches, exc)
            got = measure(model, nproc, batch, [plans[i] for i in order], warmup, steps, breakdown and k == 0, compile)
        runs.append([got[order.index(i)] for i in range(len(plans))])
    refused = {i: why for i, why in enumerate(runs[0]) if isinstance(why, str)}
    if 0 in refused:
        raise AutoparError(f"the searched plan was refused when built: {refused[0]}")
    for i, why in refused.items():
        log.warning("%s: refused when built, not measured: %s", plans[i].name, why)
    refused_names = [(plans[i].name, why) for i, why in refused.items()]
    measured = [i for i in range(len(plans)) if i not in refused]
    plans, runs = [plans[i] for i in measured], [[run[i] for i in measured] for run in runs]
    first = runs[0]
    rows = []
    for i, p in enumerate(plans):
        _, peak, _, ran = first[i]
        times = [run[i][0] for run in runs]
        t = float(np.median(times))
        rows.append({"name": p.name, "num_microbatches": p.num_microbatches, "precision": p.precision or "fp32",
                     "recompute": any(s.recompute for s in p.stages),
                     "recompute_layers": [s.recompute_layers for s in p.stages if s.recompute],  # null: all of a stage's
                     "recompute_granularity": next((s.recompute_granularity for s in p.stages if s.recompute), None),
                     "zero": p.dp_gradient.get("zero_stage", 0), "offload": any(s.offload for s in p.stages),
                     "predicted_step_time_s": p.estimate.step_time_s, "measured_step_time_s": t,
                     "launch_step_times_s": times, "spread": (max(times) - min(times)) / t,
                     "predicted_peak_bytes": p.estimate.peak_memory_bytes, "measured_peak_bytes": peak,
                     "programs": ran})
    if breakdown:  # per rank measured; per device group predicted (rank r is in group `stage_of[r]`)
        for row, p, (_, _, parts, _) in zip(rows, plans, first):
            row["breakdown"] = {"measured": parts, "predicted": predicted_breakdown(p),
                                "stage_of": [k for k, n in enumerate(p.group_devices) for _ in range(n)]}
    fastest = min(rows, key=lambda r: r["measured_step_time_s"])
    spreads = [r["spread"] for r in rows]
    return {"model": model, "nproc": nproc, "batch": batch, "precision": precision, "compile": compile,
            "cluster": cluster.name, "pinned": rank_cores(nproc), "launches": launches, "layouts": rows,
            "refused": [{"name": name, "why": why} for name, why in refused_names],
            "spearman": spearman([r["predicted_step_time_s"] for r in rows], [r["measured_step_time_s"] for r in rows]),
            "noise": {"median_spread": float(np.median(spreads)), "max_spread": max(spreads),
                      "ties": ties(rows), "pairs": len(rows) * (len(rows) - 1) // 2, "ordered": ordered(rows)},
            "auto_name": rows[0]["name"], "auto_vs_fastest": rows[0]["measured_step_time_s"] / fastest["measured_step_time_s"],
            "auto_tied_with_fastest": tied(rows[0], fastest)}


def tied(a: dict, b: dict) -> bool:
    """Whether two layouts' launches overlap (the range of one's launch times meets the other's): no
    launch count tells which is faster, a tie for ranking purposes."""
    ta, tb = a["launch_step_times_s"], b["launch_step_times_s"]
    return min(ta) <= max(tb) and min(tb) <= max(ta)


def ties(rows: list[dict]) -> int:
    """How many pairs of layouts are tied (`tied`)."""
    return sum(tied(a, b) for i, a in enumerate(rows) for b in rows[i + 1:])


def ordered(rows: list[dict]) -> float:
    """Of the layout pairs measured apart (not `tied`), the share the prediction orders as measured:
    the ranking judged above the noise floor (Spearman's counts every pair, ties reordered by noise
    included). 1.0 where every pair is tied."""
    apart = [(a, b) for i, a in enumerate(rows) for b in rows[i + 1:] if not tied(a, b)]
    right = sum((a["predicted_step_time_s"] - b["predicted_step_time_s"])
                * (a["measured_step_time_s"] - b["measured_step_time_s"]) > 0 for a, b in apart)
    return right / len(apart) if apart else 1.0


def tune_locally(search: Search, model: str, k: int, batch: int | None, steps: int = 3,
                 progress: Any = None) -> Plan:
    """`autopar plan --tune K`: the candidates run on this machine's ranks (one per device of the
    mesh), the zoo model's synthetic batches, one warm-up and `steps` timed steps each."""
    hosts, per_host = search.mesh
    if hosts != 1:
        raise AutoparError(f"--tune runs the candidates on this machine's ranks; the mesh {hosts}x{per_host} spans "
                           f"{hosts} hosts: tune inside the job with parallelize(..., tune={k})")
    plans = candidates(search, k)
    if progress:
        progress(f"measuring {len(plans)} plans on {per_host} ranks")
    try:  # one start of the ranks for all of them
        measured = [m[0] for m in measure(model, per_host, batch, plans, warmup=1, steps=steps)]
    except Exception:  # noqa: BLE001 - one failed: each again in a start of its own, so that it costs only itself
        measured = []
        for i, plan in enumerate(plans):
            if progress:
                progress(f"measuring plan {i + 1} of {len(plans)} alone on {per_host} ranks")
            try:
                measured.append(measure(model, per_host, batch, [plan], warmup=1, steps=steps)[0][0])
            except Exception as exc:  # noqa: BLE001 - the ranks' error, reported with the plan
                log.warning("tune: %s (%d microbatches) did not run: %s", plan.name, plan.num_microbatches,
                            str(exc).strip().splitlines()[-1])
                measured.append(float("inf"))
    if all(t == float("inf") for t in measured):
        raise AutoparError(f"--tune {k}: none of the {len(plans)} best predicted plans ran on this machine's ranks")
    return choose(plans, measured)
