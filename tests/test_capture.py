"""capture(): shapes, FLOPs, bytes, parameters and module paths of the exported graph."""


import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from autopar import CaptureError, capture, load_workload
from autopar.zoo import ZOO


def flop_counter_total(model, inputs, backward):
    with FlopCounterMode(display=False) as counter:
        out = model(*inputs)
        if backward:
            out.float().sum().backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("name", ["gpt-tiny", "moe-tiny", "wresnet-tiny", "mlp-tiny"])
def test_flops_match_torch_flop_counter(name):
    w = load_workload(name)  # meta: torch's counter has formulas for meta attention
    graph = capture(w.model, w.example_inputs)
    assert graph.flops_fwd > 0
    assert graph.flops_fwd == pytest.approx(flop_counter_total(w.model, w.example_inputs, False), rel=1e-6)
    total = flop_counter_total(w.model, w.example_inputs, True)
    assert graph.flops_fwd + graph.flops_bwd == pytest.approx(total, rel=1e-6)


def test_real_meta_and_fake_tensors_give_the_same_graph():
    graphs = []
    for device in ("cpu", "meta"):
        w = load_workload("gpt-tiny", device=device)
        graphs.append(capture(w.model, w.example_inputs))
    with FakeTensorMode():
        w = load_workload("gpt-tiny", device="cpu")
        graphs.append(capture(w.model, w.example_inputs))
    real, meta, fake = graphs
    assert real.fingerprint() == meta.fingerprint() == fake.fingerprint()
    # FLOPs do not depend on the device: CPU attention is counted through its meta replay
    assert real.flops_fwd == meta.flops_fwd == fake.flops_fwd
    assert real.flops_bwd == meta.flops_bwd


def test_nodes_carry_shapes_bytes_params_and_module_paths(gpt_tiny_graph):
    w, graph = gpt_tiny_graph
    cfg = ZOO["gpt-tiny"].config
    fc1 = next(n for n in graph if n.module_path == "h.0.mlp.fc1")
    assert fc1.op == "aten.linear.default"
    assert fc1.layer == "h.0"
    tokens = w.batch * cfg.seq
    assert fc1.outputs[0].shape == (w.batch, cfg.seq, 4 * cfg.hidden)
    assert fc1.outputs[0].dtype == "float32"
    assert fc1.params == {"h.0.mlp.fc1.weight": 4 * cfg.hidden * cfg.hidden * 4, "h.0.mlp.fc1.bias": 4 * cfg.hidden * 4}
    assert fc1.flops_fwd == 2 * tokens * cfg.hidden * 4 * cfg.hidden
    assert fc1.flops_bwd == 2 * fc1.flops_fwd  # input and weight gradients
    assert fc1.bytes_written == tokens * 4 * cfg.hidden * 4
    assert fc1.bytes_read == tokens * cfg.hidden * 4 + sum(fc1.params.values())
    assert fc1.requires_grad


def test_parameters_use_named_parameters_names_and_tied_weight_is_shared(gpt_tiny_graph):
    w, graph = gpt_tiny_graph
    assert set(graph.params) == {name for name, _ in w.model.named_parameters()}
    assert graph.num_params == sum(p.numel() for p in w.model.parameters())
    users = [n.name for n in graph if "wte.weight" in n.params]
    assert len(users) == 2  # the input embedding and the tied output projection
    assert {graph.node(u).module_path for u in users} == {"wte", "lm_head"}


def test_edges_carry_consumed_tensor_bytes(gpt_tiny_graph):
    _, graph = gpt_tiny_graph
    for src, dst, nbytes in graph.edges():
        producer, consumer = graph.node(src), graph.node(dst)
        if consumer.op == "getitem":
            assert nbytes in [t.nbytes for t in producer.outputs]
        else:
            assert nbytes == producer.output_bytes
    assert graph.node("idx").op == "input"
    assert any(src == "idx" for src, _, _ in graph.edges())


def test_views_move_no_bytes_and_layers_partition_the_graph(gpt_tiny_graph):
    _, graph = gpt_tiny_graph
    views = [n for n in graph if n.is_view]
    assert views and all(n.bytes_read == n.bytes_written == n.flops_fwd == 0 for n in views)
    layers = graph.layers()
    assert [layer.name for layer in layers] == ["wte", "wpe", "h.0", "h.1", "ln_f", "lm_head"]
    assert sum(len(layer.nodes) for layer in layers) == len(graph)
    assert sum(layer.param_bytes for layer in layers) == graph.param_bytes
    assert sum(layer.flops_fwd for layer in layers) == graph.flops_fwd


def test_first_layer_input_needs_no_gradient():
    w = load_workload("mlp-tiny")
    graph = capture(w.model, w.example_inputs)
    first = next(n for n in graph if n.module_path == "layers.0.fc")
    assert first.flops_bwd == first.flops_fwd  # weight gradient only: the input is data


class _Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow
            return self.fc(x)
        return x


def test_data_dependent_control_flow_is_a_clear_error():
    with pytest.raises(CaptureError) as err:
        capture(_Branchy(), (torch.randn(2, 4),))
    message = str(err.value)
    assert "cannot capture _Branchy" in message
    assert "test_capture.py" in message and "x.sum() > 0" in message
    assert "hint:" in message


class _DictOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return {"aux": None, "logits": self.fc(x)}


def test_non_tensor_outputs_are_unwrapped():
    graph = capture(_DictOut(), torch.randn(2, 4))
    assert graph.num_params == 15
    assert graph.node(graph.outputs[0]).op == "aten.linear.default"


def test_frozen_parameters_get_no_backward_flops():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    model[0].requires_grad_(False)
    graph = capture(model, torch.randn(4, 8))
    first, last = [n for n in graph if n.op == "aten.linear.default"]
    assert first.flops_bwd == 0 and not first.requires_grad
    assert last.flops_bwd == last.flops_fwd  # weight gradient only: nothing before it learns


def test_embedding_reads_rows_not_the_table(gpt_tiny_graph):
    w, graph = gpt_tiny_graph
    emb = next(n for n in graph if n.module_path == "wte")
    ids, rows = w.example_inputs[0], emb.outputs[0]
    assert emb.bytes_read == ids.numel() * 8 + rows.nbytes
    assert emb.params == {"wte.weight": 512 * 64 * 4}


class _Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("mask", torch.ones(4, 4))

    def forward(self, x):
        return x @ self.mask.t()


def test_buffers_belong_to_the_op_that_computes_with_them():
    graph = capture(_Masked(), torch.randn(2, 4))
    users = [n for n in graph if n.buffers]
    assert [n.op for n in users] == ["aten.matmul.default"] and users[0].buffers == {"mask": 64}


def test_shape_errors_are_reported_without_a_misleading_hint():
    with pytest.raises(CaptureError) as err:
        capture(nn.Linear(4, 2), torch.randn(2, 3))
    assert "cannot capture Linear" in str(err.value) and "hint" not in str(err.value)


def _graph_record(graph):
    """Everything a pass reads from a captured graph, node names and fx arguments included."""
    nodes = []
    for n in graph:
        fx_node = graph.fx_nodes.get(n.name)
        args = repr(torch.fx.node.map_arg((fx_node.args, fx_node.kwargs), lambda a: a.name)) if fx_node else ""
        nodes.append((n, args))
    return (nodes, sorted(graph.edges()), graph.outputs, graph.params, graph.buffers, graph.placeholders,
            graph.trainable, graph.fingerprint())


def _hf_gpt2(layers):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=layers, n_embd=64, n_head=4, vocab_size=256, n_positions=64,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg), (torch.randint(0, 256, (2, 16)),)


def _zoo(kind, **cfg):
    from autopar.zoo import gpt, moe

    module = {"gpt": gpt, "moe": moe}[kind]
    config = (moe.MoEConfig if kind == "moe" else gpt.GPTConfig)(vocab=512, seq=32, hidden=64, heads=4, **cfg)
    model = module.build(config).to("meta")
    return model, module.example_inputs(config, 8, "meta")


@pytest.mark.parametrize("make", [
    lambda: _zoo("gpt", layers=6),
    lambda: _zoo("moe", layers=10, experts=4, expert_group=64, ffn_mult=2),  # dense / MoE blocks: period 2
    lambda: _hf_gpt2(5),  # blocks hold their own layer_idx
], ids=["gpt", "moe", "hf-gpt2"])
def test_repeated_blocks_are_copied_into_the_graph_a_full_export_gives(make):
    from autopar.planner.replicate import find_repeat

    model, inputs = make()
    assert find_repeat(model) is not None
    assert _graph_record(capture(model, inputs)) == _graph_record(capture(model, inputs, replicate=False))


def test_blocks_that_differ_are_all_exported():
    from autopar.planner.replicate import find_repeat

    model, inputs = _zoo("gpt", layers=6)
    model.h[4].attn.scale_by = 0.5  # an attribute the forward could read: blocks no longer repeat
    assert find_repeat(model) is None
    assert len(capture(model, inputs).layer_list) == len(capture(model, inputs, replicate=False).layer_list)


def test_a_forward_that_counts_its_blocks_itself_still_captures_every_block():
    class Counted(nn.Module):
        def __init__(self):
            super().__init__()
            self.n = 8
            self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(self.n))

        def forward(self, x):
            for i in range(self.n):  # fails on a shortened list: capture exports every block
                x = self.blocks[i](x).relu()
            return x

    graph = capture(Counted(), (torch.randn(4, 16),))
    assert {layer.name for layer in graph.layer_list} == {f"blocks.{i}" for i in range(8)}
