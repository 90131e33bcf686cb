"""The precisions a plan may name, and the graph as `torch.autocast` types it: the planner prices
those dtypes (`autopar.planner.precision`), the pipeline runtime sends them between stages."""

from __future__ import annotations

from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map

from autopar.contract.errors import AutoparError

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
