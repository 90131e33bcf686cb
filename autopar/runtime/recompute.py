"""Activation recomputation as the planner prices it (`stage_costs`): a stage marked `recompute`
keeps, per microbatch, only the inputs of each of its layers, and runs each layer's forward again
just before that layer's backward (Megatron-LM's full recomputation, one checkpoint per layer).
Its peak in backward is then one layer's activations, not the stage's. With `recompute_layers` k,
only the stage's first k layers do so; the later ones keep their activations (Mist, AdaPipe).
With `recompute_granularity` "selective" (Megatron-LM's) only each attention's core runs again
(`contract.attention`): it is a segment of its own inside its layer's (`Segment.cores`), under a
checkpoint that keeps its inputs (Q, K, V, a mask), while the rest of the layer keeps its
activations as without recomputation.

The stage's graph (`ShardedGraph`) runs as segments, one per layer of the plan (the nodes it
lists; nodes no layer lists join the segment they follow), each under one non-reentrant
`torch.utils.checkpoint` that restores the random state (dropout draws the same masks). A
segment receives the values it reads from earlier ones as arguments and returns those later ones
read, so nothing else of it stays alive.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import fx

from autopar.contract.attention import core_inputs


@dataclass
class Segment:
    nodes: list[fx.Node]
    inputs: list[fx.Node]  # values made before it (or the stage's inputs) that it reads
    outputs: list[fx.Node]  # values it makes that later segments, or the stage's outputs, read
    layer: int | None = None  # the index of its layer among the stage's (None: before the first)
    cores: dict[fx.Node, Segment] = field(default_factory=dict)  # first node -> an attention core in it

    def with_cores(self, cores: list[list[fx.Node]], kept: set[fx.Node], given: set[fx.Node]) -> Segment:
        """This segment with the attention `cores` among its nodes as sub-segments, each made
        contiguous (ops between a core's first and last that do not read it run before it)."""
        mine = [c for c in cores if set(c) <= set(self.nodes)]
        if not mine:
            return self
        nodes = list(self.nodes)
        subs = {}
        for core in mine:
            members = set(core)
            start, end = nodes.index(core[0]), nodes.index(core[-1])
            after: set[fx.Node] = set(members)
            ahead, rest = [], []
            for n in nodes[start:end + 1]:
                if n in members:
                    continue
                if any(i in after for i in n.all_input_nodes):
                    after.add(n)
                    rest.append(n)
                else:
                    ahead.append(n)
            nodes[start:end + 1] = ahead + core + rest
            outputs = [n for n in core if n in kept or any(u not in members for u in n.users)]
            subs[core[0]] = Segment(core, [i for i in core_inputs(core) if i not in given], outputs, self.layer)
        return Segment(nodes, self.inputs, self.outputs, self.layer, subs)

    def recomputes(self, recompute: bool, layers: int | None) -> bool:
        """Whether a stage recomputing its first `layers` layers (None: all) recomputes this segment."""
        return recompute and (layers is None or self.layer is not None and self.layer < layers)


def segments(nodes: list[fx.Node], layers: list[list[str]], kept: set[fx.Node], given: set[fx.Node]) -> list[Segment]:
    """`nodes` (graph order) cut into runs of one layer each. `kept`: values read after the last
    node (the stage's outputs, buffer updates); `given`: placeholders the stage supplies itself
    (parameters, buffers, constants), which are no segment's inputs."""
    layer_of = {name: i for i, names in enumerate(layers) for name in names}
    runs: list[list[fx.Node]] = []
    run_layers: list[int | None] = []
    current = None
    for node in nodes:
        layer = layer_of.get(node.name, current)
        if not runs or layer != current:
            runs.append([])
            run_layers.append(layer)
        runs[-1].append(node)
        current = layer
    where = {n: i for i, run in enumerate(runs) for n in run}
    out = []
    for i, run in enumerate(runs):
        inputs = list(dict.fromkeys(a for n in run for a in n.all_input_nodes if where.get(a) != i and a not in given))
        outputs = [n for n in run if n in kept or any(where.get(u, i) > i for u in n.users)]
        out.append(Segment(run, inputs, outputs, run_layers[i]))
    return out


# the annotation a traced program's recomputed regions carry (`runtime.lower` marks them for the partitioner)
RECOMPUTE = "autopar_recompute"


def recomputed(run: Any, values: list, region: int, tracing: bool) -> Any:
    """`run(*values)` recomputed in backward: under a checkpoint, or while the lowering traces the
    stage, annotated as region `region` (torch's checkpoint does not recompute inside a traced
    program; AOTAutograd's partitioner recomputes the nodes so marked from the values they read)."""
    if not tracing:
        return checkpointed(run, *values)
    from torch.fx import traceback as fx_traceback

    with fx_traceback.annotate({RECOMPUTE: region}):
        return run(*values)


def checkpointed(run: Any, *values: Any) -> Any:
    """`run(*values)` under a checkpoint: its activations are recomputed in backward. The whole
    segment again: stopping early interrupts `run` with an exception, which the runtime would
    report as the op failing."""
    from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

    with set_checkpoint_early_stop(False):
        return checkpoint(run, *values, use_reentrant=False)
