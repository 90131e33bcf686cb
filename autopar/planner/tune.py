"""`--tune K`: the K best predicted plans of distinct layouts, to run for a few steps on the job's
own ranks (`autopar.bench.tune_locally`, `parallelize(tune=K)`), and the measured fastest kept. Planning alone stays deterministic; tuning replaces the
cost model's last word with a measurement where the two disagree, and records both
(`plan.search["tuned"]`) so a user sees how far the prediction was off.
"""

from __future__ import annotations

import dataclasses

from autopar.contract.errors import AutoparError
from autopar.contract.placements import Shard
from autopar.contract.plan import Plan
from autopar.planner.auto import plan_auto
from autopar.planner.inter_op import microbatch_counts
from autopar.planner.manual import layout_grid, manual_plan, manual_search
from autopar.planner.search import Search


def layout_key(plan: Plan) -> tuple:
    """What makes two plans different layouts: how many stages, and each one's (dp, tp) mesh,
    recomputation, ZeRO level (1, 2, or 3: S(0) weights) and offloading; not where the stages cut nor the
    microbatch count (the cost model's ranking among those is finer than what it gets wrong
    between layouts)."""
    return (plan.precision, tuple((tuple(s.logical_mesh), s.recompute, s.recompute_granularity,
                                   s.zero or (3 if any(p[0] == Shard(0) for p in s.params.values()) else 0),
                                   bool(s.offload))
                                  for s in plan.stages))


def candidates(search: Search, k: int) -> list[Plan]:
    """The `k` fastest predicted plans of distinct layouts (fitting ones first): the search's, its
    best with each number of stages and each microbatch count, and every hand-written layout."""
    if k < 1:
        raise AutoparError(f"--tune {k}: give the number of plans to measure, at least 1")
    plans = [plan_auto(search)]
    depth = min(len(search.layers), search.cluster.num_devices)
    for stages in range(1, depth + 1):
        for m in microbatch_counts(search.workload.batch):
            try:
                plans.append(dataclasses.replace(plan_auto(search, stages=stages, num_microbatches=m),
                                                 name=f"auto-{stages}x{m}"))
            except AutoparError:
                continue  # no plan with that many stages or microbatches
    view = manual_search(search)
    for layout in layout_grid(view, recompute=(False,)):
        try:
            plans.append(manual_plan(view, layout))
        except AutoparError:
            continue
    plans = [p for p in plans if p.estimate is not None and p.stages]
    plans.sort(key=lambda p: (not p.estimate.fits, p.estimate.step_time_s))
    seen: set[tuple] = set()
    out = []
    for plan in plans:
        key = layout_key(plan)
        if key not in seen:
            seen.add(key)
            out.append(plan)
    return out[:k]


def choose(plans: list[Plan], measured: list[float]) -> Plan:
    """The measured fastest, recording every candidate's prediction and measurement."""
    tuned = [{"name": p.name, "num_microbatches": p.num_microbatches, "predicted_step_time_s": p.estimate.step_time_s,
              "measured_step_time_s": t if t != float("inf") else None} for p, t in zip(plans, measured)]
    best = min(range(len(plans)), key=lambda i: measured[i])
    return dataclasses.replace(plans[best], search={**plans[best].search, "tuned": tuned})
