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
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_leaves, tree_map

from autopar.contract.errors import AutoparError
from autopar.planner.graph import OpGraph

PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16}


def parse_precision(value: str | None) -> str | None:
    """"bf16" / "fp16", or None for training in the model's own dtype ("fp32")."""
    if value is None or value == "fp32":
        return None
    if value not in PRECISIONS:
        raise AutoparError(f"mixed precision must be bf16, fp16 or fp32, got {value!r}")
    return value


def autocast_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def with_precision(graph: OpGraph, model: nn.Module, precision: str) -> OpGraph:
    """`graph` as it runs under autocast to `precision` (16-bit outputs where autocast makes them),
    with the same fingerprint: a plan is keyed by the model, its precision is a field of its own."""
    from autopar.planner.capture import _WRAPPER_PREFIX, _build

    device = autocast_device()
    copy = retyped(graph.fx_graph, precision)
    params = {ph: _WRAPPER_PREFIX + fqn for ph, fqn in graph.placeholders.items() if fqn in graph.params}
    buffers = {ph: _WRAPPER_PREFIX + fqn for ph, fqn in graph.placeholders.items() if fqn not in graph.params}
    inputs = {n.name for n in graph if n.op == "input"}
    priced = _build(copy, model, params, buffers, inputs)
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


def retyped(graph: fx.Graph, precision: str, device: str | None = None) -> fx.Graph:
    """A copy of `graph` whose nodes' `val` are as autocast computes them (fake tensors: no
    memory, no FLOPs); an op the replay cannot run (a higher-order op's body) keeps its captured
    dtype. `device`: whose autocast op lists (default: CUDA's where there is one). The pipeline
    runtime reads what crosses its stage boundaries from it, for its own device."""
    copy = fx.Graph()
    copy.output(copy.graph_copy(graph, {}))
    if graph.owning_module is not None:  # higher-order ops' bodies are its attributes
        fx.GraphModule(graph.owning_module, copy)
    device, dtype = device or autocast_device(), PRECISIONS[precision]
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    values: dict[str, Any] = {}

    def fake(v: Any) -> Any:  # on the autocast device: its kernels are keyed on the device
        return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=device) if isinstance(v, torch.Tensor) else v

    # higher-order ops are not replayed: they set global state (grad mode) that a failed call leaves
    with mode, torch.autocast(device, dtype=dtype), torch.set_grad_enabled(torch.is_grad_enabled()):
        for node in copy.nodes:
            if node.op == "output":
                continue
            val = node.meta.get("val")
            if node.op == "call_function" and not isinstance(node.target, torch._ops.HigherOrderOperator):
                args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: values[n.name])
                try:
                    val = node.target(*args, **kwargs)
                except Exception:  # noqa: BLE001 — the captured dtype stands
                    val = tree_map(fake, val)
            else:
                val = tree_map(fake, val)
            values[node.name] = node.meta["val"] = val
    return copy


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
