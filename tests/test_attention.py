"""Selective recomputation's attention cores (`autopar.contract.attention`) as the planner finds and
prices them: Megatron-LM's core (QKᵀ, scaling, mask, softmax, dropout, the product with V) and
nothing of the projections around it, in hand-written, T5's and fused attention; the activations
it frees and the forward it repeats; offered where it saves memory, refused where a model has none."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from torch import nn

import autopar
from autopar.contract.attention import attention_cores
from autopar.contract.plan import SELECTIVE
from autopar.cost_models import get_cluster
from autopar.planner.capture import capture
from autopar.planner.manual import Layout, check, manual_plan, manual_search
from autopar.planner.search import Search
from tests.families import workload as family


class EagerAttention(nn.Module):
    def __init__(self, hidden: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.out = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]) + mask
        y = self.drop(scores.softmax(-1)) @ v
        return self.out(y.transpose(1, 2).reshape(b, s, h))


def _cores(graph):
    weights = {n for n in graph.fx_graph.nodes if n.name in graph.placeholders and graph.placeholders[n.name] in graph.params}
    return attention_cores([n for n in graph.fx_graph.nodes if n.op == "call_function"], weights)


def test_the_core_of_a_hand_written_attention_is_megatrons():
    graph = capture(EagerAttention().train(), (torch.randn(2, 8, 32), torch.zeros(8, 8)))
    (core,) = _cores(graph)
    assert [n.target.__name__.split(".")[0] for n in core] == ["matmul", "div", "add", "softmax", "dropout", "matmul"]
    assert {n.name for n in graph if n.attention} == {n.name for n in core}
    # the projections stay out; Q, K, V (the qkv projection's output, through views) are what a
    # checkpoint of the core keeps beyond what backward saved already
    assert not any(graph.node(n.name).attention for n in graph.fx_graph.nodes if n.target is torch.ops.aten.linear.default)
    assert graph.node("linear").attention_inputs == {0}


@pytest.mark.parametrize("name, cores, fused", [("t5", 6, False), ("llama", 4, True)])
def test_every_attention_of_a_family_is_one_core(name, cores, fused):
    """T5: the encoder's 2 self-attentions and the decoder's 2 causal and 2 cross-attentions;
    Llama's 4 fused attentions (scaled_dot_product_attention), one op each."""
    torch.manual_seed(0)
    w = family(name)
    graph = capture(w.model, w.example_inputs)
    found = _cores(graph)
    assert len(found) == cores
    assert all(len(core) == 1 for core in found) == fused


def _search(name, world=2, **kwargs):
    torch.manual_seed(0)
    w = family(name) if name in ("t5", "llama") else autopar.load_workload(name, batch=32, device="cpu")
    return Search.start(w, dataclasses.replace(get_cluster("cpu-local"), devices_per_host=world), (1, world), **kwargs)


def test_selective_recomputation_frees_the_cores_activations_for_their_forward():
    """On gpt-small-eager (s = 128, 4 heads: the s² scores outweigh Q, K and V) selective
    recomputation keeps less than keeping everything, more than recomputing whole layers, and
    costs the cores' forward (less than a layer's) in backward."""
    search = _search("gpt-small-eager")
    assert SELECTIVE in search.costs.recomputes
    atoms = search.atoms(0, len(search.layers))
    options = {o.recompute: o for o in search.costs.options(atoms, (1, 2), 4, [(2, 1)]) if not o.lean}
    keep, selective, full = options[False], options[SELECTIVE], options[True]
    assert full.memory(1) < selective.memory(1) < keep.memory(1)
    assert keep.backward_s < selective.backward_s < full.backward_s
    # what backward saves of the cores' ops (matmul's copies of Q and Kᵀ, the probabilities, the
    # product's copy of V: s² tensors), less Q, K and V that the checkpoints keep, per rank and microbatch
    graph = search.graph
    saved = sum(sum(o.nbytes for k, o in enumerate(n.outputs) if k in n.saved_outputs) + n.saved_hidden
                for n in graph if n.attention)
    kept = sum(n.outputs[k].nbytes for n in graph for k in n.attention_inputs)
    assert kept == 4 * 3 * 32 * 128 * 256 * 4  # 4 layers' Q, K and V at the batch of 32
    assert keep.activation_bytes - selective.activation_bytes == pytest.approx((saved - kept) / (2 * 4))


def test_selective_recomputation_is_offered_where_attention_holds_activations():
    """Fused attention keeps only its inputs, output and log-sum-exp: the search does not weigh
    selective recomputation for it, and a hand-written +selective on a model without attention is
    refused with a message."""
    assert SELECTIVE not in _search("llama").costs.recomputes
    assert SELECTIVE in _search("t5").costs.recomputes
    view = manual_search(_search("mlp-tiny"))
    assert "the model has none" in check(view, Layout.parse("2,1,1+selective"))
    plan = manual_plan(manual_search(_search("t5")), Layout.parse("2,1,1,2+selective"))
    assert [s.recompute_granularity for s in plan.stages] == ["selective"]
    assert "recomputing attention (selective)" in plan.summary()
    assert autopar.Plan.from_json(plan.to_json()).stages[0].recompute_granularity == "selective"


@pytest.mark.parametrize("edit", [{"recompute": False, "recompute_granularity": "selective"},
                                  {"recompute": True, "recompute_granularity": "full"}])
def test_a_selective_granularity_without_recomputation_is_refused(edit):
    plan = manual_plan(manual_search(_search("gpt-small-eager")), Layout.parse("2,1,1,2"))
    data = plan.to_dict()
    data["stages"][0] |= edit
    with pytest.raises(autopar.AutoparError, match=r"stages\[0\]\.recompute_granularity must be \"selective\""):
        autopar.Plan.from_json(json.dumps(data))
