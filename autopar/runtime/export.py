"""The model exported at the shape one rank runs, with the node names of the plan.

The plan names nodes as the export at the global batch did; the runtime exports at a microbatch.
Usually the two graphs are the same code with other shapes, and so have the same names. At one
sample per microbatch they are not: torch.export specialises dimensions of size 1 (a mask's
`expand` to batch 1 disappears, say), and every later node of the same kind shifts its name. Then
the global batch is exported too, and each node of the microbatch graph takes the name of the node
at the same place in it: same module, same op, same occurrence within the module.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from typing import Any

import torch
from torch import fx, nn

from autopar.contract.errors import AutoparError
from autopar.contract.export import export_program


def export_as_planned(model: nn.Module, micro: tuple, whole: tuple) -> Any:
    """`model` exported on `micro`, its nodes named as in the export on `whole` (the plan's)."""
    ep = export_program(model, micro)
    if _batch(micro) == 1 != _batch(whole):
        align_names(ep.graph, export_program(model, whole).graph)
    return ep


def same_on_every_rank(graph: fx.Graph, model: nn.Module) -> None:
    """Every rank of the job exported `graph` as the first rank that exported at the same input
    shapes did (ops, names, shapes), else every rank raises the same error: a forward that depends
    on something differing between processes would run another program than the plan's on some
    ranks. (Rank 0 alone captured the graph it planned with; the runtime's builds call this, every
    rank together, on their own exports. Pipeline stages of other data-parallel sizes export at
    other microbatch shapes, and size-1 dimensions specialise, so only equal shapes compare.)"""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    inputs, h = [], hashlib.sha256()
    for n in graph.nodes:
        val = n.meta.get("val")
        shape = tuple(val.shape) if isinstance(val, torch.Tensor) else None
        if n.op == "placeholder":
            inputs.append(shape)
        h.update(repr((n.op, n.name, str(n.target), shape)).encode())
    said: list = [None] * dist.get_world_size()
    dist.all_gather_object(said, (repr(inputs), h.hexdigest()[:16]))
    first = {}
    for r, (shapes, _) in enumerate(said):
        first.setdefault(shapes, r)
    other = [(r, first[shapes]) for r, (shapes, digest) in enumerate(said) if digest != said[first[shapes]][1]]
    if other:
        r, like = other[0]
        raise AutoparError(
            f"rank {r} exported another graph of {type(model).__name__} than rank {like} did, at the same input "
            f"shapes ({said[r][1]} against {said[like][1]}): its forward depends on something that differs between "
            "processes, most often Python's hash order (a set iterated in forward, as transformers' ModernBERT does "
            "with its layer types); start every rank with the same PYTHONHASHSEED, e.g. PYTHONHASHSEED=0 torchrun ...")


def export_standing_in(model: nn.Module, args: tuple, like: fx.Graph) -> Any:
    """`model` exported at `args`' shapes after its parameters were placed (DTensors, FSDP2's
    shards): every parameter and buffer stands in as a fake tensor of its whole shape (no memory,
    no collective), and the nodes take `like`'s names (the plan's: `align_names`). The model's
    mode (train or eval) is the export's. Tensor constants its code creates come back fake: the
    caller takes them from an export on real values."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.nn.utils.stateless import _reparametrize_module
    from torch.utils._pytree import tree_map_only

    mode = FakeTensorMode()
    stand_ins: dict[int, torch.Tensor] = {}
    state = {}
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        if id(t) not in stand_ins:
            with mode:
                fake = torch.empty(t.shape, dtype=t.dtype, device=t.device)
            stand_ins[id(t)] = nn.Parameter(fake, t.requires_grad) if isinstance(t, nn.Parameter) else fake
        state[name] = stand_ins[id(t)]
    fake_args = tree_map_only(torch.Tensor, mode.from_tensor, args)
    with _reparametrize_module(model, state, tie_weights=True):
        ep = export_program(model, fake_args)
    align_names(ep.graph, like)
    return ep


def _batch(inputs: tuple) -> int | None:
    return next((x.shape[0] for x in inputs if isinstance(x, torch.Tensor) and x.dim() > 0), None)


def _key(node: fx.Node, seen: dict) -> tuple:
    stack = node.meta.get("nn_module_stack") or {}
    path = list(stack.values())[-1][0] if stack else ""
    kind = (path, str(node.target))
    seen[kind] += 1
    return (*kind, seen[kind])


def align_names(graph: fx.Graph, planned: fx.Graph) -> None:
    """Rename `graph`'s ops to `planned`'s by (module, op, occurrence); ops without a counterpart get
    names no plan uses, so they run as DTensor places them, in the stage of their inputs."""
    seen: dict = defaultdict(int)
    names = {_key(n, seen): n.name for n in planned.nodes if n.op == "call_function"}
    seen = defaultdict(int)
    ops = [n for n in graph.nodes if n.op == "call_function"]
    wanted = [names.get(_key(n, seen)) or f"unplanned_{n.name}" for n in ops]
    for n, name in zip(ops, wanted):
        n.name = name  # the graph is run node by node (`ShardedGraph`), never turned back into code
    assert len({n.name for n in graph.nodes}) == len(graph.nodes)
