"""The stage cost is one formula (`StageCosts.variant_table`): the table the stage DP ranks every
layer range by, and the price of the plan it chooses (`option_for`), agree for any range and
variant — a range whose table entry and price disagreed would be chosen at one cost and planned
at another."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import autopar
from autopar.cost_models import get_cluster
from autopar.planner.inter_op import submesh_shapes
from autopar.planner.intra_op import logical_meshes
from autopar.planner.search import Search, _stacked

CASES = {  # a recomputing-selective model on the local machine, a bf16 GPT on a GPU cluster with ZeRO and offload
    "gpt-small-eager": ("cpu-local", (1, 2), 8, None),
    "gpt-tiny": ("a100-dgx", (2, 4), 16, "bf16"),
}


@pytest.fixture(scope="module", params=list(CASES))
def search(request):
    cluster, mesh, batch, precision = CASES[request.param]
    w = autopar.load_workload(request.param, batch=batch, device="cpu")
    return Search.start(w, get_cluster(cluster), mesh, precision=precision)


def _close(a: float, b: float) -> bool:
    return a == b or (math.isinf(a) and math.isinf(b)) or abs(a - b) <= 1e-9 * max(abs(a), abs(b))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_the_cost_that_ranks_is_the_cost_that_prices(search, data):
    costs, n = search.costs, len(search.layers)
    shape = data.draw(st.sampled_from(submesh_shapes(*search.mesh)), "submesh")
    m = data.draw(st.sampled_from([1, 2, 4]), "microbatches")
    meshes = [lm for lm in logical_meshes(shape) if costs.splits_batch(m, lm[0])]
    if not meshes:
        return
    lm = data.draw(st.sampled_from(meshes), "logical mesh")
    variant = (lm, data.draw(st.sampled_from(costs.shardings(shape, lm)), "sharding"),
               data.draw(st.sampled_from(costs.recomputes), "recompute"),
               data.draw(st.sampled_from(costs.zero_levels(lm)), "zero"))
    i = data.draw(st.integers(0, n - 1), "first layer")
    j = data.draw(st.integers(i + 1, n), "end")
    bounds = np.array([layer.atoms[0] for layer in search.layers] + [search.layers[-1].atoms[1]])
    table = costs.variant_table(bounds, shape, variant, m)  # every range, as the DP ranks them
    ranked = _stacked([table], m)
    atoms = search.atoms(i, j)
    if costs.range_sums(atoms, shape, lm, variant[1]) is None:  # no sharding of an atom on this mesh
        assert math.isinf(table["time"][i, j])
        return
    priced = costs.option_for(atoms, shape, *variant[:3], m, zero=variant[3])
    assert _close(ranked["key"][0, i, j], priced.time + (priced.grad_sync_s + priced.optimizer_s) / m)
    for name, field in {"states": "state_bytes", "acts": "activation_bytes", "transient": "transient_bytes",
                        "averaged": "sync_bytes"}.items():
        assert _close(ranked[name][0, i, j], getattr(priced, field)), name
    if variant[2] is True and j - i > 1:  # recomputing a range's first d layers, as `search._recompute_fewer` prices it
        d = data.draw(st.integers(1, j - i - 1), "depth")
        fewer = costs.option_for(atoms, shape, *variant[:3], m, depth=d, zero=variant[3])
        again, depth = table["again"], table["depth"]
        key = table["key_at"]((np.array([i]), np.array([j])), np.array([again[i, j] - again[i, i + d]]))[0]
        assert _close(key, fewer.time + (fewer.grad_sync_s + fewer.optimizer_s) / m)
        assert _close(table["plain_acts"][i, j] + depth[i + d] - depth[i], fewer.activation_bytes)
        # the DP holds the whole recomputation's transient (its largest layer), an upper bound
        assert fewer.transient_bytes <= ranked["transient"][0, i, j] * (1 + 1e-9)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_table_cut_finer_than_the_layers_prices_each_range_over_its_layers(search, data):
    """The DP may cut between any two atoms while a recomputing stage checkpoints at the planner's
    layers (`layer_starts`): a range that begins or ends inside a layer is priced as `option_for`
    prices it, its parts of those layers layers of their own; a partial recomputation ends at a layer start."""
    costs = search.costs
    n = len(costs.atoms)
    starts = sorted(costs.layer_starts)
    shape = data.draw(st.sampled_from(submesh_shapes(*search.mesh)), "submesh")
    m = data.draw(st.sampled_from([1, 2, 4]), "microbatches")
    meshes = [lm for lm in logical_meshes(shape) if costs.splits_batch(m, lm[0])]
    if not meshes:
        return
    lm = data.draw(st.sampled_from(meshes), "logical mesh")
    variant = (lm, data.draw(st.sampled_from(costs.shardings(shape, lm)), "sharding"),
               data.draw(st.sampled_from(costs.recomputes), "recompute"),
               data.draw(st.sampled_from(costs.zero_levels(lm)), "zero"))
    i = data.draw(st.integers(0, n - 1), "first atom")
    j = data.draw(st.integers(i + 1, n), "end")
    if costs.range_sums((i, j), shape, lm, variant[1]) is None:
        return
    table = costs.variant_table(np.arange(n + 1), shape, variant, m)  # a bound at every atom
    ranked = _stacked([table], m)
    priced = costs.option_for((i, j), shape, *variant[:3], m, zero=variant[3])
    assert _close(ranked["key"][0, i, j], priced.time + (priced.grad_sync_s + priced.optimizer_s) / m)
    for name, field in {"states": "state_bytes", "acts": "activation_bytes", "transient": "transient_bytes",
                        "averaged": "sync_bytes"}.items():
        assert _close(ranked[name][0, i, j], getattr(priced, field)), name
    inside = [a for a in starts if i < a < j]  # the layer starts a partial recomputation may end at
    if variant[2] is True and inside:
        d = data.draw(st.integers(1, len(inside)), "depth")
        end = inside[d - 1]
        fewer = costs.option_for((i, j), shape, *variant[:3], m, depth=d, zero=variant[3])
        again, depth = table["again"], table["depth"]
        key = table["key_at"]((np.array([i]), np.array([j])), np.array([again[i, j] - again[i, end]]))[0]
        assert _close(key, fewer.time + (fewer.grad_sync_s + fewer.optimizer_s) / m)
        assert _close(table["plain_acts"][i, j] + depth[end] - depth[i], fewer.activation_bytes)
        assert fewer.transient_bytes <= ranked["transient"][0, i, j] * (1 + 1e-9)
        assert table["ends"][end] and not any(table["ends"][k] for k in range(i + 1, j) if k not in starts)
