"""`parallelize` as a module in the user's own loop: `pm(x)`, `loss.backward()`, any optimizer, on
4 gloo ranks, equal to the same loop on one process."""

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F

import autopar
from autopar import AutoparError
from autopar.contract.placements import Shard
from tests.distributed import run_ranks, shared_ranks

STEPS, BATCH, ACCUMULATE = 3, 8, 2  # BATCH: the global batch of one forward; a step accumulates ACCUMULATE
LR = 1e-3


def _model_and_batches():
    """gpt-tiny with its position embedding frozen, and each step's ACCUMULATE global batches."""
    torch.manual_seed(0)
    w = autopar.load_workload("gpt-tiny", batch=BATCH, device="cpu")
    w.model.wpe.weight.requires_grad_(False)
    g = torch.Generator().manual_seed(5)
    steps = [[w.make_batch(BATCH, g) for _ in range(ACCUMULATE)] for _ in range(STEPS)]
    evaluation = w.make_batch(BATCH, g)
    return w, steps, evaluation


def _loss(logits, target):
    """Next-token cross entropy and an auxiliary loss linear in the samples (a mean over them)."""
    main = F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())
    return main + 0.01 * logits.float().pow(2).mean()


def _loop(model, steps, evaluation, call, slice_of, sync, params):
    """The loop people write: accumulation over ACCUMULATE batches (the gradient synchronised with
    the last), AdamW under a cosine schedule, clipping by the global norm, an evaluation under
    no_grad between steps. `call` runs the model; `slice_of` cuts this rank's samples; `sync(loss)`
    averages a loss over the ranks; `params` the trained parameters."""
    opt = torch.optim.AdamW([p for p in params if p.requires_grad], lr=LR, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)
    losses, evaluated, norms = [], [], []
    for batches in steps:
        opt.zero_grad()
        total = 0.0
        for k, (inputs, target) in enumerate(batches):
            last = k == len(batches) - 1
            with contextlib.nullcontext() if last else getattr(model, "no_sync", contextlib.nullcontext)():
                loss = _loss(call(*slice_of(inputs)), slice_of(target)) / len(batches)
                loss.backward()
            total += sync(loss.detach())
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, 1.0)))
        opt.step()
        schedule.step()
        losses.append(total)
        model.eval()
        with torch.no_grad():
            inputs, target = evaluation
            evaluated.append(sync(_loss(call(*slice_of(inputs)), slice_of(target))))
        model.train()
    return losses, evaluated, norms


def _one_process():
    w, steps, evaluation = _model_and_batches()
    losses, evaluated, norms = _loop(w.model, steps, evaluation, w.model, lambda x: x, float,
                                     list(w.model.parameters()))
    return losses, evaluated, norms, {n: p.detach().clone() for n, p in w.model.named_parameters()}


def _zero3(world, layout):
    """The layout with every parameter also sharded over the data axis (ZeRO-3)."""
    import dataclasses

    from autopar.cost_models import get_cluster
    from autopar.planner.manual import Layout, manual_plan, manual_search
    from autopar.planner.search import Search

    w, _, _ = _model_and_batches()
    cluster = dataclasses.replace(get_cluster("cpu-local"), devices_per_host=world)
    plan = manual_plan(manual_search(Search.start(w, cluster, (1, world))), Layout.parse(layout))
    for stage in plan.stages:
        stage.params = {f: [Shard(0), p[1]] for f, p in stage.params.items()}
    return plan


def _parallel(rank, world, layout):
    import torch.distributed as dist

    w, steps, evaluation = _model_and_batches()
    plan = _zero3(world, layout.removesuffix("+z3")) if layout and layout.endswith("+z3") else layout
    pm = autopar.parallelize(w.model, (1, world), w.example_inputs, plan=plan)
    assert isinstance(pm, torch.nn.Module)
    dp, index = pm.data_parallel_size, pm.data_parallel_rank

    def sync(loss):
        loss = loss.detach().clone().double()
        dist.all_reduce(loss)  # the ranks of a tensor group hold the same loss: the mean over all is the dp mean
        return float(loss) / world

    def mine(x):  # this rank's data-parallel slice
        return tuple(mine(v) for v in x) if isinstance(x, tuple) else x.tensor_split(dp)[index]

    losses, evaluated, norms = _loop(pm, steps, evaluation, pm, mine, sync,
                                     list(pm.parameters()))
    names = [n for n, _ in pm.named_parameters()]
    return losses, evaluated, norms, pm.full_state_dict(), names, pm.plan.name


LAYOUTS = [("4,1,1",), ("1,4,1",), ("4,1,1+z3",), ("2,2,1",), (None,)]


@pytest.mark.parametrize("layout", [case[0] for case in LAYOUTS], ids=["dp", "tp", "zero3", "dp-tp", "searched"])
def test_the_users_loop_trains_as_on_one_process(tmp_path, layout):
    """Two losses, gradient accumulation with `no_sync`, AdamW and a cosine schedule, clipping with
    `clip_grad_norm_` over `pm.parameters()`, an evaluation pass and a frozen embedding: the losses,
    the norms and the trained parameters equal the same loop on one process."""
    losses, evaluated, norms, params = _one_process()
    for got_losses, got_eval, got_norms, got_params, names, _ in shared_ranks(_parallel, 4, LAYOUTS, (layout,),
                                                                             tmp_path):
        assert got_losses == pytest.approx(losses, rel=1e-5)
        assert got_eval == pytest.approx(evaluated, rel=1e-5)
        assert got_norms == pytest.approx(norms, rel=1e-5)
        assert sorted(names) == sorted(params)  # the model's own names
        for key, value in params.items():
            # Adam divides each gradient by its own magnitude: where one is near zero, rounding in its
            # sum (another order over the ranks) moves the weight by up to LR; the losses and norms
            # above hold the gradients to rel 1e-5
            torch.testing.assert_close(got_params[key], value, rtol=1e-5, atol=LR / 10)
        assert torch.equal(got_params["wpe.weight"], params["wpe.weight"])  # frozen: untouched


def _refusals(rank, world):
    w, steps, _ = _model_and_batches()
    said = []
    for plan in ("1,1,2,2",):
        try:
            autopar.parallelize(w.model, (1, world), w.example_inputs, plan=plan)
        except AutoparError as exc:
            said.append(str(exc))
    pm = autopar.parallelize(w.model, (1, world), w.example_inputs, plan="1,2,1")
    for bad in (lambda: pm(steps[0][0][0][0][:3]), lambda: pm.step(*steps[0][0])):
        try:
            bad()
        except AutoparError as exc:
            said.append(str(exc))
    return said


def test_what_the_module_cannot_take_is_refused_in_one_message(tmp_path):
    """A pipeline without a loss, a batch the program was not built for, `step` without
    `loss_fn` and `optimizer`: one message each, on every rank."""
    for said in run_ranks(_refusals, 2, tmp_path):
        assert len(said) == 3
        assert "pipeline" in said[0] and "loss_fn" in said[0]
        assert "3 samples" in said[1] and "built for 8" in said[1]
        assert "loss_fn" in said[2] and "optimizer" in said[2]
