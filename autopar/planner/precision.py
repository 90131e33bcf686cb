"""Mixed precision as the planner prices it: the graph with the dtypes `torch.autocast` gives it.

The runtime trains in mixed precision the way torch's AMP does (`runtime.precision`): parameters,
gradients and optimizer state stay fp32 (the parameters are the master copy), the forward runs
under `torch.autocast`, which computes matmuls in 16 bits and keeps what its op lists say in fp32.
So the planner does not guess which activations are 16-bit: it replays the captured graph under
autocast on fake tensors and rebuilds the graph from the dtypes that come out. What autocast adds
beyond the graph's own tensors is priced from the same replay: each op autocast casts for saves
16-bit copies of its activation inputs (`OpNode.cast_bytes`), and of its weights once per
microbatch (`OpNode.casts`: the weights it reads are copied).

Autocast's op lists differ between devices (CUDA keeps layer norm and softmax in fp32, the CPU
does not); the replay uses this machine's: CUDA's where there is one, else the CPU's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx, nn
from torch.utils._pytree import tree_leaves

from autopar.contract.export import WRAPPER_PREFIX
from autopar.contract.precision import autocast_device, retyped
from autopar.planner.capture import build
from autopar.planner.graph import OpGraph


def with_precision(graph: OpGraph, model: nn.Module, precision: str) -> OpGraph:
    """`graph` as it runs under autocast to `precision` (16-bit outputs where autocast makes them),
    with the same fingerprint: a plan is keyed by the model, its precision is a field of its own."""
    device = autocast_device()
    copy = retyped(graph.fx_graph, precision)
    params = {ph: WRAPPER_PREFIX + fqn for ph, fqn in graph.placeholders.items() if fqn in graph.params}
    buffers = {ph: WRAPPER_PREFIX + fqn for ph, fqn in graph.placeholders.items() if fqn not in graph.params}
    inputs = {n.name for n in graph if n.op == "input"}
    priced = build(copy, model, params, buffers, inputs)
    key = f"Autocast{device.upper()}"
    for node in (n for n in copy.nodes if n.op == "call_function"):
        op = priced.graph.nodes[node.name]["op"] if node.name in priced.graph else None
        if op is None or not isinstance(node.target, torch._ops.OpOverload) \
                or not torch._C._dispatch_has_kernel_for_dispatch_key(node.target.name(), key):
            continue
        out_dtype = _dtype(next((t for t in tree_leaves(node.meta.get("val")) if isinstance(t, torch.Tensor)), None))
        weights = {i for i in _through_views(node) if i.op == "placeholder" and i.name in params}
        op.casts = bool(weights)
        if out_dtype is None:
            continue
        # inputs reached through views of a weight are the weight's copy (`casts`), not an activation's
        op.cast_bytes = sum(_nbytes(i.meta.get("val"), out_dtype) for i in node.all_input_nodes
                            if not weights.intersection(_through_views(i) + [i]) and _dtype(i.meta.get("val"))
                            not in (None, out_dtype) and _dtype(i.meta.get("val")).is_floating_point)
    priced.precision, priced.captured_fingerprint = precision, graph.fingerprint()
    return priced


def _through_views(node: fx.Node) -> list[fx.Node]:
    """The inputs of `node`, looking back through views (a weight reaches `linear` transposed)."""
    found, frontier = [], list(node.all_input_nodes)
    while frontier:
        n = frontier.pop()
        found.append(n)
        if n.op == "call_function" and getattr(n.target, "is_view", False):
            frontier.extend(n.all_input_nodes)
    return found


def _dtype(val: Any) -> torch.dtype | None:
    return val.dtype if isinstance(val, torch.Tensor) else None


def _nbytes(val: Any, dtype: torch.dtype) -> int:
    return val.numel() * dtype.itemsize if isinstance(val, torch.Tensor) else 0
