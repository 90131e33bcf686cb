"""Ops read as einsums: the letters decide which placements can pass through an op."""

import torch
import torch.nn.functional as F
from torch import nn

from autopar.planner.capture import capture
from autopar.planner.rules import ANCHOR, FOLLOWER, UNKNOWN, signature


def signatures(fn, *inputs):
    class M(nn.Module):
        def forward(self, *xs):
            return fn(*xs)

    graph = capture(M(), inputs)
    return {str(n.target): signature(n) for n in graph.fx_graph.nodes if n.op == "call_function"}


def one(fn, op, *inputs):
    return signatures(fn, *inputs)[op]


def test_reshape_keeps_the_outer_letter_of_merged_and_split_dims():
    s = one(lambda x: x.reshape(6, 4), "aten.reshape.default", torch.randn(2, 3, 4))
    assert s.kind == FOLLOWER and s.view
    a = s.inputs[0]
    assert s.outputs[0][0] == a[0] and s.outputs[0][1] == a[2]  # (2,3)->6 keeps dim 0's letter; 4 stays
    s = one(lambda x: x.view(2, 3, 2, 2), "aten.view.default", torch.randn(2, 3, 4))
    assert s.outputs[0][:3] == s.inputs[0] and s.outputs[0][3] not in s.inputs[0]  # heads split: outer part


def test_permutes_and_transposes():
    s = one(lambda x: x.transpose(1, 2), "aten.transpose.int", torch.randn(2, 3, 4))
    assert s.outputs[0] == s.inputs[0][0] + s.inputs[0][2] + s.inputs[0][1]
    s = one(lambda x: x.permute(2, 0, 1), "aten.permute.default", torch.randn(2, 3, 4))
    assert s.outputs[0] == s.inputs[0][2] + s.inputs[0][0] + s.inputs[0][1]


def test_unsqueeze_select_expand_unbind_keep_their_dims():
    x = torch.randn(2, 3, 4)
    s = one(lambda t: t.unsqueeze(1), "aten.unsqueeze.default", x)
    assert s.outputs[0][0] == "a" and s.outputs[0][2:] == "bc"
    s = one(lambda t: t.select(1, 0), "aten.select.int", x)
    assert s.outputs[0] == "ac"
    s = one(lambda t: t.unbind(1)[0], "aten.unbind.int", x)
    assert s.outputs[0] == "ac"
    s = one(lambda t: t[:, :1].expand(2, 5, 4), "aten.expand.default", x)
    assert s.outputs[0][0] == s.inputs[0][0] and s.outputs[0][2] == s.inputs[0][2]
    assert s.outputs[0][1] not in s.inputs[0]  # the broadcast dim is new


def test_reductions_drop_or_keep_the_reduced_dim():
    x = torch.randn(2, 3, 4)
    s = one(lambda t: t.var(-1), "aten.var.dim", x)
    assert s.outputs[0] == "ab" and not s.linear
    s = one(lambda t: t.sum(1, keepdim=True), "aten.sum.dim_IntList", x)
    assert s.outputs[0][0] == "a" and s.outputs[0][2] == "c" and s.outputs[0][1] != "b" and s.linear


def test_matmul_family():
    s = one(lambda x, w: F.linear(x, w), "aten.linear.default", torch.randn(2, 3, 4), torch.randn(5, 4))
    assert s.kind == ANCHOR and s.linear
    x, w = s.inputs
    assert x[-1] == w[1] and s.outputs[0] == x[:-1] + w[0]  # contract k, keep n
    s = one(torch.bmm, "aten.bmm.default", torch.randn(2, 3, 4), torch.randn(2, 4, 5))
    assert s.inputs == ["bmk", "bkn"] and s.outputs == ["bmn"]
    s = one(torch.matmul, "aten.matmul.default", torch.randn(6, 2, 3, 4), torch.randn(4, 5))
    assert s.outputs[0][-2:] == "mn" and s.inputs[1] == "kn"
    s = one(torch.matmul, "aten.matmul.default", torch.randn(2, 3, 4), torch.randn(4))
    assert s.kind == UNKNOWN  # matrix-vector: no rule, replicated
    s = one(lambda a, b: torch.einsum("gsm,me->gse", a, b), "aten.einsum.default", torch.randn(2, 3, 4), torch.randn(4, 5))
    assert s.inputs == ["gsm", "me"] and s.outputs == ["gse"] and s.shardable == set("gsme")


def test_anchors_that_cannot_split_their_reduced_dims():
    s = one(lambda x: F.layer_norm(x, (4,)), "aten.layer_norm.default", torch.randn(2, 3, 4))
    assert s.shardable == {"a", "b"}
    s = one(lambda x: F.softmax(x, -1), "aten.softmax.int", torch.randn(2, 3, 4))
    assert s.shardable == {"a", "b"}
    q, k, v = (torch.randn(2, 4, 8, 16) for _ in range(3))
    s = one(F.scaled_dot_product_attention, "aten.scaled_dot_product_attention.default", q, k, v)
    assert s.shardable == {"b", "h"} and s.outputs[0][:2] == "bh"


def test_conv_and_embedding():
    s = one(lambda x, w: F.conv2d(x, w), "aten.conv2d.default", torch.randn(2, 3, 8, 8), torch.randn(6, 3, 3, 3))
    assert s.inputs[0][:2] == "bc" and s.inputs[1][:2] == "oc" and s.outputs[0][:2] == "bo"
    s = one(F.embedding, "aten.embedding.default", torch.zeros(2, 5, dtype=torch.long), torch.randn(10, 4))
    assert s.inputs[0] == "vh" and s.outputs[0] == s.inputs[1] + "h" and s.linear  # vocab split gives P


def test_pointwise_broadcast_gets_fresh_letters():
    s = one(lambda x, y: x + y, "aten.add.Tensor", torch.randn(2, 3, 4), torch.randn(3, 1))
    assert s.inputs[0] == "abc" and s.inputs[1][0] == "b" and s.inputs[1][1] not in "abc"


def test_type_as_reads_only_the_other_tensors_dtype():
    """`x.type_as(other)` follows x; `other` needs no placement (Gemma3's q/k norms: the plan priced
    gathering it, which no program does)."""
    s = one(lambda x, y: x.type_as(y), "aten.type_as.default", torch.randn(2, 3), torch.randn(2, 3))
    assert s.kind == FOLLOWER and s.inputs == [s.outputs[0], None]


def test_gathers_pads_rolls_and_pools_carry_the_dims_they_keep():
    """The ops between an embedding and its batch in unseen families (RoBERTa's token types gather
    a buffer at each sample's positions; Swin pads, rolls and pools in 1-d; CLIP picks each text's
    end token): without a rule the batch dimension stops there, and the plan prices the tensors
    after it whole."""
    x = torch.randn(4, 6, 8)
    s = one(lambda t, i: t.gather(1, i), "aten.gather.default", x, torch.zeros(4, 2, 8, dtype=torch.long))
    assert s.kind == FOLLOWER and s.outputs[0] == s.inputs[1] == "abc"
    assert s.inputs[0][0] == "a" and s.inputs[0][1] not in "abc" and s.inputs[0][2] == "c"  # gathered along dim 1
    s = one(lambda t: F.pad(t, (0, 2)), "aten.pad.default", x)
    assert s.outputs[0][:2] == "ab" and s.outputs[0][2] not in "abc"
    s = one(lambda t: t.roll(1, dims=2), "aten.roll.default", x)
    assert s.outputs[0][:2] == "ab" and s.outputs[0][2] not in "abc"
    s = one(lambda t: F.adaptive_avg_pool1d(t, 1), "aten.adaptive_avg_pool1d.default", x)
    assert s.outputs[0][:2] == "ab" and s.outputs[0][2] not in "abc"
    s = one(lambda t, i: t[torch.arange(4), i], "aten.index.Tensor", x, torch.zeros(4, dtype=torch.long))
    index = s.inputs[2]  # (x, arange, i)
    assert s.outputs[0][0] == index == "a" and s.outputs[0][1] not in s.inputs[0]


def test_grouped_convolutions_repeats_and_inplace_dropout_carry_the_batch():
    """ConvNeXt's and MobileNet's depthwise convolutions carry the batch (only the batch: a channel
    split would change each rank's groups); DeBERTa tiles its relative positions with `repeat`
    (a dim repeated once carries through); MobileNet drops out in place."""
    s = one(lambda x, w: F.conv2d(x, w, groups=4), "aten.conv2d.default", torch.randn(2, 4, 6, 6), torch.randn(4, 1, 3, 3))
    assert s.kind == ANCHOR and s.shardable == {"b"} and s.outputs[0][:2] == "bo" and s.inputs[0][1] != "o"
    s = one(lambda x: x.repeat(3, 1, 1), "aten.repeat.default", torch.randn(2, 5, 4))
    assert s.outputs[0][0] not in s.inputs[0] and s.outputs[0][1:] == s.inputs[0][1:]
    s = one(lambda x: F.dropout(x, 0.0, True, inplace=True) * 1, "aten.dropout_.default", torch.randn(2, 3))
    assert s.kind == FOLLOWER and s.outputs[0] == s.inputs[0]
