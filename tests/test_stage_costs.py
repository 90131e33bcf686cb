"""The stage cost is one formula (`StageCosts.variant_table`): the table the stage DP ranks every
layer range by, and the price of the plan it chooses (`option_for`), agree for any range and
variant — a range whose table entry and price disagreed would be chosen at one cost and planned
at another. The DP's layers (modules) are finer than what a recomputing stage checkpoints (the
balanced groups, `layer_starts`): a range that begins or ends inside a group is priced as
`option_for` prices it over its own parts of the groups."""

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
    # the units a recomputing stage checkpoints begin inside the range at these bounds
    inside = [k for k in range(i + 1, j) if bounds[k] in costs.layer_starts]
    if "ends" in table:  # where a partial recomputation may end
        assert [k for k in range(i + 1, j) if table["ends"][k]] == inside
    if variant[2] is True and inside:  # recomputing a range's first d units, as `search._recompute_fewer` prices it
        d = data.draw(st.integers(1, len(inside)), "depth")
        end = inside[d - 1]
        fewer = costs.option_for(atoms, shape, *variant[:3], m, depth=d, zero=variant[3])
        again, depth = table["again"], table["depth"]
        key = table["key_at"]((np.array([i]), np.array([j])), np.array([again[i, j] - again[i, end]]))[0]
        assert _close(key, fewer.time + (fewer.grad_sync_s + fewer.optimizer_s) / m)
        assert _close(table["plain_acts"][i, j] + depth[end] - depth[i], fewer.activation_bytes)
        # the DP holds the whole recomputation's transient (its largest unit), an upper bound
        assert fewer.transient_bytes <= ranked["transient"][0, i, j] * (1 + 1e-9)


def test_the_dp_cuts_at_every_module_while_recomputation_checkpoints_the_groups(search):
    """Up to `EVERY_MODULE_UP_TO` modules the DP may cut between any two (grouped, an embedding could
    be no stage of its own: the optimality gap's widest misses), and a recomputing stage keeps the
    inputs of the balanced groups (`cluster_layers`), not of every module."""
    from autopar.planner.layering import cluster_layers

    assert [layer.atoms for layer in search.layers] == [(k, k + 1) for k in range(len(search.costs.atoms))]
    assert search.costs.layer_starts == [u.atoms[0] for u in cluster_layers(search.graph)]
    assert len(search.costs.layer_starts) < len(search.layers)



def test_ranks_wait_for_the_slowest_where_they_meet():
    """`DeviceSpec.jitter`: a rank's progress drifts as a random walk, so a group meeting at a
    collective waits for its slowest, e_n·jitter·√L after L seconds of computation. A tensor axis
    meets K times a microbatch (its collectives): √(K·c) more per microbatch of computation c,
    forward and backward alike; a data axis meets once a step, at its gradients: √ of the step's
    computation more in the exposed synchronisation; one device never waits."""
    import dataclasses

    from autopar.cost_models.comm import largest_of_normals
    from autopar.planner.manual import Layout, manual_plan, manual_search

    w = autopar.load_workload("gpt-tiny", batch=8)
    base = get_cluster("cpu-local").with_ranks(2)

    def priced(jitter: float, layout: str):
        cluster = dataclasses.replace(base, device=dataclasses.replace(base.device, jitter=jitter))
        return manual_plan(manual_search(Search.start(w, cluster, (1, 2))), Layout.parse(layout))

    for layout in ("1,2,1", "1,2,1,2", "2,1,1", "2,1,1,4"):
        plans = [priced(j, layout) for j in (0.0, 0.01, 0.02)]
        costs = [p.stages[0].cost for p in plans]
        m = plans[0].num_microbatches
        for k in ("forward_s", "backward_s", "grad_sync_s"):
            more = [c[k] - costs[0][k] for c in costs]
            waits = k != "grad_sync_s" if layout.startswith("1,2") else k == "grad_sync_s"
            if waits:  # proportional to the jitter
                assert more[1] > 0 and more[2] == pytest.approx(2 * more[1], rel=1e-6), (layout, k)
            else:
                assert more[1:] == pytest.approx([0.0, 0.0], abs=1e-12), (layout, k)
        if layout.startswith("2"):  # once a step, after all of its computation
            step = m * (costs[0]["forward_s"] + costs[0]["backward_s"])
            assert costs[1]["grad_sync_s"] - costs[0]["grad_sync_s"] == pytest.approx(
                largest_of_normals(2) * 0.01 * step ** 0.5, rel=1e-6)
    one = dataclasses.replace(base.with_mesh(1, 1), device=dataclasses.replace(base.device, jitter=0.01))
    alone = manual_plan(manual_search(Search.start(w, one, (1, 1))), Layout.parse("1,1,1"))
    plain = manual_plan(manual_search(Search.start(w, base.with_mesh(1, 1), (1, 1))), Layout.parse("1,1,1"))
    assert alone.estimate.step_time_s == plain.estimate.step_time_s
