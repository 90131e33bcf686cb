"""Interleaved and zero-bubble schedules (torch's classes, several stages per rank) on 4 gloo ranks:
losses and final parameters equal single-process training, for families `transformers` ships."""

from __future__ import annotations

import dataclasses

import pytest

import autopar
from autopar.contract.placements import Shard
from tests.distributed import on_rank0, run_ranks, shared_ranks, tiered
from tests.families import optimizer, setup, single
from tests.test_families import assert_same_training

WORLD = 4
# (schedule, layout DP,TP,PP,MB, stages per device group)
SCHEDULES = {
    "interleaved-1f1b": ("interleaved-1f1b", "1,1,4,4", 1),
    "interleaved-1f1b-v2": ("interleaved-1f1b", "2,1,2,4", 2),
    "interleaved-1f1b-tp": ("interleaved-1f1b", "1,2,2,4", 2),
    "zb-h1": ("interleaved-zb", "1,1,4,4", 1),
    "interleaved-1f1b-recompute": ("interleaved-1f1b", "2,1,2,4", 2),  # each layer recomputed before its backward
    "interleaved-zb-v2": ("interleaved-zb", "2,1,2,4", 2),
    "zbv": ("zbv", "1,2,2,4", 2),
    "interleaved-1f1b-zero3": ("interleaved-1f1b", "2,1,2,4", 2),  # every parameter sharded over the data axis
    "zbv-zero3": ("zbv", "2,1,2,4", 2),
    "zbv-split-recompute": ("zbv", "2,1,2,4", 2),
}
FAMILIES = ["gpt2", "llama", "bert"]
# GPT-2 under every case; Llama's rotary blocks where a tensor axis or a split backward meets them;
# BERT's encoder under the V-shaped schedule (a schedule runs any stage's graph alike: the others on
# GPT-2 alone, CI has 25 minutes)
SOME = {"llama": ("interleaved-1f1b-tp", "interleaved-zb-v2", "zbv"), "bert": ("zbv",)}


def _plan(w, key):
    """The case's plan, made on rank 0 (`on_rank0`)."""
    return on_rank0(lambda: _make_plan(w, key))


def _make_plan(w, key):
    from autopar.cost_models import get_cluster
    from autopar.planner.manual import Layout, manual_plan, manual_search
    from autopar.planner.search import Search

    schedule, layout, virtual = SCHEDULES[key]
    cluster = dataclasses.replace(get_cluster("cpu-local"), devices_per_host=WORLD)
    search = Search.start(w, cluster, (1, WORLD), schedule=schedule)
    recompute = key.endswith("recompute") and not key.endswith("split-recompute")
    plan = manual_plan(manual_search(search), Layout.parse(layout, recompute, virtual))
    if key.endswith("split-recompute"):  # what manual_plan refuses: each stage recomputing under a split backward
        for stage in plan.stages:
            stage.recompute = True
    if key.endswith("zero3"):
        for stage in plan.stages:
            stage.params = {f: [Shard(0), p[1]] for f, p in stage.params.items()}
    return plan


def _parallel(rank, world, name, key):
    w, batches = setup(name)
    plan = _plan(w, key)
    pm = autopar.parallelize(w.model, (1, world), w.example_inputs, loss_fn=w.loss_fn, optimizer=optimizer,
                             plan=plan)
    losses = [pm.step(inputs, target) for inputs, target in batches]
    return losses, pm.full_state_dict(), (plan.schedule, plan.virtual, len(plan.stages), type(pm.schedule).__name__)


def _refused(rank, world, name, key):
    w, _ = setup(name)
    try:
        autopar.parallelize(w.model, (1, world), w.example_inputs, loss_fn=w.loss_fn, optimizer=optimizer,
                            plan=_plan(w, key))
    except autopar.AutoparError as exc:
        return str(exc)
    return None


REFUSED = {  # refused with one message each until they train as one process does; the search offers neither
    # FSDP2 under torch's split backward: Llama's losses came out 6e-5 apart after one step
    "zbv-zero3": "zbv splits backward, which FSDP2's ZeRO does not yet train as one process does",
    # torch's checkpoint: "a different number of tensors was saved during the original forward and recomputation"
    "zbv-split-recompute": "torch's checkpoint cannot recompute a layer for its input gradient and again",
}
CASES = [(name, key) for name in FAMILIES for key in SCHEDULES if key not in REFUSED and key in SOME.get(name, [key])]
# CI's slice: each schedule class once (ZB-H1 and the interleaved ones with recomputation, ZeRO-3 and
# a tensor axis, the interleaved zero-bubble split backward, the V on an encoder), with rotary
# blocks under a tensor axis and a split backward; the rest of the matrix is the sweep's
SWEEP = [("gpt2", key) for key in ("interleaved-1f1b", "interleaved-1f1b-v2", "interleaved-1f1b-tp",
                                   "interleaved-zb-v2", "zbv")] + [("llama", "zbv")]


@pytest.mark.parametrize("key", REFUSED)
def test_what_a_split_backward_does_not_run_yet_is_refused(tmp_path, key):
    cases = [("llama", k) for k in REFUSED]
    for said in shared_ranks(_refused, WORLD, cases, ("llama", key), tmp_path):
        assert REFUSED[key] in said


@pytest.mark.parametrize("name, key", tiered(CASES, SWEEP))
def test_schedule_trains_like_one_process(tmp_path, name, key):
    losses, params = single(name)
    schedule, layout, virtual = SCHEDULES[key]
    for got_losses, got_params, (planned, v, stages, ran) in shared_ranks(_parallel, WORLD, CASES, (name, key), tmp_path,
                                                                          SWEEP):
        assert (planned, v, stages) == (schedule, virtual, int(layout.split(",")[2]) * virtual)
        assert ran == {"interleaved-1f1b": "ScheduleInterleaved1F1B", "interleaved-zb": "ScheduleInterleavedZeroBubble",
                       "zbv": "ScheduleZBVZeroBubble"}[schedule]
        assert_same_training(got_losses, got_params, losses, params)


def _checkpointed(rank, world, name, saved, loaded):
    """Two steps under `saved`, a checkpoint; a model built from other weights under `loaded` loads it."""
    import tempfile

    import torch

    from autopar.runtime import checkpoint

    directory = on_rank0(lambda: tempfile.mkdtemp(prefix="autopar-ckpt-"))
    w, batches = setup(name)
    pm = autopar.parallelize(w.model, (1, world), w.example_inputs, loss_fn=w.loss_fn, optimizer=optimizer,
                             plan=_plan(w, saved) if saved in SCHEDULES else saved)
    for inputs, target in batches:
        pm.step(inputs, target)
    path = checkpoint.save(pm, directory, 2)
    before = pm.full_state_dict()
    other, _ = setup(name, seed=7)
    om = autopar.parallelize(other.model, (1, world), other.example_inputs, loss_fn=other.loss_fn,
                             optimizer=optimizer, plan=_plan(other, loaded) if loaded in SCHEDULES else loaded)
    checkpoint.load(om, path)
    after = om.full_state_dict()
    return all(torch.equal(after[k], v) for k, v in before.items()) and after.keys() == before.keys()


MOVES = [("gpt2", "zbv", "2,1,2,4"), ("gpt2", "1,1,4,4", "interleaved-1f1b-v2")]


@pytest.mark.parametrize("name, saved, loaded", MOVES)
def test_a_checkpoint_moves_between_schedules(tmp_path, name, saved, loaded):
    """Several stages on a rank (a tied weight on both ends of a V: one parameter) save and load
    like any plan's stages."""
    assert all(shared_ranks(_checkpointed, WORLD, MOVES, (name, saved, loaded), tmp_path))


def _last_stage_peak(rank, world, schedule):
    """The last stage's measured peak of a step, and its plan's prediction: gpt-tiny, 8 microbatches
    of 2 samples over 2 stages."""
    import torch

    from autopar.cost_models import get_cluster
    from autopar.planner.manual import Layout, manual_plan, manual_search
    from autopar.planner.search import Search
    from autopar.runtime.memory import measured_step

    w = autopar.load_workload("gpt-tiny", batch=16, device="cpu")
    cluster = dataclasses.replace(get_cluster("cpu-local"), devices_per_host=world)
    plan = manual_plan(manual_search(Search.start(w, cluster, (1, world), schedule=schedule)), Layout.parse("1,1,2,8"))
    pm = autopar.parallelize(w.model, (1, world), w.example_inputs, loss_fn=w.loss_fn, plan=plan,
                             optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4))
    gen = torch.Generator().manual_seed(1)
    pm.step(*w.make_batch(w.batch, gen))  # the optimizer's states exist from here on
    _, measured = measured_step(pm, *w.make_batch(w.batch, gen))
    return measured["total"], plan.stages[rank].cost["peak_bytes"]


def test_a_split_backward_frees_each_microbatchs_loss_at_its_input_pass(tmp_path):
    """torch's input pass keeps the graph for the weights' pass, and the schedule keeps every loss to
    the step's end: the last stage held all m microbatches' log-probabilities (m logits-sized
    tensors; gpt-small under interleaved-zb: 179.5 MB measured, 116.4 MB since). Its peak now stays
    within the plan's prediction, which prices them per microbatch in flight."""
    (_, _), (zb, predicted) = run_ranks(_last_stage_peak, 2, tmp_path, "interleaved-zb")
    assert zb <= predicted


def _backward_ops(rank, world):
    """Ops issued in one step's backward on each rank, gpt-tiny over 2 lowered stages, 8 microbatches,
    under 1F1B and under interleaved-zb (whose backward runs in two passes), and the step's loss."""
    import torch

    from autopar.cost_models import get_cluster
    from autopar.planner.manual import Layout, manual_plan, manual_search
    from autopar.planner.search import Search
    from autopar.runtime.breakdown import measuring, summarise

    out = {}
    for schedule in ("1f1b", "interleaved-zb"):
        torch.manual_seed(0)
        w = autopar.load_workload("gpt-tiny", batch=16, device="cpu")
        cluster = dataclasses.replace(get_cluster("cpu-local"), devices_per_host=world)
        plan = manual_plan(manual_search(Search.start(w, cluster, (1, world), schedule=schedule)),
                           Layout.parse("1,1,2,8"))
        pm = autopar.parallelize(w.model, (1, world), w.example_inputs, loss_fn=w.loss_fn, plan=plan,
                                 optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4))
        gen = torch.Generator().manual_seed(1)
        pm.step(*w.make_batch(w.batch, gen))
        with measuring() as mode:
            loss = pm.step(*w.make_batch(w.batch, gen))
        out[schedule] = (summarise(mode, 1.0)["ops"], [p["runs"] for p in pm.programs()], float(loss))
    return out


def test_a_split_backward_runs_a_lowered_stages_backward_once(tmp_path):
    """A lowered stage is one autograd node: torch's split ran its whole backward graph in the input
    pass and again in the weights' (1.78x the ops of 1F1B's step). Cut in two
    (`runtime.split_backward`), the zero-bubble step issues the ops 1F1B does, and trains alike."""
    for got in run_ranks(_backward_ops, 2, tmp_path):
        (plain, runs, loss), (split, split_runs, split_loss) = got["1f1b"], got["interleaved-zb"]
        assert runs == split_runs == ["lowered"]
        assert split <= 1.1 * plain, (split, plain)  # (torch's split: 1.78x; cut: 1.03x, the loss's seed and the weights' hand-over)
        assert split_loss == pytest.approx(loss, rel=1e-5)
