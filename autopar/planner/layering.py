"""Cluster the graph into the layers pipeline stages are cut from (Alpa eq. 6).

The atoms are the module-boundary layers of the capture (`OpGraph.layers()`: `wte`, `h.0`, …):
cutting inside a module is never better for a pipeline and makes stages hard to read. Contiguous
atoms are grouped into L layers whose FLOPs stay within ±tolerance of the average while the
largest number of bytes crossing a layer boundary is as small as possible (ties: the most even
FLOPs); a group holding a single module with FLOPs is exempt (a module is never split), and L is
the largest count for which such a balance exists: 0-FLOP embeddings join their neighbour, and
each transformer block can be a layer of its own.

Those groups are what a recomputing stage checkpoints (and ZeRO-3 gathers at once). Where the
stage DP can afford it (`EVERY_MODULE_UP_TO` modules), it cuts stages at every module instead
(`dp_layers`): grouped, an embedding, a layer of no FLOPs, could be neither a stage of its own nor
cut from its neighbour, the widest misses `benchmarks/optimality_gap.py` found (up to 36 %).
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.planner.graph import OpGraph


@dataclass(frozen=True)
class Layer:
    name: str
    atoms: tuple[int, int]  # [start, end) in graph.layers()
    nodes: tuple[str, ...]
    flops: float  # forward + backward


MAX_LAYERS = 64  # the stage DP is cubic in the layer count: GPT-3's 96 blocks become 48 pairs
# up to this many modules the DP cuts at every one; above, at the groups: gpt-39b's 52 modules
# ungrouped (49 layers grouped) planned in 1.08-1.25x the time, for the same plan (2026-11-29)
EVERY_MODULE_UP_TO = 32


def modules(graph: OpGraph) -> list[Layer]:
    """Each module a layer: where a person cuts stages."""
    return [_layer(graph, graph.layer_list, i, i + 1) for i in range(len(graph.layer_list))]


def dp_layers(graph: OpGraph, units: list[Layer]) -> list[Layer]:
    """The layers the stage DP cuts at: every module where they are few enough, else the groups
    `units` (`cluster_layers`)."""
    return modules(graph) if len(graph.layer_list) <= EVERY_MODULE_UP_TO else units


def cluster_layers(graph: OpGraph, max_layers: int | None = MAX_LAYERS, tolerance: float = 0.25) -> list[Layer]:
    atoms = graph.layer_list
    n = len(atoms)
    flops = [a.flops_fwd + a.flops_bwd for a in atoms]
    cut = cut_bytes(graph, atoms)
    total = sum(flops)
    for count in range(min(n, max_layers or n), 0, -1):
        avg = total / count
        bounds = _balanced(flops, cut, count, avg * (1 - tolerance), avg * (1 + tolerance))
        if bounds is not None:
            return [_layer(graph, atoms, a, b) for a, b in zip(bounds, bounds[1:])]
    return [_layer(graph, atoms, 0, n)]


def cut_bytes(graph: OpGraph, atoms) -> list[float]:
    """cut[i]: bytes of tensors produced in atoms[0..i] and read in atoms[i+1..] — each tensor
    once, from its producer's atom to its last reader's, however many ops read it."""
    where = {name: i for i, a in enumerate(atoms) for name in a.nodes}
    delta = [0.0] * (len(atoms) + 1)
    for src in graph.graph.nodes:
        readers = [where[d] for d in graph.graph.successors(src)]
        last = max(readers, default=where[src])
        if last > where[src]:
            nbytes = max(b for _, _, b in graph.graph.out_edges(src, data="bytes"))
            delta[where[src]] += nbytes
            delta[last] -= nbytes
    out, running = [], 0.0
    for i in range(len(atoms)):
        running += delta[i]
        out.append(running)
    return out


def _balanced(flops: list[float], cut: list[float], count: int, low: float, cap: float) -> list[int] | None:
    """Boundaries of `count` groups with FLOPs in [low, cap] each, minimising (largest cut, largest
    group) lexicographically (DP over atoms)."""
    n = len(flops)
    prefix, modules = [0.0], [0]  # prefix sums of FLOPs and of atoms with FLOPs
    for f in flops:
        prefix.append(prefix[-1] + f)
        modules.append(modules[-1] + (f > 0))
    inf = (float("inf"), float("inf"))
    best = [[inf] * (n + 1) for _ in range(count + 1)]  # best[g][i]: first i atoms in g groups
    back = [[-1] * (n + 1) for _ in range(count + 1)]
    best[0][0] = (0.0, 0.0)
    for g in range(1, count + 1):
        for i in range(g, n + 1):
            for j in range(g - 1, i):
                group = prefix[i] - prefix[j]
                single = modules[i] - modules[j] == 1  # one module is never split: exempt
                if best[g - 1][j] == inf or not (single or low <= group <= cap):
                    continue
                prev = best[g - 1][j]
                worst = (max(prev[0], cut[i - 1] if i < n else 0.0), max(prev[1], group))
                if worst < best[g][i]:
                    best[g][i], back[g][i] = worst, j
    if best[count][n] == inf:
        return None
    bounds, i = [n], n
    for g in range(count, 0, -1):
        i = back[g][i]
        bounds.append(i)
    return bounds[::-1]


def _layer(graph: OpGraph, atoms, a: int, b: int) -> Layer:
    name = atoms[a].name if b - a == 1 else f"{atoms[a].name}…{atoms[b - 1].name}"
    nodes = tuple(n for atom in atoms[a:b] for n in atom.nodes)
    flops = sum(atom.flops_fwd + atom.flops_bwd for atom in atoms[a:b])
    return Layer(name or "root", (a, b), nodes, flops)
