"""The planner's answer never loses to a hand-written layout (`autopar.planner.auto`)."""

import pytest

from autopar.contract.errors import AutoparError
from autopar.contract.plan import Plan
from autopar.cost_models import get_cluster
from autopar.models import load_workload
from autopar.planner.auto import _hand_written_floor, _step_bound, plan_auto
from autopar.planner.manual import Layout, layout_grid, manual_plan, manual_search
from autopar.planner.search import Search, plan_dp, runs


def _search(model: str = "gpt-tiny", mesh=(1, 4), batch: int = 16) -> Search:
    return Search.start(load_workload(model, batch=batch), get_cluster("v100-p3"), mesh)


def test_auto_is_never_slower_than_any_hand_written_layout():
    for model in ("gpt-tiny", "moe-tiny"):
        search = _search(model)
        auto = plan_auto(search)
        view = manual_search(search)
        for layout in layout_grid(view):
            plan = manual_plan(view, layout)
            if plan.estimate.fits:
                assert auto.estimate.step_time_s <= plan.estimate.step_time_s * (1 + 1e-9), (model, layout.name)


def test_the_floor_replaces_a_slower_plan_and_says_so():
    search = _search()
    slow = plan_dp(search, stages=1, num_microbatches=16)  # one sample a microbatch: far from the best
    best = _hand_written_floor(search, slow)
    assert best.estimate.step_time_s < slow.estimate.step_time_s and best.estimate.fits
    assert best.search["floor"] in {layout.name for layout in layout_grid(manual_search(search))}
    assert best.search["dp_step_time_s"] == slow.estimate.step_time_s and best.name == slow.name
    assert runs(best) and Plan.from_json(best.to_json()).estimate == best.estimate
    # the search's own layers are back: a plan the DP prices next is priced as before
    assert search.costs.layer_starts == search.unit_starts
    assert plan_dp(search, stages=1, num_microbatches=16).estimate == slow.estimate
    # where the DP's plan is the fastest, it stands untouched
    auto = plan_dp(search)
    assert _hand_written_floor(search, best) is best
    assert _hand_written_floor(search, auto).estimate.step_time_s <= auto.estimate.step_time_s


def test_the_floor_keeps_a_fixed_stage_count_and_microbatch_count():
    search = _search()
    plan = plan_auto(search, stages=2, num_microbatches=4)
    assert len(plan.stages) == 2 and plan.num_microbatches == 4
    manual = manual_plan(manual_search(search), Layout(2, 1, 2, 4))
    assert plan.estimate.step_time_s <= manual.estimate.step_time_s * (1 + 1e-9)


def test_step_bound_is_below_every_simulated_pipeline():
    search = _search(mesh=(1, 8), batch=32)
    for layout in layout_grid(manual_search(search)):
        plan = manual_plan(manual_search(search), layout)
        work = [s.cost["forward_s"] + s.cost["backward_s"] for s in plan.stages]
        assert _step_bound(work, plan.num_microbatches) <= plan.estimate.step_time_s * (1 + 1e-9), layout.name


def test_a_stage_count_that_rules_out_every_fitting_layout_is_named():
    """Where the leanest layout fits but the stage count asked for does not, the refusal says so
    (not "use more devices", which the same message's numbers contradict)."""
    w = load_workload("gpt-small", batch=32)
    search = Search.start(w, get_cluster("v100-p3"), (1, 2), memory_limit=70 * 2**20)
    with pytest.raises(AutoparError, match="with 2 stages under 70 MiB per device; the leanest layout .* needs "
                                           r"[\d.]+ MiB: leave the 2 stages to the planner"):
        plan_auto(search, stages=2)
    plan = plan_auto(search)
    assert plan.estimate.fits and plan.estimate.peak_memory_bytes <= 70 * 2**20


def test_a_rank_microbatch_holds_whole_expert_groups():
    """GShard's MoE routes groups of tokens (moe-tiny: 64, two samples of 32): a rank's microbatch of
    one sample runs one group of 32 with half the capacity, another program than the plan prices
    (the whole batch's scaled down). Such a layout is refused, saying why; the search's plans and
    the grid's layouts keep whole groups."""
    search = _search("moe-tiny")
    assert search.costs.needs.group == 2 and "groups 2 samples" in search.costs.needs.why
    view = manual_search(search)
    with pytest.raises(AutoparError, match=r"would hold 1 sample\(s\); the model needs a multiple of 2 .*fewer microbatches"):
        manual_plan(view, Layout(2, 2, 1, 8))  # 16 samples, 2 ranks, 8 microbatches
    assert manual_plan(view, Layout(2, 2, 1, 4)).num_microbatches == 4
    plans = [plan_auto(search)] + [manual_plan(view, layout) for layout in layout_grid(view)]
    for plan in plans:
        dp = max(stage.logical_mesh[0] for stage in plan.stages)
        assert (16 // plan.num_microbatches // dp) % 2 == 0, plan.name
