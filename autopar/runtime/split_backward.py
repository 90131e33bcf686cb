"""A lowered stage's backward graph cut in two, for the zero-bubble schedules.

A zero-bubble schedule (ZB-H1, ZB-V, interleaved-zb; Qi et al. 2024) runs a stage's backward as
two passes: "B", the gradients of the stage's inputs, which the previous stage waits for, and
"W", the weights' gradients, which fill the pipeline's bubbles later. torch's pipelining splits
an eager stage's backward at autograd's nodes (`stage_backward_input` / `stage_backward_weight`).
A lowered stage is one autograd node, its backward one graph: split there, "B" ran the whole
graph and "W" ran it again (gpt-small, 2 stages, 8 microbatches: every matmul of the backward
issued twice, the step 0.48 -> 0.70 s), which the planner never priced. Here the graph is cut
as the zero-bubble paper cuts a layer's backward: the input part is every op the inputs'
gradients need; the weight part is the rest, reading the input part's values it needs (the
gradients of the linear layers' outputs, the saved activations) once "W" comes.
"""

from __future__ import annotations

from torch import fx


def split(gm: fx.GraphModule, weights: int) -> tuple[fx.GraphModule, fx.GraphModule] | None:
    """(input part, weight part) of backward graph `gm`, whose first `weights` outputs are the
    weights' gradients and the rest the inputs'. The input part returns `gm`'s outputs with None
    for each weight's, then the values the weight part reads (its placeholders, in order); the
    weight part returns the weights' gradients. None where there is nothing to cut (no weight
    gradient, or no input gradient: the whole graph is one part)."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    returned = list(output.args[0])
    weight_outs = [v for v in returned[:weights] if isinstance(v, fx.Node)]
    input_outs = [v for v in returned[weights:] if isinstance(v, fx.Node)]
    if not weight_outs or not input_outs:
        return None
    # the input part takes every input of the graph (the saved values and the incoming gradients)
    first = _needed(input_outs) | set(gm.graph.find_nodes(op="placeholder"))
    needed = _needed(weight_outs)
    later = [n for n in gm.graph.nodes if n in needed and n not in first]
    # what the weight part reads of the input part's values (the graph's own inputs among them)
    later_set = set(later)
    handed = [n for n in gm.graph.nodes if n in first and any(u in later_set for u in n.users)]
    handed += [v for v in weight_outs if v in first and v not in handed]  # a weight gradient B computes anyway

    inputs_part = fx.Graph()
    copied: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        if node in first:
            copied[node] = inputs_part.node_copy(node, lambda n: copied[n])
    outs = [None] * weights + [copied[v] if isinstance(v, fx.Node) else v for v in returned[weights:]]
    inputs_part.output((*outs, *(copied[n] for n in handed)))

    weight_part = fx.Graph()
    moved: dict[fx.Node, fx.Node] = {}
    for n in handed:
        moved[n] = weight_part.placeholder(f"handed_{n.name}")
        moved[n].meta = dict(n.meta)
    for node in later:
        moved[node] = weight_part.node_copy(node, lambda n: moved[n])
    weight_part.output(tuple(moved[v] if isinstance(v, fx.Node) else v for v in returned[:weights]))
    return fx.GraphModule(gm, inputs_part), fx.GraphModule(gm, weight_part)


def _needed(outputs: list[fx.Node]) -> set[fx.Node]:
    """Every node `outputs` are computed from (placeholders included). The graph is functional
    (AOTAutograd's, before the runtime's in-place passes): what reads nothing's output is dead."""
    seen: set[fx.Node] = set()
    frontier = list(outputs)
    while frontier:
        node = frontier.pop()
        if node not in seen:
            seen.add(node)
            frontier.extend(node.all_input_nodes)
    return seen
