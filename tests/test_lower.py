"""The lowered runtime (`autopar/runtime/lower.py`): a step runs the traced graphs of local tensors,
with no DTensor dispatch between its first forward and its last backward (the gradients are
accumulated on local tensors, not by autograd through DTensor), and the collectives in those graphs are the ones the planner priced. (That lowered training equals one process is what
the rest of the suite checks: the lowered program is the default runtime.)"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

import autopar
from tests.distributed import shared_ranks
from tests.families import TEST_LAYERS, optimizer, setup

WORLD = 2


class _DTensorOps(TorchDispatchMode):
    """Every op dispatched with a DTensor among its arguments (DTensor then runs it as usual)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            self.ops.append(str(func))
            return NotImplemented
        return func(*args, **(kwargs or {}))


def _model(name: str):
    if name == "gpt2":
        return setup("gpt2", steps=2, layers=TEST_LAYERS)
    torch.manual_seed(0)
    w = autopar.load_workload(name, batch=8, device="cpu")
    g = torch.Generator().manual_seed(5)
    return w, [w.make_batch(8, g) for _ in range(2)]


def _dispatched(rank, world, name, layout, interpreted):
    """DTensor ops between the first forward and the last backward of the second step (the first
    lowers), on the lowered program or, with `interpreted`, on the interpreter."""
    w, batches = _model(name)
    pm = autopar.parallelize(w.model, (1, world), w.example_inputs, loss_fn=w.loss_fn, optimizer=optimizer,
                             plan=layout)
    graphs = [pm.graph] if hasattr(pm, "graph") else pm.modules
    if interpreted:
        for g in graphs:
            g.program = None
    pm.step(*batches[0])
    mode = _DTensorOps()
    window = "_microbatches" if hasattr(pm, "_microbatches") else None
    if window is not None:
        run = pm._microbatches

        def counted(*args):
            with mode:
                return run(*args)
        pm._microbatches = counted
    else:
        run = pm.schedule.step

        def counted(*args, **kwargs):
            with mode:
                return run(*args, **kwargs)
        pm.schedule.step = counted
    pm.step(*batches[1])
    lowered = [g.program is not None and g.program.lowered for g in graphs]
    return sorted(set(mode.ops)), len(mode.ops), lowered


CASES = [("gpt-tiny", "1,2,1", False), ("gpt-tiny", "1,2,1", True), ("gpt2", "1,2,1", False),
         ("gpt-tiny", "1,1,2,2", False)]


@pytest.mark.parametrize("name,layout", [("gpt-tiny", "1,2,1"), ("gpt2", "1,2,1"), ("gpt-tiny", "1,1,2,2")],
                         ids=["gpt-tiny-tp", "transformers-gpt2-tp", "gpt-tiny-pp"])
def test_no_dtensor_dispatch_runs_inside_a_lowered_step(tmp_path, name, layout):
    for ops, count, lowered in shared_ranks(_dispatched, WORLD, CASES, (name, layout, False), tmp_path):
        assert all(lowered)
        assert count == 0, f"DTensor ran {count} ops inside a lowered step: {ops}"


def test_the_dispatch_check_sees_the_interpreter(tmp_path):
    """The check above would notice DTensor: the same step interpreted dispatches ops through it."""
    for ops, count, _ in shared_ranks(_dispatched, WORLD, CASES, ("gpt-tiny", "1,2,1", True), tmp_path):
        assert count > 40 and any("mm" in op for op in ops)


def _stage(layout, recompute, granularity=None, layers=None):
    """Rank 0's lowered stage of gpt-tiny under `layout` on a fake process group, trained one step."""
    import dataclasses

    from torch.distributed.device_mesh import init_device_mesh

    from autopar.cost_models import get_cluster
    from autopar.planner.manual import Layout, manual_plan, manual_search
    from autopar.planner.search import Search
    from autopar.runtime.export import export_as_planned
    from autopar.runtime.lower import lower
    from autopar.runtime.sharded_graph import ShardedGraph

    torch.manual_seed(0)
    w = autopar.load_workload("gpt-tiny", batch=4, device="cpu")
    world = Layout.parse(layout).tp
    plan = manual_plan(manual_search(Search.start(w, get_cluster("cpu-local").with_ranks(world), (1, world))),
                       Layout.parse(layout))
    stage = dataclasses.replace(plan.stages[0], recompute=recompute, recompute_granularity=granularity,
                                recompute_layers=layers)
    ep = export_as_planned(w.model, w.example_inputs, tuple(w.example_inputs))
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    graph = ShardedGraph(w.model, stage, mesh, ep, layers=[layer["nodes"] for layer in plan.layers])
    program = lower(graph, {"tp": mesh.get_group()})
    out = graph(*w.example_inputs)
    out.float().pow(2).mean().backward()
    return program, out.detach(), {n: p.grad.to_local().clone() for n, p in graph.named_parameters()}


@pytest.fixture
def fake_group():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():  # a one-process job an earlier test left (`parallelize` makes one again)
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    yield
    dist.destroy_process_group()


def test_a_lowered_stage_recomputes_what_the_plan_says(fake_group):
    """Recomputation in a lowered program is the partitioner's: the regions the stage marks (every
    layer, its first layers, or each attention core) are run again in the backward graph from what
    they read, so the forward keeps less, and outputs and gradients are bit for bit those of keeping."""
    kept, out, grads = _stage("1,2,1", False)
    assert kept.lowered and kept.saved_bytes() > 0
    saved = {}
    for name, args in {"full": (True,), "first layer": (True, None, 1), "selective": (True, "selective")}.items():
        program, r_out, r_grads = _stage("1,2,1", *args)
        assert program.lowered, program.fallback
        assert torch.equal(r_out, out) and all(torch.equal(r_grads[k], g) for k, g in grads.items())
        saved[name] = program.saved_bytes()
    assert saved["full"] < saved["first layer"] < kept.saved_bytes()
    assert saved["selective"] < kept.saved_bytes()


def _planned_stage(name: str):
    """A `1,2,1` stage of the zoo model on the fake group, lowered (traced at its first call)."""
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.cost_models import get_cluster
    from autopar.planner.manual import Layout, manual_plan, manual_search
    from autopar.planner.search import Search
    from autopar.runtime.export import export_as_planned
    from autopar.runtime.lower import lower
    from autopar.runtime.sharded_graph import ShardedGraph

    torch.manual_seed(0)
    w = autopar.load_workload(name, batch=4, device="cpu")
    plan = manual_plan(manual_search(Search.start(w, get_cluster("cpu-local").with_ranks(2), (1, 2))),
                       Layout.parse("1,2,1"))
    ep = export_as_planned(w.model, w.example_inputs, tuple(w.example_inputs))
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    graph = ShardedGraph(w.model, plan.stages[0], mesh, ep, layers=[layer["nodes"] for layer in plan.layers])
    return w, plan, graph, lower(graph, {"tp": mesh.get_group()}, planned=plan.priced_collectives(plan.stages[0]))


@pytest.mark.parametrize("name", ["gpt-tiny", "mlp-tiny"])
def test_a_lowered_stage_issues_exactly_the_collectives_the_plan_priced(fake_group, name):
    """The program's collectives, forward and backward (kind, phase, bytes), are the ones the plan
    records for the stage, which are the intra-op solution's: none unplanned, none missing.
    (Gradients' own reductions, once per step, are not in the program.) An all-gather is handed
    this rank's shard; the solution counts what it gathers."""
    from autopar.cost_models import get_cluster
    from autopar.planner.intra_op import shard_stage
    from autopar.planner.manual import MEGATRON

    fresh = autopar.load_workload(name, batch=4, device="cpu")
    sharding = shard_stage(autopar.capture(fresh.model, fresh.example_inputs), get_cluster("cpu-local").with_mesh(1, 2),
                           (1, 2), (1, 2), rule=MEGATRON)
    w, plan, graph, program = _planned_stage(name)
    solved = Counter((c["kind"], c["phase"], c["bytes"] // (2 if c["kind"] == "all_gather" else 1))
                     for c in sharding.collectives if c["axis"] == "tp" and c["phase"] != "gradient")
    assert Counter((c["kind"], c["phase"], c["bytes"]) for c in plan.stages[0].collectives) == solved
    graph(*w.example_inputs).float().pow(2).mean().backward()
    issued = Counter((c.kind, c.phase, c.nbytes) for c in program.collectives())
    assert program.lowered and {c.axis for c in program.collectives()} == {"tp"}
    assert issued == solved and program.unplanned() == ([], [])


def test_a_program_that_is_not_its_plan_is_an_error_at_build_time(fake_group):
    """Checked as the stage is built (its training program traced there, on the example inputs):
    a collective the plan did not price, and one it priced that the program does not issue, are
    named with their op in the error and in `programs()`."""
    from autopar.runtime.lower import NotAsPlanned, lower_now, programs

    w, plan, graph, program = _planned_stage("gpt-tiny")
    record = plan.stages[0].collectives
    dropped = next(c for c in record if c["phase"] == "backward")
    record.remove(dropped)
    record.append({"node": "made_up", "kind": "all_to_all", "phase": "forward", "bytes": 64.0})
    with pytest.raises(NotAsPlanned) as error:
        lower_now(graph, tuple(w.example_inputs))
    assert f"issued, not priced: all_reduce in backward at {dropped['node']}" in str(error.value)
    assert "priced, not issued: all_to_all in forward at made_up" in str(error.value)
    (report,) = programs([graph], [0])
    assert [(c["kind"], c["node"]) for c in report["unplanned"]] == [("all_reduce", dropped["node"])]
    assert report["missing"] == [record[-1]]


def test_a_plan_edited_after_planning_is_not_checked_against_its_old_record(fake_group):
    """The record is of the program the planner priced: a plan whose placements, precision or
    recomputation were changed afterwards (by hand, in its JSON) runs unchecked, not refused; the
    record and what it was priced from survive JSON."""
    w, plan, graph, program = _planned_stage("gpt-tiny")
    stage = plan.stages[0]
    assert stage.collectives and plan.priced_collectives(stage) is stage.collectives
    again = autopar.Plan.from_json(plan.to_json())
    assert again.priced_collectives(again.stages[0]) == stage.collectives
    for edit in ({"recompute": True}, {"ops": {**stage.ops, next(iter(stage.ops)): [None]}}):
        assert plan.priced_collectives(dataclasses.replace(stage, **edit)) is None
    assert dataclasses.replace(plan, precision="bf16").priced_collectives(stage) is None


def test_a_lowered_stage_accumulates_gradients_as_autograd_does(fake_group):
    """The lowered stage stores its parameters' gradients itself (on local tensors), as autograd's
    AccumulateGrad would: a second backward adds to them, `backward(inputs=...)` fills only those
    named, `torch.autograd.grad` fills none and returns them, and the post-accumulate hooks (the
    data axis's synchroniser) run once per parameter per backward."""
    w, plan, graph, program = _planned_stage("gpt-tiny")
    params = dict(graph.named_parameters())
    calls = Counter()
    for name, p in params.items():
        p.register_post_accumulate_grad_hook(lambda p, name=name: calls.update([name]))

    def loss():
        return graph(*w.example_inputs).float().pow(2).mean()

    loss().backward()
    assert program.lowered and set(calls) == set(params) and set(calls.values()) == {1}
    once = {n: p.grad.to_local().clone() for n, p in params.items()}
    assert all(p.grad.placements == p.placements for p in params.values())
    loss().backward()
    assert all(torch.allclose(p.grad.to_local(), 2 * once[n]) for n, p in params.items())
    graph.zero_grad(set_to_none=True)
    first, *rest = params
    loss().backward(inputs=[params[first]])
    assert torch.equal(params[first].grad.to_local(), once[first]) and all(params[n].grad is None for n in rest)
    graph.zero_grad(set_to_none=True)
    grads = torch.autograd.grad(loss(), list(params.values()))
    assert all(p.grad is None for p in params.values())
    assert all(torch.equal(g.to_local(), once[n]) for n, g in zip(params, grads))


def test_an_all_reduce_sums_in_place_only_what_nothing_else_reads(fake_group):
    """The eager program sums a value in place (`all_reduce_`, no copy per call) where the value is
    computed in the program and read by nothing else, through views read once; a value read again
    later, one handed in by the caller, or one whose memory another value shares keeps the
    functional all-reduce, which sums a copy."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as fc
    from torch.fx.experimental.proxy_tensor import make_fx

    from autopar.runtime.lower import _reduce_in_place

    group = dist.group.WORLD

    def program(x, w):
        dead = fc.all_reduce(x @ w, "sum", group)  # computed here, read by the reduce alone
        viewed = fc.all_reduce((x @ w).view(-1), "sum", group)  # through a view read once
        again = x * 2
        read_again = fc.all_reduce(again, "sum", group)  # `again` is read below
        given = fc.all_reduce(x, "sum", group)  # the caller's tensor
        base = x @ w
        shared = fc.all_reduce(torch.ops.aten._unsafe_view(base, [-1]), "sum", group)  # `base` is read below
        return dead + viewed.view_as(dead) + read_again + again + given + shared.view_as(base) + base

    gm = make_fx(program)(torch.randn(4, 4), torch.randn(4, 4))
    _reduce_in_place(gm)
    reduces = [n for n in gm.graph.nodes if "all_reduce" in str(n.target)]
    assert [n.target.__name__ for n in reduces] == ["all_reduce_.default", "all_reduce_.default",
                                                    "all_reduce.default", "all_reduce.default", "all_reduce.default"]


def test_a_backward_cut_in_two_computes_each_gradient_once_and_alike():
    """`split_backward.split`: the input part and the weight part of a two-layer MLP's backward
    graph (AOTAutograd's) give the whole graph's gradients, and no op runs in both parts."""
    from functorch.compile import default_partition, make_boxed_func
    from torch._functorch.aot_autograd import aot_function

    from autopar.runtime.split_backward import split

    graphs = {}

    def keep(phase):
        def compiler(gm, example):
            graphs[phase] = gm
            return make_boxed_func(gm.forward)
        return compiler

    def mlp(w1, w2, x):
        return (torch.nn.functional.gelu(x @ w1) @ w2).sum()

    w1, w2, x = (torch.randn(*s, requires_grad=True) for s in ((8, 16), (16, 4), (5, 8)))
    f = aot_function(mlp, fw_compiler=keep("forward"), bw_compiler=keep("backward"), partition_fn=default_partition)
    f(w1, w2, x).backward()
    whole = graphs["backward"]
    first, later = split(whole, 2)
    args = [n.meta["val"] for n in whole.graph.find_nodes(op="placeholder")]
    args = [torch.randn(a.shape, dtype=a.dtype) if isinstance(a, torch.Tensor) else a for a in args]
    expected = whole(*args)
    out = first(*args)
    handed = out[3:]
    assert out[:2] == (None, None) and torch.allclose(out[2], expected[2])  # the input's gradient
    for got, want in zip(later(*handed), expected[:2]):
        assert torch.allclose(got, want)
    ops = [sum(1 for n in g.graph.nodes if n.op == "call_function") for g in (whole, first, later)]
    assert ops[1] + ops[2] == ops[0] and ops[2] > 0
