"""Property tests: for random MLP and transformer shapes and mesh sizes the planner never crashes —
it emits a valid plan or one clear error — and every plan round-trips through JSON exactly."""

import itertools

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autopar.contract.errors import AutoparError
from autopar.contract.plan import Plan
from autopar.contract.workload import Workload
from autopar.cost_models import get_cluster
from autopar.planner.auto import plan_auto
from autopar.planner.search import Search
from autopar.zoo import gpt, mlp

MESHES = st.sampled_from([(1, 1), (1, 2), (1, 4), (2, 2), (2, 4), (4, 8)])


def _check(workload: Workload, mesh: tuple[int, int]) -> None:
    try:
        plan = plan_auto(Search.start(workload, get_cluster("a100-dgx"), mesh, time_limit_s=5))
    except AutoparError as exc:  # a clear error: one line that says what to change
        assert str(exc) and "\n" not in str(exc) and "Traceback" not in str(exc)
        return
    assert plan.num_devices == mesh[0] * mesh[1]
    assert plan.stages[0].layers[0] == 0 and plan.stages[-1].layers[1] == len(plan.layers)
    assert all(a.layers[1] == b.layers[0] for a, b in itertools.pairwise(plan.stages))
    assert all(s.logical_mesh[0] * s.logical_mesh[1] == s.devices for s in plan.stages)
    assert workload.batch % plan.num_microbatches == 0 and plan.estimate.step_time_s > 0
    text = plan.to_json()
    assert Plan.from_json(text).to_json() == text  # byte for byte


@given(dims=st.lists(st.sampled_from([4, 8, 12, 16, 32, 64]), min_size=3, max_size=6),
       batch=st.sampled_from([1, 2, 3, 4, 8, 16]), mesh=MESHES)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_random_mlps_plan_or_fail_clearly(dims, batch, mesh):
    model = mlp.build(mlp.MLPConfig(dims=tuple(dims))).to("meta")
    _check(Workload("mlp", model, (torch.empty(batch, dims[0], device="meta"),), batch), mesh)


@given(layers=st.integers(1, 3), heads=st.sampled_from([1, 2, 4]), head_dim=st.sampled_from([4, 8, 16]),
       seq=st.sampled_from([4, 8, 16]), vocab=st.sampled_from([32, 50, 64]), batch=st.sampled_from([1, 2, 4, 8]),
       mesh=MESHES)
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_random_transformers_plan_or_fail_clearly(layers, heads, head_dim, seq, vocab, batch, mesh):
    cfg = gpt.GPTConfig(vocab=vocab, seq=seq, hidden=heads * head_dim, layers=layers, heads=heads)
    model = gpt.build(cfg).to("meta")
    _check(Workload("gpt", model, gpt.example_inputs(cfg, batch, "meta"), batch), mesh)
