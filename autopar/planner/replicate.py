"""Export a model whose blocks repeat with three periods of blocks, and copy the rest.

`torch.export` traces every op of every block: for GPT-3's 96 identical layers that is most of
the planning time. When a `nn.ModuleList`'s blocks are equal up to their own index with period
p (p = 1 for GPT, 2 for GShard MoE's dense/MoE alternation), a copy of the model holding 3p
blocks is exported; the third period is checked to be the second one shifted by p (ops, scalar
arguments, wiring, parameters), and the remaining periods are copied from it. Nodes are then
named in order the way torch.fx names them, so the result is the graph a full export gives.
Whenever a check fails, the caller exports the whole model instead.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from autopar.contract.export import WRAPPER_PREFIX

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class Repeat:
    path: str  # the ModuleList's module path, e.g. "h"
    period: int
    count: int


class _Mismatch(Exception):
    """The short export is not a faithful template of the full one."""


def find_repeat(model: nn.Module) -> Repeat | None:
    """The ModuleList whose blocks repeat with the shortest period, saving the most tracing."""
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and name]
    best: Repeat | None = None
    for name, blocks in lists:
        if any(name.startswith(other + ".") for other, _ in lists):
            continue  # nested inside a repeated block
        n = len(blocks)
        ids = [id(p) for b in blocks for p in b.parameters()]
        if len(ids) != len(set(ids)):
            continue  # blocks share weights: their placeholders do not shift with the index
        states = [_state(b) for b in blocks]
        # at least 5 periods: the short export (3) must spare two, or it costs more than it saves
        # when its check fails and the whole model is exported after it (transformers' Llama)
        for p in range(1, n // 5 + 1):
            if n % p == 0 and all(_equal(states[i], i, states[i + p], i + p) for i in range(n - p)):
                if best is None or n - 3 * p > best.count - 3 * best.period:
                    best = Repeat(name, p, n)
                break
    return best


def _state(block: nn.Module) -> list | None:
    """What a block's forward can depend on: module types, attributes, parameter and buffer shapes."""
    out: list = []
    for name, mod in block.named_modules():
        if mod._forward_hooks or mod._forward_pre_hooks:
            return None
        attrs = []
        for key, value in sorted(vars(mod).items()):
            if key.startswith("_"):
                continue
            attrs.append((key, (tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor) else value))
        params = [(k, tuple(p.shape), p.dtype, p.requires_grad) for k, p in mod.named_parameters(recurse=False)]
        buffers = [(k, tuple(b.shape), b.dtype) for k, b in mod.named_buffers(recurse=False)]
        out.append((name, type(mod), attrs, params, buffers))
    return out


def _equal(a: list | None, i: int, b: list | None, j: int) -> bool:
    """Equal states, except attributes holding the block's own index (e.g. HF's `layer_idx`)."""
    if a is None or b is None or len(a) != len(b):
        return False
    try:
        for (name, kind, attrs, params, buffers), (name2, kind2, attrs2, params2, buffers2) in zip(a, b):
            if (name, kind, params, buffers, [k for k, _ in attrs]) != (name2, kind2, params2, buffers2, [k for k, _ in attrs2]):
                return False
            if not all(bool(x == y) or (type(x) is int and type(y) is int and (x, y) == (i, j))
                       for (_, x), (_, y) in zip(attrs, attrs2)):
                return False
        return True
    except Exception:  # attributes whose == is not a bool (arrays)
        return False


def capture_replicated(model: nn.Module, export: Callable[[nn.Module], Any], build: Callable[..., Any]) -> Any:
    """`build(...)` of the full graph made from an export of 3 periods, or None to export it all."""
    rep = find_repeat(model)
    if rep is None:
        return None
    parent_path, _, attr = rep.path.rpartition(".")
    parent = model.get_submodule(parent_path)
    full = getattr(parent, attr)
    setattr(parent, attr, nn.ModuleList(list(full)[: 3 * rep.period]))
    try:
        exported = export(model)
    except Exception as exc:  # e.g. forward indexes blocks by a config count: export all of it
        log.debug("short export of %s failed (%s); exporting every block", rep.path, exc)
        return None
    finally:
        setattr(parent, attr, full)
    try:
        graph, to_param, to_buffer = _expand(exported, rep)
    except _Mismatch as exc:
        log.debug("blocks of %s do not repeat in the graph (%s); exporting every block", rep.path, exc)
        return None
    return build(graph, model, to_param, to_buffer, set(exported.graph_signature.user_inputs))


def _expand(exported: Any, rep: Repeat) -> tuple[fx.Graph, dict[str, str], dict[str, str]]:
    prefix = f"{WRAPPER_PREFIX}{rep.path}."
    p, periods = rep.period, rep.count // rep.period
    sig = exported.graph_signature
    kind_of = {**{ph: "param" for ph in sig.inputs_to_parameters}, **{ph: "buffer" for ph in sig.inputs_to_buffers}}
    fqn_of = {**sig.inputs_to_parameters, **sig.inputs_to_buffers}

    def block(path: str) -> int | None:
        if not path.startswith(prefix):
            return None
        return int(path[len(prefix):].split(".")[0])

    def shift(path: str, delta: int) -> str:
        k = block(path)
        if k is None:
            return path
        rest = path[len(prefix):].partition(".")[2]
        return f"{prefix}{k + delta}" + (f".{rest}" if rest else "")

    other = [n.name for n in exported.graph.nodes if n.op not in ("placeholder", "call_function", "output")]
    if other:
        raise _Mismatch(f"{other[0]} is neither a placeholder nor an op")
    calls = [n for n in exported.graph.nodes if n.op == "call_function"]
    period = []
    for n in calls:
        stack = n.meta.get("nn_module_stack") or {}
        k = block(list(stack.values())[-1][0]) if stack else None
        period.append(None if k is None else k // p)
    last = [max((i for i, k in enumerate(period) if k == j), default=-1) for j in range(3)]
    if min(last) < 0 or not last[0] < last[1] < last[2]:
        raise _Mismatch("blocks are not called in order")
    for i, k in enumerate(period):
        if k is not None and not (last[k - 1] if k else -1) < i <= last[k]:
            raise _Mismatch(f"{calls[i].name} of period {k} runs out of order")
    seg1, seg2 = calls[last[0] + 1 : last[1] + 1], calls[last[1] + 1 : last[2] + 1]
    head, tail = calls[: last[0] + 1], calls[last[2] + 1 :]
    pos1, pos2 = {n: i for i, n in enumerate(seg1)}, {n: i for i, n in enumerate(seg2)}
    _check_template(seg1, seg2, pos1, pos2, fqn_of, shift, p)

    graph = fx.Graph()
    to_param: dict[str, str] = {}
    to_buffer: dict[str, str] = {}
    env: dict[fx.Node, fx.Node] = {}
    copies: list[list[fx.Node]] = []  # period j's nodes (j = 1, 2, 3 …) by position in seg2

    def placeholder(ph: fx.Node, delta: int) -> fx.Node:
        fqn = shift(fqn_of[ph.name], delta) if ph.name in fqn_of else None
        name = ph.name if not delta else ph.name.replace(_ident(fqn_of[ph.name]), _ident(fqn))
        if delta and name == ph.name:
            raise _Mismatch(f"cannot name the placeholder of {fqn}")
        new = graph.placeholder(name, type_expr=ph.type)
        new.meta = dict(ph.meta)
        if fqn is not None:
            (to_param if kind_of[ph.name] == "param" else to_buffer)[name] = fqn
        return new

    placeholders = [n for n in exported.graph.nodes if n.op == "placeholder"]
    third = {kind: [ph for ph in placeholders if kind_of.get(ph.name) == kind
                    and (block(fqn_of[ph.name]) or 0) // p == 2 and block(fqn_of[ph.name]) is not None]
             for kind in ("param", "buffer")}
    clones: dict[tuple[str, int], fx.Node] = {}  # (template placeholder, period) -> its copy
    for ph in placeholders:
        env[ph] = placeholder(ph, 0)
        kind = kind_of.get(ph.name)
        if kind and third[kind] and ph is third[kind][-1]:
            for j in range(3, periods):
                for t in third[kind]:
                    clones[(t.name, j)] = placeholder(t, (j - 2) * p)

    def copy(node: fx.Node, arg: Callable[[fx.Node], fx.Node], delta: int = 0) -> fx.Node:
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), arg)
        new = graph.create_node(node.op, node.target, args, kwargs, name=_base(node.name), type_expr=node.type)
        new.meta = dict(node.meta)
        if delta and "nn_module_stack" in node.meta:
            new.meta["nn_module_stack"] = {
                k.replace(v[0], shift(v[0], delta)) if v[0] and v[0] in k else k: (shift(v[0], delta), v[1])
                for k, v in node.meta["nn_module_stack"].items()
            }
        return new

    for n in head + seg1 + seg2:
        env[n] = copy(n, lambda a: env[a])
    copies.append([env[n] for n in seg1])
    copies.append([env[n] for n in seg2])
    for j in range(3, periods):
        current: list[fx.Node] = []

        def arg(a: fx.Node, j: int = j, current: list = current) -> fx.Node:
            if a in pos2:
                return current[pos2[a]]
            if a in pos1:
                return copies[-1][pos1[a]]
            return clones.get((a.name, j), env[a])

        for n in seg2:
            current.append(copy(n, arg, (j - 2) * p))
        copies.append(current)

    def tail_arg(a: fx.Node) -> fx.Node:
        if a in pos2:
            return copies[-1][pos2[a]]
        if a in pos1:
            return copies[-2][pos1[a]]
        return env[a]

    for n in tail:
        env[n] = copy(n, tail_arg)
    output = next(iter(exported.graph.find_nodes(op="output")))
    graph.output(fx.node.map_arg(output.args[0], tail_arg))
    return graph, to_param, to_buffer


def _check_template(seg1: list, seg2: list, pos1: dict, pos2: dict, fqn_of: dict, shift: Callable, p: int) -> None:
    """seg2 must be seg1 moved by one period: same ops and scalars, wiring shifted by a period,
    the same shared inputs, parameters `p` blocks further on."""
    if len(seg1) != len(seg2):
        raise _Mismatch(f"periods have {len(seg1)} and {len(seg2)} ops")
    for a, b in zip(seg1, seg2):
        if a.target != b.target or _scalars(a) != _scalars(b):
            raise _Mismatch(f"{a.name} and {b.name} differ")
        if len(a.all_input_nodes) != len(b.all_input_nodes):
            raise _Mismatch(f"{a.name} and {b.name} take different inputs")
        for x, y in zip(a.all_input_nodes, b.all_input_nodes):
            if y in pos2:
                ok = x in pos1 and pos1[x] == pos2[y]
            elif y in pos1:
                ok = x not in pos1 and x.op == "call_function"  # the previous period's output
            elif y.name in fqn_of:
                ok = x.name in fqn_of and shift(fqn_of[x.name], p) == fqn_of[y.name]
            else:
                ok = x is y  # shared: user inputs, a mask computed once before the blocks
            if not ok:
                raise _Mismatch(f"{b.name} reads {y.name} where {a.name} reads {x.name}")


def _scalars(node: fx.Node) -> str:
    return repr(fx.node.map_arg((node.args, node.kwargs), lambda _: None))


def _base(name: str) -> str:
    """fx names the k-th node of a kind `base_k`: hand it the base and it counts again."""
    return re.sub(r"_\d+$", "", name)


def _ident(fqn: str) -> str:
    return re.sub(r"\W", "_", fqn)
