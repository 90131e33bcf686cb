"""The planner's answer: the stage DP's plan, never slower than a layout a person would write.

`plan_auto` runs the DP (`search.plan_dp`, Alpa's inter-op pass with the schedules weighed around
it) and then prices the hand-written layouts `autopar compare` prices in the search's own space
(`_hand_written_floor`): where one is faster, it is the plan, and the plan says so. The DP stays
the search; the floor is the guarantee that `auto ≤ best hand-written` holds by construction (the
README's compare table says which rows the DP found and which the floor caught).
"""

from __future__ import annotations

from collections.abc import Callable

from autopar.contract.plan import Plan
from autopar.planner.inter_op import microbatch_counts
from autopar.planner.manual import (
    DEEPSPEED_MOE_NAME,
    has_experts,
    layout_counts,
    layout_grid,
    module_layers,
    stage_cuts,
)
from autopar.planner.search import Search, assemble, plan_dp, recompute_less
from autopar.planner.stage_costs import StageOption


def plan_auto(search: Search, *, stages: int | None = None, num_microbatches: int | None = None,
              progress: Callable[[str], None] | None = None) -> Plan:
    """The searched plan (`plan_dp`), or a hand-written layout priced in the same space where that
    is faster. `stages` / `num_microbatches` fix them for both."""
    plan = plan_dp(search, stages=stages, num_microbatches=num_microbatches, progress=progress)
    if progress:
        progress("the hand-written layouts")
    return _hand_written_floor(search, plan, stages, num_microbatches)


def _hand_written_floor(search: Search, auto: Plan, stages: int | None = None,
                       num_microbatches: int | None = None) -> Plan:
    """`auto` ≤ every hand-written layout `compare` prices, by construction: each layout of
    `layout_grid` (Megatron's stages cut between blocks, a (dp, tp) mesh, with and without
    recomputation, each microbatch count) and DeepSpeed-MoE's on an MoE model, priced in the
    search's own space — the graph's modules as layers (the DP's clustered layers may not cut where
    Megatron does), each stage's sharding the free ILP's (at least as fast as Megatron's rule; its
    atoms' solves are the DP's, cached), no ZeRO, as the grid has none (DeepSpeed's ZeRO-2: any) —
    and the fastest that fits replaces `auto` where it is faster (`plan.search["floor"]` names
    the layout it came from; the DP's plan stands on a tie). A candidate is simulated only where
    `_step_bound` beats the best so far, first with each stage at its fastest sharding and nothing
    recomputed (recomputation only adds work), then as chosen; so most cost one price per stage.
    `stages` / `num_microbatches`: only those."""
    schedule = "1f1b" if search.schedule == "auto" else search.schedule
    view = Search(search.workload, search.cluster, search.mesh, search.graph, module_layers(search), search.costs,
                  search.memory_limit, schedule)  # sets the costs' layer starts: put back below
    best, found = auto, None
    try:
        candidates = [(layout.name, stage_cuts(view, layout), layout.dp, layout.tp, layout.recompute, layout_counts(view, layout))
                      for layout in layout_grid(view) if stages in (None, layout.pp)]
        if has_experts(view) and stages in (None, 1):
            devices = search.mesh[0] * search.mesh[1]
            candidates.append((DEEPSPEED_MOE_NAME, [0, len(view.layers)], 1, devices, False,
                               [m for m in microbatch_counts(search.workload.batch)
                                if (search.workload.batch // m) % devices == 0]))
        hosts, per_host = search.mesh
        bounds: dict[tuple, float] = {}
        for name, cuts, dp, tp, rc, counts in candidates:
            size = dp * tp
            shape = (1, size) if size <= per_host else (size // per_host, per_host)
            for m in [num_microbatches] if num_microbatches else counts:
                key = (tuple(cuts), dp, tp, m)
                if key not in bounds:  # each stage at its fastest sharding, nothing recomputed, kept whole
                    bounds[key] = _step_bound([_work(view.costs.option_for(view.atoms(i, j), shape, (dp, tp), 0, False, m))
                                               for i, j in zip(cuts, cuts[1:])], m)
                if bounds[key] >= best.estimate.step_time_s:
                    continue
                chosen = [((i, j), shape, view.fastest(i, j, shape, m, *view.budget(s, len(cuts) - 1, m),
                                                       logical=[(dp, tp)], recompute=(rc,),
                                                       zeros=None if name == DEEPSPEED_MOE_NAME else (0,)))
                          for s, (i, j) in enumerate(zip(cuts, cuts[1:]))]
                if any(option is None for _, _, option in chosen):
                    continue
                chosen = recompute_less(view, chosen, m)
                if _step_bound([_work(option) for _, _, option in chosen], m) >= best.estimate.step_time_s:
                    continue
                plan = assemble(view, chosen, m, name=auto.name)
                # faster beyond rounding: a tie keeps the DP's plan (moe-380m's differed by 2e-13 s)
                if plan.estimate.fits and plan.estimate.step_time_s < best.estimate.step_time_s * (1 - 1e-9):
                    best, found = plan, name
    finally:
        search.costs.layer_starts = search.unit_starts
    if found is None:
        return auto
    best.search.update({k: v for k, v in auto.search.items() if k not in best.search}, floor=found,
                       dp_step_time_s=auto.estimate.step_time_s)
    return best


def _work(option: StageOption) -> float:
    """A stage's compute per microbatch, forward and backward (what a device group cannot overlap
    with its other microbatches')."""
    return option.forward_s + option.backward_s


def _step_bound(work: list[float], m: int) -> float:
    """A bound below the step of a pipeline whose stages take `work` per microbatch (1F1B or GPipe,
    one device group each): stage k runs its m microbatches one after another, after the first
    one's forward through the stages before it and before the last one's backward through them."""
    return max(sum(work[:k]) + m * t for k, t in enumerate(work))
