"""Model zoo: suite sizes, Megatron's parameter formula, MoE gating, training on CPU."""

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar import load_workload
from autopar.zoo import ZOO
from autopar.zoo.moe import top2_gating

SUITE = [name for name, e in ZOO.items() if e.source not in ("test", "measured runs on CPU")]


def _nominal(name: str) -> float:
    if name.endswith("-1t"):
        return 1.008e12  # Megatron-LM Table 1: 1008.0B
    value, unit = re.search(r"-([\d.]+)([mb])$", name).groups()
    return float(value) * (1e6 if unit == "m" else 1e9)


@pytest.mark.parametrize("name", SUITE)
def test_suite_models_have_their_published_size(name):
    w = load_workload(name, batch=1)
    n = sum(p.numel() for p in w.model.parameters())
    assert n == pytest.approx(_nominal(name), rel=0.05)
    assert all(p.is_meta for p in w.model.parameters())
    assert w.example_inputs[0].shape[0] == 1


@pytest.mark.parametrize("name", [n for n in ZOO if ZOO[n].family.__name__.endswith(".gpt")])
def test_gpt_parameters_follow_megatron_formula(name):
    cfg = ZOO[name].config
    model = load_workload(name, batch=1).model
    # Megatron's formula leaves out the final LayerNorm's weight and bias (2h)
    assert sum(p.numel() for p in model.parameters()) == cfg.megatron_params() + 2 * cfg.hidden


def test_default_batches_are_the_suites():
    assert ZOO["gpt-1.3b"].batch == 1024 and ZOO["moe-10b"].batch == 1024
    assert ZOO["wresnet-2b"].batch == 1536
    assert ZOO["megatron-18.4b"].batch == 1024 and ZOO["megatron-1t"].batch == 3072
    assert load_workload("gpt-tiny", batch=3).example_inputs[0].shape == (3, ZOO["gpt-tiny"].config.seq)


@settings(max_examples=30, deadline=None)
@given(groups=st.integers(1, 3), tokens=st.sampled_from([4, 8, 16]), experts=st.sampled_from([2, 4, 8]),
       seed=st.integers(0, 2**16))
def test_top2_gating_respects_capacity_and_normalises(groups, tokens, experts, seed):
    gen = torch.Generator().manual_seed(seed)
    gates = torch.softmax(torch.randn(groups, tokens, experts, generator=gen), dim=-1)
    combine = top2_gating(gates)
    capacity = max(1, 2 * tokens // experts)
    assert combine.shape == (groups, tokens, experts, capacity)
    dispatched = combine > 0
    assert (dispatched.sum(dim=(2, 3)) <= 2).all()  # at most two experts per token
    assert (dispatched.sum(dim=1) <= 1).all()  # a slot of an expert holds at most one token
    weight = combine.sum(dim=(2, 3))
    assert ((weight - 1).abs() < 1e-5)[dispatched.any(-1).any(-1)].all()  # kept tokens: weights sum to 1
    top1 = gates.argmax(-1)
    first_token_slots = combine[:, 0].sum(-1)  # the first token always fits its top-1 expert
    assert (first_token_slots.gather(-1, top1[:, :1]) > 0).all()


@pytest.mark.parametrize("name", ["gpt-tiny", "moe-tiny", "wresnet-tiny", "mlp-tiny"])
def test_tiny_models_train_on_cpu(name):
    w = load_workload(name, device="cpu")
    inputs, target = w.make_batch(4, torch.Generator().manual_seed(0))
    opt = torch.optim.SGD(w.model.parameters(), lr=0.05)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        loss = w.loss_fn(w.model(*inputs), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]
    assert all(p.grad is not None for p in w.model.parameters())  # every weight, experts included, learns
