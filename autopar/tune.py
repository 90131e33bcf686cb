"""`--tune K`: the K best predicted plans of distinct layouts run for a few steps on the job's own
ranks, and the measured fastest is kept. Planning alone stays deterministic; tuning replaces the
cost model's last word with a measurement where the two disagree, and records both
(`plan.search["tuned"]`) so a user sees how far the prediction was off.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from autopar.contract.errors import AutoparError
from autopar.contract.plan import Plan
from autopar.planner.search import Search, plan_auto

log = logging.getLogger(__name__)


def layout_key(plan: Plan) -> tuple:
    """What makes two plans different layouts: how many stages, and each one's (dp, tp) mesh,
    recomputation and ZeRO-3; not where the stages cut nor the microbatch count (the cost model's
    ranking among those is finer than what it gets wrong between layouts)."""
    return (plan.precision, tuple((tuple(s.logical_mesh), s.recompute, any(p[0] == "S(0)" for p in s.params.values()))
                                  for s in plan.stages))


def candidates(search: Search, k: int) -> list[Plan]:
    """The `k` fastest predicted plans of distinct layouts (fitting ones first): the search's, its
    best with each number of stages and each microbatch count, and every hand-written layout."""
    from autopar.planner.inter_op import microbatch_counts
    from autopar.planner.manual import layout_grid, manual_plan, manual_search

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


def tune_locally(search: Search, model: str, k: int, batch: int | None, steps: int = 3,
                 progress: Any = None) -> Plan:
    """`autopar plan --tune K`: the candidates run on this machine's ranks (one per device of the
    mesh), the zoo model's synthetic batches, one warm-up and `steps` timed steps each."""
    from autopar.bench import measure

    hosts, per_host = search.mesh
    if hosts != 1:
        raise AutoparError(f"--tune runs the candidates on this machine's ranks; the mesh {hosts}x{per_host} spans "
                           f"{hosts} hosts: tune inside the job with parallelize(..., tune={k})")
    plans = candidates(search, k)
    measured = []
    for i, plan in enumerate(plans):  # one start of the ranks each: a plan the runtime refuses costs only itself
        if progress:
            progress(f"measuring plan {i + 1} of {len(plans)} on {per_host} ranks")
        try:
            measured.append(measure(model, per_host, batch, [plan], warmup=1, steps=steps)[0][0])
        except Exception as exc:  # noqa: BLE001 - the ranks' error, reported with the plan
            log.warning("tune: %s (%d microbatches) did not run: %s", plan.name, plan.num_microbatches,
                        str(exc).strip().splitlines()[-1])
            measured.append(float("inf"))
    if all(t == float("inf") for t in measured):
        raise AutoparError(f"--tune {k}: none of the {len(plans)} best predicted plans ran on this machine's ranks")
    return choose(plans, measured)
