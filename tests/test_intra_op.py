"""The intra-op pass rediscovers the layouts people write by hand, where they are optimal."""

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autopar.cost_models import get_cluster
from autopar.planner import rules
from autopar.planner.capture import capture
from autopar.planner.ilp import InfeasibleError
from autopar.planner.intra_op import best_sharding, logical_meshes, shard_stage
from autopar.zoo import gpt, moe

HOST = get_cluster("a100-dgx").with_mesh(1, 8)  # one host of 8 GPUs on NVLink


class TwoLayerMLP(nn.Module):
    def __init__(self, d: int, f: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, f), nn.Linear(f, d)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def mlp_graph(d, f, batch):
    with torch.device("meta"):
        return capture(TwoLayerMLP(d, f), torch.zeros(batch, d, device="meta"))


def forward(result, axis="tp"):
    return [(c["node"], c["kind"]) for c in result.collectives if c["phase"] == "forward" and c["axis"] == axis]


def test_large_weights_small_batch_is_megatron_tensor_parallel():
    best, _, _ = best_sharding(mlp_graph(8192, 32768, 8), HOST, (1, 8))
    assert best.logical_mesh == (1, 8)
    assert best.params["fc1.weight"] == ["R", "S(0)"]  # column-parallel (torch stores [out, in])
    assert best.params["fc2.weight"] == ["R", "S(1)"]  # row-parallel
    assert best.ops["gelu"] == ["R", "S(1)"]  # the hidden activation never leaves its device
    assert forward(best) == [("linear_1", "all_reduce")]  # Megatron's one all-reduce in forward
    # gradient buckets hold what each rank synchronises: its shards, and the replicated fc2 bias whole
    g = mlp_graph(8192, 32768, 8)
    local = sum(t.nbytes / (8 if best.params[f][1] != "R" else 1) for f, t in g.params.items())
    assert best.cost["trainable_bytes"] == local < g.param_bytes / 7


def test_tiny_weights_large_batch_is_data_parallel():
    best, _, _ = best_sharding(mlp_graph(64, 256, 65536), HOST, (1, 8))
    dp, tp = best.logical_mesh
    assert all(p == ["R", "R"] for p in best.params.values())  # every device holds every weight
    for name, (on_dp, on_tp) in best.ops.items():  # and every activation is split by samples
        assert on_dp == ("S(0)" if dp > 1 else "R") and on_tp == ("S(0)" if tp > 1 else "R"), name
    assert not forward(best) and not forward(best, "dp")
    assert {c["kind"] for c in best.collectives} == {"all_reduce"}  # gradients only


def gpt_block_graph():
    cfg = gpt.GPTConfig(vocab=51200, seq=1024, hidden=2048, layers=2, heads=16)
    with torch.device("meta"):
        model = gpt.build(cfg).half()
    return capture(model, (torch.zeros(1, 1024, dtype=torch.long, device="meta"),))


def test_gpt_block_on_tensor_axis_splits_heads_like_megatron():
    graph = gpt_block_graph()
    r = shard_stage(graph, HOST, (1, 8), (1, 8))
    for layer in ("h.0", "h.1"):
        for proj in ("q", "k", "v"):
            assert r.params[f"{layer}.attn.{proj}.weight"] == ["R", "S(0)"]  # QKV column-parallel
        assert r.params[f"{layer}.attn.proj.weight"] == ["R", "S(1)"]  # output row-parallel
        assert r.params[f"{layer}.mlp.fc1.weight"] == ["R", "S(0)"]
        assert r.params[f"{layer}.mlp.fc2.weight"] == ["R", "S(1)"]
    attention = [n for n in graph if n.op == "aten.scaled_dot_product_attention.default"]
    assert all(r.ops[n.name] == ["R", "S(1)"] for n in attention)  # [batch, heads, seq, dim]: by heads
    in_blocks = [c for c in forward(r) if c[1] == "all_reduce" and graph.node(c[0]).layer.startswith("h.")]
    assert len(in_blocks) == 2 * 2  # two per block, as Megatron
    assert r.params["wte.weight"] == ["R", "S(0)"]  # vocabulary-parallel embedding, tied to the output layer


def test_when_activations_bind_the_ilp_finds_megatron_sequence_parallelism():
    """Korthikanti et al. (2022): on the tensor axis, the row-parallel linears' sums reduce-scattered
    along the sequence, the norms and residual adds on 1/tp of the tokens (their activations too),
    all-gathered before the column-parallel linears. Not written as a rule: the free ILP chooses
    it once the memory limit leaves no room for Megatron-LM's replicated norms."""
    from autopar.planner.manual import MEGATRON, MEGATRON_SP

    cfg = gpt.GPTConfig(vocab=51200, seq=2048, hidden=4096, layers=2, heads=32)
    with torch.device("meta"):
        graph = capture(gpt.build(cfg).half(), (torch.zeros(4, 2048, dtype=torch.long, device="meta"),))
    megatron = shard_stage(graph, HOST, (1, 8), (1, 8), rule=MEGATRON)
    # Megatron-LM's embeddings: the vocabulary's split, the positions' whole (a plain nn.Embedding)
    assert megatron.params["wte.weight"] == ["R", "S(0)"] and megatron.params["wpe.weight"] == ["R", "R"]
    sp = shard_stage(graph, HOST, (1, 8), (1, 8), rule=MEGATRON_SP)
    assert sp.memory["activations"] < 0.6 * megatron.memory["activations"]
    # a limit a little under what Megatron-SP needs (the ILP may split the position table, which
    # Megatron-LM keeps whole): room for sequence parallelism, none for replicated norms
    limit = 0.97 * sp.memory["total"]
    assert megatron.memory["total"] > limit
    r = shard_stage(graph, HOST, (1, 8), (1, 8), memory_limit=limit)
    for layer in ("h.0", "h.1"):
        for proj in ("attn.q", "attn.k", "attn.v", "mlp.fc1"):
            assert r.params[f"{layer}.{proj}.weight"] == ["R", "S(0)"]  # column-parallel
        for proj in ("attn.proj", "mlp.fc2"):
            assert r.params[f"{layer}.{proj}.weight"] == ["R", "S(1)"]  # row-parallel
        norms_and_adds = [n.name for n in graph if n.layer == layer
                          and n.op in ("aten.layer_norm.default", "aten.add.Tensor")]
        assert len(norms_and_adds) == 4 and all(r.ops[n] == ["R", "S(1)"] for n in norms_and_adds)  # [b, s, h]
        kinds = [c[1] for c in forward(r) if graph.node(c[0]).layer == layer]
        assert kinds.count("reduce_scatter") == 2 and "all_reduce" not in kinds and "all_gather" in kinds
    assert r.memory["activations"] == pytest.approx(sp.memory["activations"], rel=0.02)


def test_repeated_layers_are_solved_once():
    sizes = []
    for layers in (2, 8):
        cfg = gpt.GPTConfig(vocab=512, seq=64, hidden=256, layers=layers, heads=4)
        with torch.device("meta"):
            g = capture(gpt.build(cfg), (torch.zeros(8, 64, dtype=torch.long, device="meta"),))
        r = shard_stage(g, HOST, (1, 8), (2, 4))
        sizes.append((r.solver["ilp_nodes"], r.solver["variables"], r.solver["anchors"]))
    assert sizes[0][:2] == sizes[1][:2]  # the ILP does not grow with the number of layers
    assert sizes[1][2] > 3 * sizes[0][2] // 2  # while the ops it places do


def test_lower_memory_limit_shards_parameters_then_fails_clearly():
    graph = mlp_graph(4096, 16384, 512)
    free = shard_stage(graph, HOST, (1, 8), (8, 1))
    assert all(p[0] == "R" for p in free.params.values())  # plenty of memory: plain data parallelism
    tight = shard_stage(graph, HOST, (1, 8), (8, 1), memory_limit=free.memory["total"] * 0.9)
    assert any(p[0] == "S(0)" for p in tight.params.values())  # ZeRO-3 where memory needs it
    assert tight.memory["total"] <= free.memory["total"] * 0.9
    assert tight.time > free.time  # and it costs communication
    with pytest.raises(InfeasibleError, match=r"needs \d+\.\d\d GiB per device") as err:
        shard_stage(graph, HOST, (1, 8), (8, 1), memory_limit=free.memory["total"] * 0.05)
    assert err.value.least_memory > free.memory["total"] * 0.05


def test_moe_experts_split_with_all_to_all():
    cfg = moe.MoEConfig(vocab=1024, seq=256, hidden=1024, layers=2, heads=16, experts=8, expert_group=256)
    with torch.device("meta"):
        # tokens enough that exchanging them beats all-reducing every expert's output for all of them
        graph = capture(moe.build(cfg).half(), (torch.zeros(128, 256, dtype=torch.long, device="meta"),))
    r = shard_stage(graph, HOST, (1, 8), (1, 8))
    assert r.params["h.0.mlp.wi"] == ["R", "S(0)"] and r.params["h.0.mlp.wo"] == ["R", "S(0)"]  # by expert
    assert any(c["kind"] == "all_to_all" for c in r.collectives)


class RunningMax(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 64)

    def forward(self, x):
        return self.fc(torch.cummax(self.fc(x), dim=1).values)


def test_unknown_op_runs_replicated_said_once_without_a_warning(caplog):
    """An op without a rule is priced replicated; capture says so once, at info level (only a plan
    whose tensor axis gathers split values for it warns: `tests/test_unruled.py`)."""
    with caplog.at_level(logging.INFO, logger="autopar"):
        graph = capture(RunningMax(), torch.randn(64, 64))
        r = shard_stage(graph, HOST, (1, 8), (1, 8))
        shard_stage(graph, HOST, (1, 8), (2, 4))
    said = [rec for rec in caplog.records if "cummax" in rec.getMessage()]
    assert [rec.levelno for rec in said] == [logging.INFO]
    op = next(n.name for n in graph if n.op == "aten.cummax.default")
    assert r.ops[op][1] == "R"


class ScanOverBatch(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(2048, 8192), nn.Linear(8192, 2048)

    def forward(self, x):
        return self.fc2(torch.cummax(self.fc1(x), dim=0).values)


def test_a_new_op_rule_is_one_decorator(monkeypatch):
    """cummax has no rule, so a column-parallel split cannot pass through it: the plan gathers its
    input whole. One decorated function (the scanned dimension keeps no letter, the others carry
    through) lets the split stay."""
    with torch.device("meta"):  # weights large enough that splitting them pays
        graph = capture(ScanOverBatch(), torch.randn(64, 2048))
    op = next(n.name for n in graph if n.op == "aten.cummax.default")
    assert shard_stage(graph, HOST, (1, 8), (1, 8)).ops[op][1] == "R"
    monkeypatch.setattr(rules, "RULES", dict(rules.RULES))  # the registration ends with the test

    @rules.rule(torch.ops.aten.cummax)
    def _cummax(node, ins, outs):
        kept = "abcdefgh"[: len(ins[0])]
        d = node.args[1] % len(kept)
        out = kept[:d] + kept[d].upper() + kept[d + 1:]
        return rules.Signature([kept], [out, out], rules.FOLLOWER)

    with torch.device("meta"):
        graph = capture(ScanOverBatch(), torch.randn(64, 2048))
    assert shard_stage(graph, HOST, (1, 8), (1, 8)).ops[op][1] == "S(1)"


@pytest.mark.parametrize("name", ["wresnet-tiny", "moe-tiny", "gpt-tiny", "mlp-tiny"])
def test_every_zoo_family_plans_on_every_logical_mesh(name):
    from autopar import load_workload

    w = load_workload(name)
    graph = capture(w.model, w.example_inputs)
    for logical in logical_meshes((1, 4)):
        r = shard_stage(graph, HOST.with_mesh(1, 4), (1, 4), logical)
        assert r.solver["status"] == "optimal" and r.time > 0
        assert set(r.params) == set(graph.params)
        assert all(len(p) == 2 for p in r.ops.values())


class TiedAndViewed(nn.Module):
    """An embedding tied to the output layer, a weight used through .t(), and a follower's bias."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(4096, 1024)
        self.w = nn.Parameter(torch.randn(1024, 1024))
        self.bias = nn.Parameter(torch.zeros(1024))

    def forward(self, idx):
        h = self.emb(idx) @ self.w.t() + self.bias
        return h @ self.emb.weight.t()


def test_tied_weights_views_and_follower_parameters_are_priced():
    with torch.device("meta"):
        graph = capture(TiedAndViewed(), torch.zeros(64, 128, dtype=torch.long, device="meta"))
    for logical in logical_meshes((1, 8)):
        r = shard_stage(graph, HOST, (1, 8), logical)
        assert set(r.params) == {"emb.weight", "w", "bias"}  # the .t() view maps back to w
        states = r.memory["model_states"]
        assert states >= sum(p.nbytes for p in graph.params.values()) * 16 / 4 / 8 * 0.99  # all three stored
        syncs = {(c["node"], c["axis"]) for c in r.collectives if c["phase"] == "gradient" and c["kind"] == "all_reduce"}
        dp, tp = logical
        if tp > 1:
            split_by_batch = [n for n, (on_dp, on_tp) in r.ops.items() if on_tp == "S(0)"]
            if split_by_batch:  # batch split on the tensor axis: every replicated weight reduces its gradient there
                for fqn, (_, on_tp) in r.params.items():
                    if on_tp == "R":
                        users = [n.name for n in graph if fqn in n.params]
                        assert any((u, "tp") in syncs for u in users), fqn


def test_data_axis_must_divide_the_batch():
    graph = mlp_graph(64, 64, 6)
    with pytest.raises(InfeasibleError, match="does not divide the batch"):
        shard_stage(graph, HOST, (1, 8), (8, 1))
    best, results, rejected = best_sharding(graph, HOST, (1, 8))
    assert (8, 1) in rejected and (4, 2) in rejected and best.logical_mesh in ((2, 4), (1, 8))


class Positions(nn.Module):
    """Token and position embeddings, a sequence as long as the batch: then a contrastive product
    of the batch with itself."""

    def __init__(self):
        super().__init__()
        self.tokens, self.positions, self.fc = nn.Embedding(32, 16), nn.Embedding(8, 16), nn.Linear(16, 16)

    def forward(self, ids):
        h = self.fc(self.tokens(ids) + self.positions(torch.arange(ids.shape[1])))
        pooled = h.mean(1)
        return pooled @ pooled.t()


def test_the_batch_dimensions_a_stage_priced_are_the_whole_graphs():
    """Of a stage cut from the graph, a value made before it keeps the batch dimension the whole
    graph gives it: a position index the batch's size (8 positions, 8 samples) is not split by the
    data axis. A product of the batch with itself has two batch dimensions: each data-parallel rank
    holds (8/dp)² of it, and a microbatch a quarter of twice its size."""
    from autopar.planner.stage_graph import Mesh, StageGraph

    graph = capture(Positions(), torch.zeros(8, 8, dtype=torch.long))
    names = [n.name for n in graph]
    positions = next(n for n in names if n.startswith("arange"))
    after = names[names.index(positions) + 1:]
    mesh = Mesh(2, 1, None, None)
    stage = StageGraph(graph.subgraph(after), mesh)
    assert stage.graph.node(positions).op == "input" and stage.batch_of(positions, 0) is None
    product = next(n for n in reversed(names) if graph.node(n).op.startswith("aten.matmul"))
    assert StageGraph(graph, mesh).batch_rank(product) == 2 and StageGraph(graph, mesh).dp_share(product) == 4
