"""Ops without a sharding rule, said once and only where they matter.

An op the rules do not describe (`rules.UNKNOWN`) runs replicated: on whole tensors, on every rank
of the tensor axis. Under data parallelism the runtime runs it on each replica's samples as any
other op, so that is a note (the model's count and op names, at info level, once per capture); it
is worth a warning only where it changes a plan: a tensor-parallel stage that gathers split values
whole to run such an op. (Its signature relates no dimension to the batch, so the cost model prices
it as if the data axis gathered its batched inputs and ran it on the whole batch: dearer than what
runs, never cheaper.)
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

from autopar.contract.export import source_line
from autopar.planner import rules as L
from autopar.planner.graph import OpGraph
from autopar.planner.placement import R

log = logging.getLogger(__name__)


def unruled(graph: OpGraph) -> dict[str, str]:
    """Node name -> op name of every op without a sharding rule."""
    out = {}
    for node in graph.fx_graph.nodes:
        if node.op == "call_function" and node.name in graph.graph and L.signature(node).kind == L.UNKNOWN:
            out[node.name] = str(node.target)
    return out


def summary(graph: OpGraph) -> str | None:
    """One line: how many ops have no sharding rule, of which kinds (most frequent first)."""
    counts = Counter(unruled(graph).values())
    if not counts:
        return None
    kinds = ", ".join(f"{op} ×{n}" for op, n in counts.most_common())
    return (f"{sum(counts.values())} ops of {len(counts)} kinds have no sharding rule and run replicated "
            f"(on whole tensors wherever a tensor axis splits their inputs): {kinds}")


def warn_replicated(graph: OpGraph, plan: Any) -> None:
    """Log `replicated_regions` as a warning, where there is one (once per plan a user gets)."""
    said = replicated_regions(graph, plan)
    if said:
        log.warning(said)


def replicated_regions(graph: OpGraph, plan: Any) -> str | None:
    """A warning when a tensor-parallel stage of `plan` gathers split values whole for ops without a
    sharding rule: which ops, and the model line of the first."""
    ops = unruled(graph)
    gathered: Counter = Counter()
    first = None
    for stage in plan.stages:
        if stage.logical_mesh[1] <= 1:
            continue
        for name in (n for layer in plan.layers[stage.layers[0]:stage.layers[1]] for n in layer["nodes"]):
            if name not in ops:
                continue
            split = [src for src in graph.graph.predecessors(name)
                     if str((stage.ops.get(src) or [R, R])[1]) != R]
            if split:
                gathered[ops[name]] += 1
                first = first or graph.fx_nodes[name]
    if not gathered:
        return None
    kinds = ", ".join(f"{op} ×{n}" for op, n in gathered.most_common())
    return (f"the plan gathers split values whole on the tensor axis for {sum(gathered.values())} ops without a "
            f"sharding rule ({kinds}; the first{source_line(first)}): they run replicated on every rank of the "
            "tensor axis, priced so")
