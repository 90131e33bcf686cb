"""The exact search of `benchmarks/optimality_gap.py` (every cut × submeshes × microbatch count):
on a tiny instance nothing the planner or a person writes beats its optimum."""

import importlib.util
import sys
from pathlib import Path

import numpy as np

from autopar.cost_models import get_cluster
from autopar.models import load_workload
from autopar.planner.manual import layout_grid, manual_plan, manual_search, module_layers
from autopar.planner.search import Search, plan_dp

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _benchmark():
    """benchmarks/optimality_gap.py as a module (benchmarks/ is no package; its `_page` and `_stamp`
    are found beside it while it loads)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location("optimality_gap", BENCHMARKS / "optimality_gap.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclasses look their module up while it loads
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCHMARKS))
    return module


def test_the_exact_optimum_is_never_slower_than_the_dp_or_a_hand_written_layout():
    gap = _benchmark()
    search = Search.start(load_workload("gpt-tiny", batch=16), get_cluster("v100-p3"), (1, 4), schedule="1f1b")
    dp = plan_dp(search)
    exact = gap.exact_search(search)  # unseeded: the space's own optimum
    assert exact.plan is not None and exact.plan.estimate.fits and exact.simulated > 0
    step = exact.plan.estimate.step_time_s
    assert step <= dp.estimate.step_time_s * (1 + 1e-9)
    # the search's own layers are back: the DP prices as before
    assert search.costs.layer_starts == search.unit_starts
    view = manual_search(search)
    for layout in layout_grid(view):
        plan = manual_plan(view, layout)
        if plan.estimate.fits:
            assert step <= plan.estimate.step_time_s * (1 + 1e-9), layout.name
    # the bound's table is the one `option_for` reads: its entries are each range's least work
    layers = Search(search.workload, search.cluster, search.mesh, search.graph, module_layers(search), search.costs,
                    search.memory_limit, "1f1b")
    try:
        for shape, m in (((1, 2), 4), ((1, 4), 2)):
            work = gap.least_work(layers, shape, m)
            for i, j in ((0, 1), (1, 4), (2, len(layers.layers))):
                options = [search.costs.option_for(layers.atoms(i, j), shape, lm, lean, False, m)
                           for lm, lean, _, _ in search.costs.variants(shape, m, recompute=(False,), zeros=(0,))]
                least = min(o.forward_s + o.backward_s for o in options if np.isfinite(o.time))
                assert np.isclose(work[i, j], least, rtol=1e-12), (shape, m, i, j)
    finally:
        search.costs.layer_starts = search.unit_starts
