"""Activation recomputation as planned, on 2 and 4 gloo ranks: a plan whose stages recompute trains
exactly as the same plan without (losses and parameters, rel 1e-6), and each recomputing stage
really runs each of its layers' forward twice per microbatch (once more in backward)."""

import dataclasses

import pytest
import torch

import autopar
from autopar.contract.placements import Shard
from tests.distributed import shared_ranks
from tests.families import workload as family
from tests.test_parallelize import _layout, _staged

STEPS = 2
# one stage (DP, TP, an MoE's DP×TP), ZeRO-3 in a pipeline, torch's 1F1B over 4 rotary stages, the
# fan-out executor (stages of 2 + 1 + 1 ranks), and a searched plan
CASES = {4: [("gpt-tiny", "4,1,1"), ("gpt-tiny", "1,4,1"), ("moe-tiny", "2,2,1"), ("gpt-tiny", "zero3:2,1,2,2"),
             ("llama", "1,1,4,4"), ("gpt-tiny", "2+1+1"), ("gpt-tiny", "searched")],
         2: [("gpt-tiny", "1,2,1"), ("llama", "1,1,2,2")]}


def _setup(name, layout):
    torch.manual_seed(0)
    batch = 32 if layout == "searched" else 8  # activations that outweigh the weights
    w = family(name) if name == "llama" else autopar.load_workload(name, batch=batch, device="cpu")
    gen = torch.Generator().manual_seed(5)
    return w, [w.make_batch(w.batch, gen) for _ in range(STEPS)]


def _plan(w, world, layout, recompute):
    """The layout's plan with every stage recomputing or none; "searched": the planner's two-stage
    plan of 8 microbatches under a memory limit (80 % of its peak without one) that makes a
    stage recompute."""
    from autopar.cost_models import get_cluster
    from autopar.planner.search import Search, plan_auto

    cluster = dataclasses.replace(get_cluster("cpu-local"), devices_per_host=world)
    if layout == "searched":
        shape = {"stages": 2, "num_microbatches": 8}
        free = plan_auto(Search.start(w, cluster, (1, world)), **shape).estimate.peak_memory_bytes
        plan = plan_auto(Search.start(w, cluster, (1, world), memory_limit=0.8 * free), **shape)
        assert any(s.recompute for s in plan.stages), "the limit should force recomputation"
        return plan if recompute else dataclasses.replace(
            plan, stages=[dataclasses.replace(s, recompute=False) for s in plan.stages])
    if layout == "2+1+1":
        plan = _staged(w, world, ((1, 2), (1, 1), (1, 1)), "1f1b", 4)
    else:
        plan = _layout(w, world, layout.removeprefix("zero3:"))
    for stage in plan.stages:
        stage.recompute = recompute
        if layout.startswith("zero3:"):
            stage.params = {f: [Shard(0), p[1]] for f, p in stage.params.items()}
    return plan


def _counting(module):
    """Counts the layer segments this rank's stage runs (each twice when it recomputes)."""
    calls = [0]
    inner = module._segment

    def count(*args, **kwargs):
        calls[0] += 1
        return inner(*args, **kwargs)

    module._segment = count
    return calls


def _train(rank, world, name, layout):
    runs = []
    for recompute in (False, True):
        w, batches = _setup(name, layout)
        plan = _plan(w, world, layout, recompute)
        pm = autopar.parallelize(w.model, (1, world), w.example_inputs, loss_fn=w.loss_fn,
                                 optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), plan=plan)
        module = getattr(pm, "graph", None) or getattr(pm, "module", None)
        calls = _counting(module) if module is not None else [0]
        losses = [pm.step(*b) for b in batches]
        mine = plan.stages[getattr(pm, "stage_index", 0)]
        runs.append((losses, pm.full_state_dict(), calls[0],
                     len(module.segments) * plan.num_microbatches * STEPS if module is not None else 0, mine.recompute))
    return runs


@pytest.mark.parametrize("world, name, layout", [(world, *case) for world, cases in CASES.items() for case in cases])
def test_recomputing_trains_as_keeping_activations(tmp_path, world, name, layout):
    for (losses, params, calls, segments, _), (r_losses, r_params, r_calls, r_segments, recomputes) in shared_ranks(
            _train, world, CASES[world], (name, layout), tmp_path):
        assert calls == segments  # without recomputation each layer runs once per microbatch
        assert r_losses == pytest.approx(losses, rel=1e-6)
        for key, value in params.items():
            torch.testing.assert_close(r_params[key], value, rtol=1e-6, atol=1e-7)
        # each layer's forward once more in backward (not those nothing differentiates: a rotary table)
        assert r_segments < r_calls <= 2 * r_segments if recomputes else r_calls == r_segments
