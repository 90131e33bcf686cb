"""`parallelize` as a module in the user's own loop: `pm(x)`, `loss.backward()`, any optimizer, on
4 gloo ranks, equal to the same loop on one process."""

import contextlib

import pytest
import torch
import torch.nn.functional as F

import autopar
from autopar import AutoparError
from autopar.contract.placements import Shard
from tests.distributed import run_ranks, shared_ranks

STEPS, BATCH, ACCUMULATE = 3, 8, 2  # BATCH: the global batch of one forward; a step accumulates ACCUMULATE
LAST, EVALUATED = 4, 12  # the last step's batches (an epoch's partial batch), the evaluation batch
LR = 1e-3


def _model_and_batches(last=LAST):
    """gpt-tiny with its position embedding frozen, each step's ACCUMULATE global batches (the
    last step's of `last` samples) and an evaluation batch of EVALUATED."""
    torch.manual_seed(0)
    w = autopar.load_workload("gpt-tiny", batch=BATCH, device="cpu")
    w.model.wpe.weight.requires_grad_(False)
    g = torch.Generator().manual_seed(5)
    steps = [[w.make_batch(BATCH if i < STEPS - 1 else last, g) for _ in range(ACCUMULATE)] for i in range(STEPS)]
    evaluation = w.make_batch(EVALUATED, g)
    return w, steps, evaluation


def _loss(logits, target):
    """Next-token cross entropy and an auxiliary loss linear in the samples (a mean over them)."""
    main = F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())
    return main + 0.01 * logits.float().pow(2).mean()


def _loop(model, steps, evaluation, call, slice_of, sync, params, bf16=False):
    """The loop people write: accumulation over ACCUMULATE batches (the gradient synchronised with
    the last), AdamW under a cosine schedule, clipping by the global norm, an evaluation under
    no_grad between steps. `call` runs the model; `slice_of` cuts this rank's samples; `sync(loss)`
    averages a loss over the ranks; `params` the trained parameters; `bf16`: forward and loss
    under `torch.autocast(bfloat16)`."""
    if bf16:
        plain = call

        def call(*args):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return plain(*args)

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


def _one_process(last=LAST, bf16=False):
    w, steps, evaluation = _model_and_batches(last)
    losses, evaluated, norms = _loop(w.model, steps, evaluation, w.model, lambda x: x, float,
                                     list(w.model.parameters()), bf16)
    return losses, evaluated, norms, {n: p.detach().clone() for n, p in w.model.named_parameters()}


def _mesh(kind, world):
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if kind == "1-d":  # what single-host scripts pass
        return init_device_mesh("cpu", (world,))
    if kind == "named":  # the sizes pinned: 2,2,1
        return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    if kind == "reordered":  # tensor axis first, ranks in reverse: tp groups {3, 1}, {2, 0}; dp {3, 2}, {1, 0}
        return DeviceMesh("cpu", [[3, 2], [1, 0]], mesh_dim_names=("tp", "dp"))
    return (1, world)


def _parallel(rank, world, layout, bf16=False, mesh=None):
    import torch.distributed as dist

    zero = layout is not None and layout.endswith("+z3")
    w, steps, evaluation = _model_and_batches(BATCH if zero else LAST)  # ZeRO trains the plan's shape only
    pm = autopar.parallelize(w.model, _mesh(mesh, world), w.example_inputs, plan=layout)
    if zero:  # "+z3": every parameter sharded over the data axis
        assert all(p[0] == Shard(0) for p in pm.plan.stages[0].params.values()) and pm.graph.units
    assert isinstance(pm, torch.nn.Module)
    dp, index = pm.data_parallel_size, pm.data_parallel_rank

    def sync(loss):
        loss = loss.detach().clone().double()
        dist.all_reduce(loss)  # the ranks of a tensor group hold the same loss: the mean over all is the dp mean
        return float(loss) / world

    def mine(x):  # this rank's data-parallel slice
        return tuple(mine(v) for v in x) if isinstance(x, tuple) else x.tensor_split(dp)[index]

    losses, evaluated, norms = _loop(pm, steps, evaluation, pm, mine, sync, list(pm.parameters()), bf16)
    names = [n for n, _ in pm.named_parameters()]
    groups = (sorted(dist.get_process_group_ranks(pm.group)), sorted(dist.get_process_group_ranks(pm.tp_group)))
    return losses, evaluated, norms, pm.full_state_dict(), names, (pm.plan.stages[0].logical_mesh, groups)


MESHES = [("1-d", "2,2,1"), ("named", None), ("reordered", None)]
# one start of 4 ranks for the searched plan, the autocast case and the meshes (the loop's 2,2,1 is
# the 1-D mesh's run); the loop's layouts of one axis on 2 (the same program on 2 ranks or 4; a
# 4-rank case costs about 3 times a 2-rank one on 2 cores)
LAYOUTS = [(None,), ("2,2,1", True)] + [(plan, False, kind) for kind, plan in MESHES]
ON_TWO = [("2,1,1",), ("1,2,1",), ("2,1,1+z3",)]
LOOP = {"dp": ("2,1,1",), "tp": ("1,2,1",), "zero3": ("2,1,1+z3",), "dp-tp": ("2,2,1", False, "1-d"), "searched": (None,)}


@pytest.mark.parametrize("layout", LOOP)
def test_the_users_loop_trains_as_on_one_process(tmp_path, layout):
    """Two losses, gradient accumulation with `no_sync`, AdamW and a cosine schedule, clipping with
    `clip_grad_norm_` over `pm.parameters()`, an evaluation pass at another batch size under
    `eval()` and `no_grad`, a frozen embedding and a smaller last batch (not under ZeRO, which
    trains the plan's shape only): the losses, the norms and the trained parameters equal the same
    loop on one process."""
    losses, evaluated, norms, params = _one_process(BATCH if layout == "zero3" else LAST)
    world, cases = (2, ON_TWO) if LOOP[layout] in ON_TWO else (4, LAYOUTS)
    for got_losses, got_eval, got_norms, got_params, names, _ in shared_ranks(_parallel, world, cases, LOOP[layout],
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


def test_the_users_autocast_is_honoured(tmp_path):
    """The same loop under the user's `torch.autocast(bfloat16)` on DP×TP: the ranks compute in
    bf16 as one process does, their matmuls' sums in another order, which bf16's 8 bits round
    apart (measured: losses rel 1.2e-5, norms 6e-4, weights 3.2 lr; held to 1e-3, 5e-3, 5 lr)."""
    losses, evaluated, norms, params = _one_process(bf16=True)
    for got_losses, got_eval, got_norms, got_params, _, _ in shared_ranks(_parallel, 4, LAYOUTS, ("2,2,1", True),
                                                                          tmp_path):
        assert got_losses == pytest.approx(losses, rel=1e-3)
        assert got_eval == pytest.approx(evaluated, rel=1e-3)
        assert got_norms == pytest.approx(norms, rel=5e-3)
        for key, value in params.items():
            torch.testing.assert_close(got_params[key], value, rtol=0, atol=5 * LR)


def _refusals(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    w, steps, _ = _model_and_batches()
    said = []
    for mesh in (init_device_mesh("cpu", (2,), mesh_dim_names=("data",)), (2, 2), "2x1"):
        try:
            autopar.parallelize(w.model, mesh, w.example_inputs, plan="2,1,1")
        except AutoparError as exc:
            said.append(str(exc))
    for plan in ("1,1,2,2",):
        try:
            autopar.parallelize(w.model, (1, world), w.example_inputs, plan=plan)
        except AutoparError as exc:
            said.append(str(exc))
    pipeline = autopar.parallelize(w.model, (1, world), w.example_inputs, plan="1,1,2,2", loss_fn=w.loss_fn,
                                   optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    whole = autopar.parallelize(w.model, (1, world), w.example_inputs, plan="2,1,1", batch="global")
    (x,), _ = steps[0][0]
    mine = whole(x)  # the global batch in, this rank's data-parallel rows out
    assert mine.shape[0] == x.shape[0] // world
    torch.testing.assert_close(mine, w.model(x.tensor_split(world)[rank]))
    pm = autopar.parallelize(w.model, (1, world), w.example_inputs, plan="2,1,1+z3")
    for bad in (lambda: whole(x[:3]), lambda: pm(steps[0][0][0][0][:3]), lambda: pm.step(*steps[0][0]), lambda: pipeline(steps[0][0][0][0])):
        try:
            bad()
        except AutoparError as exc:
            said.append(str(exc))
    return said


def test_what_the_module_cannot_take_is_refused_in_one_message(tmp_path):
    """An axis name the runtime does not know, a mesh of another size or kind, a pipeline
    without a loss, a global batch (`batch="global"`) the data axis cannot split, training ZeRO
    at another shape than the plan's, `step` without `loss_fn` and `optimizer`, a pipeline called
    as a module: one message each, on every rank."""
    for said in run_ranks(_refusals, 2, tmp_path):
        assert len(said) == 8
        assert "'data'" in said[0] and "('pp', 'dp', 'tp')" in said[0]
        assert "2x2 has 4 devices, the job has 2 ranks" in said[1]
        assert "mesh must be a DeviceMesh" in said[2]
        assert "pipeline" in said[3] and "loss_fn" in said[3]
        assert "global batch of 3 samples does not split over the plan's 2" in said[4]
        assert "under ZeRO the program trains at the plan's shape only" in said[5] and "(3, 32)" in said[5]
        assert "loss_fn" in said[6] and "optimizer" in said[6]
        assert "pipeline of 2 stages" in said[7] and "pm.step(inputs, target)" in said[7]



@pytest.mark.parametrize("kind, plan", MESHES, ids=[m[0] for m in MESHES])
def test_the_mesh_given_is_the_mesh_that_runs(tmp_path, kind, plan):
    """A 1-D DeviceMesh, one with named axes (pinning 2,2,1 without a plan), and one whose ranks
    are not in the default order (its process groups are the mesh's): each trains as one process."""
    losses, _, _, params = _one_process()
    by_rank = shared_ranks(_parallel, 4, LAYOUTS, (plan, False, kind), tmp_path)
    for rank, (got_losses, _, _, got_params, _, (logical, groups)) in enumerate(by_rank):
        assert got_losses == pytest.approx(losses, rel=1e-5)
        for key, value in params.items():
            torch.testing.assert_close(got_params[key], value, rtol=1e-5, atol=LR / 10)
        assert tuple(logical) == (2, 2)
        if kind == "reordered":
            assert groups == ({3: [2, 3], 2: [2, 3], 1: [0, 1], 0: [0, 1]}[rank],
                              {3: [1, 3], 1: [1, 3], 2: [0, 2], 0: [0, 2]}[rank])
        else:
            assert groups == ([rank % 2, rank % 2 + 2], [rank - rank % 2, rank - rank % 2 + 1])


def test_a_mesh_whose_groups_cross_is_refused():
    """torch orders a process group's ranks ascending; a grid whose tensor and data groups cannot
    both be laid out so would have DTensor join shards out of order."""
    from autopar.runtime.parallel import UnsupportedPlan, device_mesh

    with pytest.raises(UnsupportedPlan, match=r"tensor axis and \[\[0, 2\], \[1, 3\]\] on the data axis"):
        device_mesh("cpu", [0, 3, 2, 1], 2, 2)


STATE = [("1,2,1",), ("2,1,1+z3",)]


def _hf_step(pm, opt, loss_fn, batch, dp, index):
    inputs, target = batch
    opt.zero_grad()
    loss_fn(pm(*(x.tensor_split(dp)[index] for x in inputs)), target.tensor_split(dp)[index]).backward()
    opt.step()


def _state_round_trip(rank, world, layout, tmp):
    """Train a step, save model and optimizer through DCP and the model through `save_pretrained`;
    a fresh model (other weights) loads the DCP checkpoint and both take one more step;
    `from_pretrained` reads back the full weights."""
    import os

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import transformers
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from tests.test_parallelize import _hf_gpt2

    def build(seed):
        torch.manual_seed(seed)
        w = _hf_gpt2()
        pm = autopar.parallelize(w.model, (1, world), w.example_inputs, plan=layout)
        return w, pm, torch.optim.AdamW(pm.parameters(), lr=1e-3)

    g = torch.Generator().manual_seed(5)
    w, pm, opt = build(0)
    batches = [w.make_batch(BATCH, g) for _ in range(2)]
    dp, index = pm.data_parallel_size, pm.data_parallel_rank
    _hf_step(pm, opt, w.loss_fn, batches[0], dp, index)
    sharded = get_model_state_dict(pm)
    assert all(isinstance(v, torch.distributed.tensor.DTensor) for k, v in sharded.items() if "weight" in k)
    dcp.save({"model": sharded, "optim": get_optimizer_state_dict(pm, opt)}, checkpoint_id=os.path.join(tmp, "dcp"))
    # (a replicated DTensor's full tensor is its local tensor: copied before training goes on)
    full = {k: v.clone() for k, v in get_model_state_dict(pm, options=StateDictOptions(full_state_dict=True)).items()}
    if rank == 0:
        w.model.save_pretrained(os.path.join(tmp, "hf"), state_dict=dict(full))  # (it empties the dict it gets)
    dist.barrier()
    reread = transformers.GPT2LMHeadModel.from_pretrained(os.path.join(tmp, "hf"))
    read_back = {k: v for k, v in reread.state_dict().items() if k in full}

    w2, pm2, opt2 = build(1)
    state = {"model": get_model_state_dict(pm2), "optim": get_optimizer_state_dict(pm2, opt2)}
    dcp.load(state, checkpoint_id=os.path.join(tmp, "dcp"))
    set_model_state_dict(pm2, state["model"])
    set_optimizer_state_dict(pm2, opt2, state["optim"])
    loaded = pm2.full_state_dict()
    _hf_step(pm, opt, w.loss_fn, batches[1], dp, index)
    _hf_step(pm2, opt2, w2.loss_fn, batches[1], dp, index)
    return full, read_back, loaded, pm.full_state_dict(), pm2.full_state_dict()


@pytest.mark.parametrize("layout", [case[0] for case in STATE], ids=["tp", "zero3"])
def test_state_dicts_round_trip_through_dcp_and_save_pretrained(tmp_path, layout):
    """A transformers model under TP and ZeRO-3: `get_model_state_dict` / `get_optimizer_state_dict`
    through DCP into a fresh model train on exactly as the original; the full state dict is the
    model's names and values, and `save_pretrained` / `from_pretrained` read it back."""
    shared = tmp_path.parent / "state"  # one directory for the case's ranks (tmp_path differs per test)
    shared.mkdir(exist_ok=True)
    out = shared_ranks(_state_round_trip, 2, [c + (str(shared / c[0]),) for c in STATE],
                       (layout, str(shared / layout)), tmp_path)
    for full, read_back, loaded, after, after_loaded in out:
        assert set(read_back) == set(full)
        for key, value in full.items():
            torch.testing.assert_close(read_back[key], value)
        for key, value in loaded.items():
            torch.testing.assert_close(value, full[key])
        for key, value in after.items():  # one more step each: the optimizer's state came along
            torch.testing.assert_close(after_loaded[key], value)
