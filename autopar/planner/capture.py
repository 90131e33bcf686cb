"""Capture a model into an `OpGraph` with `torch.export` (non-strict).

`torch.export` gives a torch.fx graph of aten ops with shapes (`node.meta["val"]`) and module
paths (`node.meta["nn_module_stack"]`), and works where `torch.fx.symbolic_trace` does not
(Hugging Face models). The model is wrapped so that whatever it returns (a tensor, a tuple, a
`ModelOutput` with `logits`) the graph has one tensor output. Real, fake and `meta` tensors all
work: planning never needs real weights.
"""

from __future__ import annotations

import logging
import operator
from typing import Any

import networkx as nx
import torch
from torch import fx, nn
from torch.utils._pytree import tree_leaves

from autopar.contract.attention import attention_cores, base, core_inputs, is_view
from autopar.contract.export import WRAPPER_PREFIX, differentiated, export_program
from autopar.contract.inputs import as_args
from autopar.planner.flops import FlopCounter
from autopar.planner.graph import OpGraph, OpNode, TensorInfo
from autopar.planner.replicate import capture_replicated
from autopar.planner.saved import saved_outputs
from autopar.planner.unruled import summary

log = logging.getLogger(__name__)


def capture(model: nn.Module, example_inputs: Any, *, replicate: bool = True) -> OpGraph:
    """Export `model` on `example_inputs` (a tuple of positional inputs, a dict of keyword inputs or
    one tensor: `autopar.contract.inputs`) and annotate every op with its costs.

    With `replicate`, a model whose blocks repeat (GPT-3's 96 identical layers) is exported with
    three periods of blocks and the rest is copied from the last one (`autopar.planner.replicate`): the
    same graph, node names included, at a fraction of the tracing time.
    """
    args = as_args(model.forward, example_inputs, "example_inputs")
    if replicate:
        graph = capture_replicated(model, lambda m: export_program(m, args), build)
        if graph is not None:
            return graph
    exported = export_program(model, args)
    sig = exported.graph_signature
    return build(exported.graph, model, sig.inputs_to_parameters, sig.inputs_to_buffers, set(sig.user_inputs))


def build(
    fx_graph: fx.Graph, model: nn.Module, to_param: dict[str, str], to_buffer: dict[str, str], user_inputs: set[str]
) -> OpGraph:
    """OpGraph of an exported aten graph; `to_param` / `to_buffer` map placeholders to the
    wrapper's FQNs (``inner.h.0.attn.q.weight``)."""
    canonical = _canonical_names(model)
    param_of = {ph: canonical.get(fqn, _strip(fqn)) for ph, fqn in to_param.items()}
    buffer_of = {ph: _strip(fqn) for ph, fqn in to_buffer.items()}
    lists = {name for name, m in model.named_modules() if isinstance(m, nn.ModuleList)}
    counter = FlopCounter()
    graph = nx.DiGraph()
    params: dict[str, TensorInfo] = {}
    buffers: dict[str, TensorInfo] = {}
    needs_grad = differentiated(fx_graph, {ph for ph, fqn in param_of.items() if model.get_parameter(fqn).requires_grad})
    for node in fx_graph.nodes:
        if node.op == "placeholder":
            info = _infos(node.meta.get("val"))
            if node.name in param_of:
                params[param_of[node.name]] = info[0]
            elif node.name in buffer_of:
                buffers[buffer_of[node.name]] = info[0]
            elif node.name in user_inputs:
                graph.add_node(node.name, op=OpNode(name=node.name, op="input", outputs=info))
        elif node.op == "call_function":
            op = _op_node(node, counter, needs_grad, lists)
            graph.add_node(node.name, op=op)
            for src in node.all_input_nodes:
                if src.name in graph:
                    graph.add_edge(src.name, node.name, bytes=_consumed_bytes(src, node))
    saved = saved_outputs(fx_graph, needs_grad)
    if saved is not None:
        for name in graph.nodes:
            op = graph.nodes[name]["op"]
            op.saved_outputs, op.saved_hidden, op.saved_by = saved.get(name, (frozenset(), 0, frozenset()))
    _mark_attention(fx_graph, graph, set(param_of))
    _attribute(fx_graph, graph, param_of, params, "params")
    _attribute(fx_graph, graph, buffer_of, buffers, "buffers")
    _fill_layers(graph)
    outputs = [a.name for a in tree_leaves(next(iter(fx_graph.find_nodes(op="output"))).args) if isinstance(a, fx.Node)]
    warnings = [f"FLOPs of {op} not counted: {why}" for op, why in counter.failures.items()]
    trainable = {param_of[ph] for ph in needs_grad if ph in param_of}
    captured = OpGraph(graph, params=params, buffers=buffers, outputs=outputs, warnings=warnings, fx_graph=fx_graph,
                       placeholders={**param_of, **buffer_of}, trainable=trainable)
    note = summary(captured)
    if note:
        log.info("%s: %s", type(model).__name__, note)
    return captured


def _mark_attention(fx_graph: fx.Graph, graph: nx.DiGraph, weights: set[str]) -> None:
    """Flag the ops of each attention core, and the outputs of others that a checkpoint of a core
    would keep beyond what backward saves already (its inputs, through views to their producers)."""
    nodes = [n for n in fx_graph.nodes if n.op == "call_function"]
    for core in attention_cores(nodes, {n for n in fx_graph.nodes if n.name in weights}):
        for node in core:
            graph.nodes[node.name]["op"].attention = True
        for value in core_inputs(core):
            producer, k = base(value)
            if not isinstance(producer, fx.Node) or producer.name not in graph or producer.op != "call_function":
                continue  # a model input, parameter or constant: not an activation
            op = graph.nodes[producer.name]["op"]
            if op.saved_outputs is not None and k not in op.saved_outputs:
                op.attention_inputs = op.attention_inputs | {k}


def _op_node(
    node: fx.Node, counter: FlopCounter, needs_grad: set[str], lists: set[str]
) -> OpNode:
    target = node.target
    view = is_view(node)
    val_of = {n.name: n.meta.get("val") for n in node.all_input_nodes}
    grad_of = {id(val_of[n.name]) for n in node.all_input_nodes if n.name in needs_grad}
    out_infos = _infos(node.meta.get("val"))
    in_infos = tuple(i for n in node.all_input_nodes for i in _infos(val_of[n.name]))
    flops = (0.0, 0.0)
    if not view and isinstance(target, torch._ops.OpOverload):
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: val_of[n.name])
        flops = counter.count(target, args, kwargs, grad_of)
    elif isinstance(target, torch._ops.HigherOrderOperator):
        flops = _body_flops(node, counter, bool(grad_of))
    mod_path, layer = _module_path(node, lists)
    return OpNode(
        name=node.name,
        op=_op_name(target),
        inputs=in_infos,
        outputs=out_infos,
        flops_fwd=flops[0],
        flops_bwd=flops[1],
        bytes_read=0 if view else _bytes_read(target, in_infos, out_infos),
        bytes_written=0 if view else sum(o.nbytes for o in out_infos),
        module_path=mod_path,
        layer=layer,
        is_view=view,
        requires_grad=node.name in needs_grad,
    )


def _body_flops(node: fx.Node, counter: FlopCounter, grad: bool) -> tuple[float, float]:
    """FLOPs of a higher-order op's bodies (an autocast region, `cond`'s branches, a nested
    compile region), op by op; of `cond`'s branches the dearer. With `grad`, every floating-point
    input of a body needs gradients (the op's parameters mostly do)."""
    root = node.graph.owning_module
    bodies = [operator.attrgetter(a.target)(root) for a in tree_leaves((node.args, node.kwargs))
              if isinstance(a, fx.Node) and a.op == "get_attr"]
    per_body = []
    for body in bodies:
        if not isinstance(body, fx.GraphModule):
            continue
        total, needs = [0.0, 0.0], set()
        for inner in body.graph.nodes:
            val = inner.meta.get("val")
            if inner.op == "placeholder" and grad and isinstance(val, torch.Tensor) and val.is_floating_point():
                needs.add(inner.name)
            if inner.op != "call_function":
                continue
            if any(i.name in needs for i in inner.all_input_nodes):
                needs.add(inner.name)
            grad_of = {id(i.meta.get("val")) for i in inner.all_input_nodes if i.name in needs}
            if isinstance(inner.target, torch._ops.OpOverload) and not getattr(inner.target, "is_view", False):
                args, kwargs = fx.node.map_arg((inner.args, inner.kwargs), lambda n: n.meta.get("val"))
                f = counter.count(inner.target, args, kwargs, grad_of)
            elif isinstance(inner.target, torch._ops.HigherOrderOperator):
                f = _body_flops(inner, counter, bool(grad_of))
            else:
                continue
            total = [total[0] + f[0], total[1] + f[1]]
        per_body.append(tuple(total))
    if not per_body:
        return 0.0, 0.0
    if node.target is torch.ops.higher_order.cond:
        return max(per_body)
    return tuple(map(sum, zip(*per_body)))


_GATHERS = {"aten.embedding.default", "aten.index_select.default", "aten.gather.default", "aten.index.Tensor"}


def _bytes_read(target: Any, inputs: tuple[TensorInfo, ...], outputs: tuple[TensorInfo, ...]) -> int:
    """Gathers read the rows they return (and the indices), not the whole table."""
    if _op_name(target) in _GATHERS:
        return sum(i.nbytes for i in inputs[1:]) + sum(o.nbytes for o in outputs)
    return sum(i.nbytes for i in inputs)


def _infos(val: Any) -> tuple[TensorInfo, ...]:
    return tuple(
        TensorInfo(tuple(int(s) for s in t.shape), str(t.dtype).removeprefix("torch."), t.numel() * t.element_size())
        for t in tree_leaves(val)
        if isinstance(t, torch.Tensor)
    )


def _consumed_bytes(src: fx.Node, dst: fx.Node) -> int:
    """Bytes of `src`'s output that `dst` reads (one element when it picks from a tuple)."""
    val = src.meta.get("val")
    if dst.target is operator.getitem and isinstance(val, (tuple, list)):
        val = val[dst.args[1]]
    return sum(t.nbytes for t in _infos(val))


def _op_name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    return getattr(target, "__name__", str(target))


def _strip(path: str) -> str:
    if path == WRAPPER_PREFIX[:-1]:
        return ""
    return path.removeprefix(WRAPPER_PREFIX)


def _module_path(node: fx.Node, lists: set[str]) -> tuple[str, str]:
    """Innermost module path and its layer hint.

    The hint is the path up to the first ModuleList index ("h.3", "model.layers.3"); outside
    the repeated blocks it is the child of the module that holds them ("wte", "transformer.ln_f",
    "stem").
    """
    stack = node.meta.get("nn_module_stack") or {}
    path = _strip(list(stack.values())[-1][0]) if stack else ""
    parts = path.split(".") if path else []
    for i, part in enumerate(parts):
        if part.isdigit() and ".".join(parts[:i]) in lists:
            return path, ".".join(parts[: i + 1])
    all_holders = {lst.rpartition(".")[0] for lst in lists} | {""}
    if any(h == path or h.startswith(path + ".") for h in all_holders if path):
        return path, ""  # code of a module that holds the blocks: joins its neighbours (_fill_layers)
    holders = [h for h in all_holders if not h or path.startswith(h + ".")]
    depth = max(len(h.split(".")) if h else 0 for h in holders)
    return path, ".".join(parts[: depth + 1])


def _fill_layers(graph: nx.DiGraph) -> None:
    """Ops outside any submodule (the root's own code) join the layer before them, or after."""
    ops = [graph.nodes[n]["op"] for n in graph.nodes if graph.nodes[n]["op"].op != "input"]
    previous = next((op.layer for op in ops if op.layer), "")
    for op in ops:
        if op.layer:
            previous = op.layer
        else:
            op.layer = previous


def _canonical_names(model: nn.Module) -> dict[str, str]:
    """Every name a parameter is reachable by (tied weights have several) -> its named_parameters() name."""
    first = {id(p): name for name, p in model.named_parameters()}
    return {
        WRAPPER_PREFIX + name: first[id(p)]
        for name, p in model.named_parameters(remove_duplicate=False)
    }


def _attribute(fx_graph: fx.Graph, graph: nx.DiGraph, name_of: dict, infos: dict, field: str) -> None:
    """A parameter (or buffer) belongs to the ops that compute with it, looking through views."""
    for ph in fx_graph.find_nodes(op="placeholder"):
        if ph.name not in name_of:
            continue
        fqn = name_of[ph.name]
        frontier = list(ph.users)
        while frontier:
            user = frontier.pop()
            if user.name not in graph:
                continue
            op = graph.nodes[user.name]["op"]
            if op.is_view:
                frontier.extend(user.users)
            else:
                getattr(op, field)[fqn] = infos[fqn].nbytes
