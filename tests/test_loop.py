"""The training loop people write, on 2 and 4 gloo ranks under DP, TP, PP, ZeRO-3 and mixed layouts,
against one process: clipping by the global gradient norm, a learning-rate schedule on
`pm.optimizer`, `predict` for the global batch, and steps on each rank's data-parallel slice."""

import math

import pytest
import torch
from torch import nn

import autopar
from autopar import AutoparError
from autopar.contract.placements import Shard
from tests.distributed import run_ranks, shared_ranks
from tests.test_parallelize import _layout, _workload, _world

MAX_NORM = 0.5
# a layout of one axis on 2 ranks (its program is the same code on 2 or 4; a 4-rank case costs about
# 3 times a 2-rank one on 2 cores), the layouts mixing axes on 4
LAYOUTS = {"dp": "2,1,1", "tp": "1,2,1", "pp": "2,1,2,2", "zero3": "2,1,1", "dp-tp": "2,2,1",
           "tp-pp": "1,2,2,2", "zero3-tp": "2,2,1"}
# one-stage layouts in a loop of the user's own (pm(x), backward, torch's clipping): tests/test_module.py;
# here `step` with max_grad_norm, local slices and predict, on the ones that differ most
CASES = [("gpt-tiny", layout) for layout in LAYOUTS if layout not in ("tp", "dp-tp")] + [("hf-gpt2", "pp"),
                                                                                         ("hf-gpt2", "tp")]


def _optimizer(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _schedule(optimizer):
    """A rate that changes every step (warm-up, then decay)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: (step + 1) / 2 if step < 2 else 1 / step)


def _single(name):
    """Losses, gradient norms before clipping, final parameters and outputs of one process."""
    w, batches = _workload(name)
    opt = _optimizer(w.model.parameters())
    schedule = _schedule(opt)
    losses, norms = [], []
    for inputs, target in batches:
        opt.zero_grad()
        loss = w.loss_fn(w.model(*inputs), target)
        loss.backward()
        norms.append(float(nn.utils.clip_grad_norm_(w.model.parameters(), MAX_NORM)))
        opt.step()
        schedule.step()
        losses.append(loss.item())
    with torch.no_grad():
        out = autopar.first_tensor(w.model(*batches[0][0]))
    return losses, norms, {n: p.detach().clone() for n, p in w.model.named_parameters()}, out


def _plan(w, layout):
    if not layout.startswith("zero3"):
        return LAYOUTS[layout]
    plan = _layout(w, _world(LAYOUTS[layout]), LAYOUTS[layout])
    for stage in plan.stages:
        stage.params = {f: [Shard(0), p[1]] for f, p in stage.params.items()}
    return plan


def _slice(batch, pm):
    """This rank's data-parallel slice, as a DistributedSampler over contiguous blocks would give it."""
    if isinstance(batch, torch.Tensor):
        return batch.tensor_split(pm.data_parallel_size)[pm.data_parallel_rank]
    return tuple(_slice(b, pm) for b in batch)


def _loop(rank, world, name, layout):
    """Odd steps take only this rank's slice (local=True); the prediction comes after training and
    once more between two steps of another model, which must not notice it."""
    w, batches = _workload(name)
    pm = autopar.parallelize(w.model, (1, world), w.example_inputs, loss_fn=w.loss_fn, optimizer=_optimizer,
                             plan=_plan(w, layout), max_grad_norm=MAX_NORM)
    schedule = _schedule(pm.optimizer)
    losses, norms = [], []
    for i, (inputs, target) in enumerate(batches):
        local = i % 2 == 1
        losses.append(pm.step(_slice(inputs, pm), _slice(target, pm), local=True) if local else pm.step(inputs, target))
        norms.append(pm.last_grad_norm)
        schedule.step()
    return losses, norms, pm.full_state_dict(), pm.predict(batches[0][0]), (pm.data_parallel_rank, pm.data_parallel_size)


@pytest.mark.parametrize("name, layout", CASES)
def test_a_training_loop_gives_single_process_results(tmp_path, name, layout):
    losses, norms, params, out = _single(name)
    assert min(norms) > MAX_NORM  # every step clips
    world = _world(LAYOUTS[layout])
    results = shared_ranks(_loop, world, [c for c in CASES if _world(LAYOUTS[c[1]]) == world], (name, layout),
                           tmp_path)
    for got_losses, got_norms, got_params, got_out, _ in results:
        assert got_losses == pytest.approx(losses, rel=1e-5)
        assert got_norms == pytest.approx(norms, rel=1e-5)
        for key, value in params.items():
            torch.testing.assert_close(got_params[key], value, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got_out, out, rtol=1e-5, atol=1e-6)  # the same on every rank
    dp = int(LAYOUTS[layout].split(",")[0])
    assert sorted({r[-1] for r in results}) == [(r, dp) for r in range(dp)]


def _predict_between_steps(rank, world, layout):
    """Training with a prediction between steps equals training without (buffers, random state)."""
    runs = []
    for predict in (False, True):
        w, batches = _workload("wresnet-tiny")
        pm = autopar.parallelize(w.model, (1, world), w.example_inputs, loss_fn=w.loss_fn,
                                 optimizer=_optimizer, plan=layout)
        losses = []
        for inputs, target in batches:
            losses.append(pm.step(inputs, target))
            if predict:
                pm.predict(inputs)
        runs.append((losses, {n: b.clone() for n, b in pm.state_buffers.items()}))
    return runs


def test_predict_between_steps_changes_nothing(tmp_path):
    for without, with_predict in run_ranks(_predict_between_steps, 2, tmp_path, "2,1,1"):
        assert with_predict[0] == without[0]
        for name, value in without[1].items():
            assert torch.equal(with_predict[1][name], value), name


def _device_mesh(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    w, batches = _workload("mlp-tiny")
    pm = autopar.parallelize(w.model, init_device_mesh("cpu", (1, world)), w.example_inputs, loss_fn=w.loss_fn,
                             optimizer=_optimizer, plan="1,2,1", max_grad_norm=math.inf)
    pm.step(*batches[0])
    errors = []
    for mesh, norm in ((init_device_mesh("cpu", (world,), mesh_dim_names=("model",)), None), (None, 0.0)):
        try:
            autopar.parallelize(w.model, mesh, w.example_inputs, loss_fn=w.loss_fn, optimizer=_optimizer,
                                plan="1,2,1", max_grad_norm=norm)
        except AutoparError as exc:
            errors.append(str(exc))
    return pm.last_grad_norm, errors


def test_a_device_mesh_gives_the_hosts_and_bad_arguments_say_what_to_pass(tmp_path):
    w, batches = _workload("mlp-tiny")
    w.loss_fn(w.model(*batches[0][0]), batches[0][1]).backward()
    norm = float(nn.utils.get_total_norm([p.grad for p in w.model.parameters()]))
    for measured, errors in run_ranks(_device_mesh, 2, tmp_path):
        assert measured == pytest.approx(norm, rel=1e-5)  # math.inf: measured, nothing clipped
        assert "mesh axes ['model']" in errors[0] and "('pp', 'dp', 'tp')" in errors[0]
        assert "max_grad_norm must be a positive number" in errors[1]
