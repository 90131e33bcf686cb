"""What moving a tensor between anchor groups costs: for every edge crossing groups a matrix over
the two groups' strategies (redistribution forward and the gradient's way back), weights tied
between groups, and graph outputs that must leave whole or split by batch."""

from __future__ import annotations

from typing import Any

import numpy as np

from autopar.planner.placement import P, R, edge_time, redistribution, redistribution_time
from autopar.planner.stage_graph import StageGraph
from autopar.planner.strategy_costs import Evaluation


def edge_costs(stage: StageGraph, evals: dict[str, list[Evaluation]]) -> list[tuple[str, str, np.ndarray]]:
    """(group of producer, group of consumer, cost matrix) for every tensor crossing groups,
    and for weights tied between groups. Edges of identical layers are costed once."""
    mesh = stage.mesh
    counts: dict[tuple[str, str, int], int] = {}
    for src, name, i in stage.cross_edges():
        key = (src, name, i) if stage.canon(name) == name and stage.canon(src) == src else \
            (stage.canon(src), stage.canon(name), i)
        counts[key] = counts.get(key, 0) + 1
    out = []
    for (src, name, i), count in counts.items():
        k, gs, g = stage.out_index(name, src), stage.group(src), stage.group(name)
        nbytes, grad, share = stage.in_bytes(name, i, src), stage.grad(src), stage.sharers(src)
        m = np.array([[edge_time(a.out[src][k], b.need[name][i] or R, nbytes, mesh.tp, mesh.tp_link, grad,
                                 partial_share=share if i in b.partial.get(name, ()) else 0)
                       for b in evals[g]] for a in evals[gs]])
        out.append((gs, g, m * count))
    for fqn, owner in stage.owner.items():
        go = stage.root[owner]
        for user in stage.param_users[fqn] - {go}:
            if stage.cls[user] != user or stage.cls[go] != go:
                continue  # weights shared inside repeated layers: costed with their layer
            nbytes = stage.graph.params[fqn].nbytes
            m = np.array([[edge_time(a.params[fqn], b.params[fqn], nbytes, mesh.tp, mesh.tp_link, True)
                           for b in evals[user]] for a in evals[go]])
            out.append((go, user, m))
    return out


def output_costs(stage: StageGraph, evals: dict[str, list[Evaluation]]) -> dict[str, np.ndarray]:
    """The loss needs whole samples: an output leaves replicated or split by batch
    (`StageGraph.free_output`), not partial or split along another dimension."""
    out = {}
    for name in stage.graph.outputs:
        if stage.root.get(name):
            nbytes = stage.graph.node(name).output_bytes / stage.dp_share(name)
            free = stage.free_output(name)
            out[name] = np.array([
                0.0 if e.out[stage.canon(name)][0] == free
                else redistribution_time(e.out[stage.canon(name)][0], R, nbytes, stage.mesh.tp, stage.mesh.tp_link)
                for e in evals[stage.group(name)]])
    return out


def edge_collectives(stage: StageGraph, chosen: dict[str, Evaluation]) -> list[dict[str, Any]]:
    """The redistributions the chosen placements imply on edges, forward and backward. The partial
    gradients of a value's consumers add up before one collective completes them: listed at the
    first consumer whose chosen strategy leaves it partial."""
    def partial_at(src: str, name: str, i: int) -> bool:
        return i in chosen[stage.group(name)].partial.get(stage.canon(name), ())

    sharers: dict[str, list[str]] = {}  # (the first lists it; a recomputing stage may run one per segment)
    for src, name, i in sorted(stage.cross_edges(), key=lambda e: stage.index.get(e[1], 0)):
        if partial_at(src, name, i) and name not in sharers.get(src, ()):
            sharers.setdefault(src, []).append(name)
    out = []
    for src, name, i in stage.cross_edges():
        have = chosen[stage.group(src)].out[stage.canon(src)][stage.out_index(name, src)]
        need = chosen[stage.group(name)].need[stage.canon(name)][i] or R
        nbytes = stage.in_bytes(name, i, src)
        move = f"{have}>{need}"
        for kind, f in redistribution(have, need, stage.mesh.tp):
            out.append(stage.collective(name, kind.value, "forward", nbytes * f, "tp", src, move=move))
        if stage.grad(src):
            partial = partial_at(src, name, i)
            if partial and sharers[src][0] != name:
                continue  # one collective completes the partial gradients of all its consumers
            for kind, f in redistribution(P if partial else need, R if have == P else have, stage.mesh.tp):
                out.append(stage.collective(name, kind.value, "backward", nbytes * f, "tp", src,
                                            **({"move": move} if have != need else {}),
                                            **({"sharers": sharers[src]} if partial else {})))
    return out
