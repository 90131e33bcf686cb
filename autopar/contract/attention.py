"""The ops selective recomputation recomputes: each attention's core, found the same way by the
planner (which prices it, `planner.capture`) and the runtime (which checkpoints it,
`runtime.sharded_graph`).

Megatron-LM's selective recomputation (Korthikanti et al., 2022) recomputes only the core of
attention: QKᵀ, its scaling and masks, softmax, dropout and the product with V. Those hold the
activations that grow with the square of the sequence (5·a·s/h of a layer's 34 + 5·a·s/h bytes
per token and hidden unit) for a few percent of its FLOPs. In an exported graph a core is the
ops between two matrix products of activations (neither operand a weight): the first (QKᵀ), the
second it reaches without another matrix product or a weight on the way (the product with V),
and every op on a path between them, a softmax among them (two chained products of activations
without one — a rotary table's, linear attention's — are not a core); a core that an op outside
it both reads and feeds is not one either (a checkpoint runs its ops together). A fused
attention (`scaled_dot_product_attention` and its kernels) is a core by itself: it keeps only
its inputs, output and log-sum-exp, so recomputing it saves little — the planner prices that,
and the search does not weigh it where the cores hold little (`StageCosts.recomputes`).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

from torch import fx

PRODUCTS = {"bmm", "matmul", "baddbmm"}
SOFTMAX = {"softmax", "_softmax", "_safe_softmax"}
FUSED = {"scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu",
         "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
         "_scaled_dot_product_cudnn_attention"}


def _name(node: fx.Node) -> str:
    """The aten op's name without namespace and overload (`aten.bmm.default` -> `bmm`)."""
    name = getattr(node.target, "__name__", str(node.target))
    return name.split(".")[0]


def is_view(node: fx.Node) -> bool:
    return node.op == "call_function" and (node.target is operator.getitem
                                           or bool(getattr(node.target, "is_view", False)))


def base(node: fx.Node) -> tuple[fx.Node, int]:
    """The value a chain of views reads: (the node that made it, which of its outputs). A piece of
    a view op (`split`'s) is a view of that op's input."""
    while node.op == "call_function":
        if node.target is operator.getitem:
            if not is_view(node.args[0]):
                return node.args[0], node.args[1]
            node = node.args[0]
        elif is_view(node) and node.all_input_nodes:
            node = node.all_input_nodes[0]
        else:
            break
    return node, 0


def attention_cores(nodes: Sequence[fx.Node], weights: set[fx.Node]) -> list[list[fx.Node]]:
    """Each attention core among `nodes` (graph order), its ops in graph order. `weights`: the
    placeholders that are parameters (a product reading one, through views, is a layer's, not
    attention's)."""
    inside = set(nodes)
    order = {n: i for i, n in enumerate(nodes)}

    def product(n: fx.Node) -> bool:
        return _name(n) in PRODUCTS and not any(base(i)[0] in weights for i in n.all_input_nodes)

    cores: list[list[fx.Node]] = []
    taken: set[fx.Node] = set()
    for node in nodes:
        if node in taken or node.op != "call_function":
            continue
        if _name(node) in FUSED:
            cores.append([node])
            taken.add(node)
            continue
        if not product(node):
            continue
        # forward from QKᵀ, stopping at weights' ops and at matrix products
        reached, frontier, second = {node}, [node], None
        while frontier:
            n = frontier.pop()
            for u in n.users:
                if u not in inside or u in reached or u in taken:
                    continue
                if product(u):
                    second = u if second is None or order[u] < order[second] else second
                    continue
                if any(base(i)[0] in weights for i in u.all_input_nodes) or _name(u) in FUSED:
                    continue
                reached.add(u)
                frontier.append(u)
        if second is None:
            continue
        # the ops reached from QKᵀ that lead to the second product
        core, frontier = {node, second}, [second]
        while frontier:
            n = frontier.pop()
            for i in n.all_input_nodes:
                if i in reached and i not in core:
                    core.add(i)
                    frontier.append(i)
        if not any(_name(n) in SOFTMAX for n in core) or not _convex(core, nodes, order):
            continue
        cores.append(sorted(core, key=order.__getitem__))
        taken |= core
    return cores


def _convex(core: set[fx.Node], nodes: Sequence[fx.Node], order: dict[fx.Node, int]) -> bool:
    """Whether no op outside `core` reads one of its values and feeds one of its ops."""
    first, last = min(order[n] for n in core), max(order[n] for n in core)
    after: set[fx.Node] = set()  # ops outside the core that read it, directly or not
    for n in nodes[first:last + 1]:
        if n in core:
            if any(i in after for i in n.all_input_nodes):
                return False
        elif any(i in core or i in after for i in n.all_input_nodes):
            after.add(n)
    return True


def core_inputs(core: Sequence[fx.Node]) -> list[fx.Node]:
    """The values a core reads from outside it (what a checkpoint of it keeps), in first-use order."""
    members = set(core)
    return list(dict.fromkeys(i for n in core for i in n.all_input_nodes if i not in members))
