"""Which tensors backward keeps: the activations a stage holds per microbatch in flight.

Counting every op's output as an activation overstates them (a Llama block's RMSNorm computes
squares, means and casts that backward never reads: measured, half of what that count says). So
the captured graph is replayed once on fake tensors (no memory, no FLOPs) with autograd on and a
saved-tensor hook, and each op records which of its outputs backward saves (directly or through a
view) and how many bytes it saves that are no op's output (what a composite op such as attention
keeps inside). Parameters and inputs are not activations.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_leaves, tree_map


def saved_outputs(graph: fx.Graph, trainable: set[str]
                  ) -> dict[str, tuple[frozenset[int], int, frozenset[str]]] | None:
    """node name -> (indices of its outputs backward saves, bytes it saves beyond them, the ops
    whose backward saves its outputs, or the storage they view); None when the replay fails (the
    caller counts every output then). `trainable`: the placeholders that require gradients. A
    saved view counts as its base, once, for the op that made the base. Who saves a value says what
    a recomputed layer must compute again for its own backward (`StageCosts.recomputed`)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    made: dict[int, tuple[str, int]] = {}  # id of a tensor an op made -> (node, output index)
    keep: list[Any] = []  # every value stays alive: ids must not be reused during the replay
    out: dict[str, tuple[set[int], int]] = {}
    savers: dict[str, set[str]] = {}
    maker: dict[str, str] = {}  # an op whose output views another op's -> that op
    current: list[str | None] = [None]
    placeholders: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        node = current[0]
        if id(base) in made:
            name, index = made[id(base)]
            out.setdefault(name, (set(), 0))[0].add(index)
            if node is not None:
                savers.setdefault(name, set()).add(node)
        elif id(base) not in placeholders and node is not None:
            indices, hidden = out.setdefault(node, (set(), 0))
            out[node] = (indices, hidden + t.numel() * t.element_size())
        return t

    def fake(v: Any, grad: bool) -> Any:
        if not isinstance(v, torch.Tensor):
            return v
        t = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="cpu")
        return t.requires_grad_(grad and t.is_floating_point())

    try:
        with mode, torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            values: dict[str, Any] = {}
            for node in graph.nodes:
                if node.op == "placeholder":
                    values[node.name] = tree_map(lambda v: fake(v, node.name in trainable), node.meta.get("val"))
                    placeholders.update(id(t) for t in tree_leaves(values[node.name]) if isinstance(t, torch.Tensor))
                elif node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator):
                    # a body the replay does not enter (a rotary table's no-grad block): what it
                    # returns counts as kept
                    grad = any(getattr(t, "requires_grad", False) for i in node.all_input_nodes
                               for t in tree_leaves(values.get(i.name)))
                    values[node.name] = tree_map(lambda v: fake(v, grad), node.meta.get("val"))
                    count = sum(1 for t in tree_leaves(values[node.name]) if isinstance(t, torch.Tensor))
                    out[node.name] = (set(range(count)), 0)
                elif node.op == "call_function":
                    current[0] = node.name
                    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: values[n.name])
                    values[node.name] = node.target(*args, **kwargs)
                    for i, t in enumerate(x for x in tree_leaves(values[node.name]) if isinstance(x, torch.Tensor)):
                        base = t._base if t._base is not None else t
                        made.setdefault(id(base), (node.name, i))
                        if made[id(base)][0] != node.name:
                            maker.setdefault(node.name, made[id(base)][0])
                keep.append(values.get(node.name))
    except Exception:  # noqa: BLE001 — an op fake tensors cannot run: every output counts, as before
        return None
    return {name: (frozenset(out.get(name, ((), 0))[0]), out.get(name, ((), 0))[1],
                   frozenset(savers.get(name, set()) | savers.get(maker.get(name, ""), set())))
            for name in out.keys() | maker.keys()}
