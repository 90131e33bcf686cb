"""The operator graph every pass consumes: one node per aten op, one edge per tensor.

An `OpGraph` is plain data (a networkx DiGraph of `OpNode` records keyed by the exported
graph's node names), so the planner, the cost models and the CLI can read it without torch.fx.
The torch.fx graph it came from is kept beside it (the sharding rules read scalar arguments).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import networkx as nx


@dataclass(frozen=True)
class TensorInfo:
    """Shape, dtype and size of one tensor an op reads or writes."""

    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "float16"
    nbytes: int


@dataclass
class OpNode:
    """One aten op (or a user input, with ``op == "input"``) of the captured forward graph."""

    name: str
    op: str
    inputs: tuple[TensorInfo, ...] = ()
    outputs: tuple[TensorInfo, ...] = ()
    flops_fwd: float = 0.0
    flops_bwd: float = 0.0
    bytes_read: int = 0
    bytes_written: int = 0
    params: dict[str, int] = field(default_factory=dict)  # named_parameters() FQN -> bytes
    buffers: dict[str, int] = field(default_factory=dict)
    module_path: str = ""  # innermost module from nn_module_stack, e.g. "h.3.mlp.fc1"
    layer: str = ""  # layer hint: module path up to the first ModuleList index, e.g. "h.3"
    is_view: bool = False  # aliases its input: moves no data, costs nothing
    requires_grad: bool = False  # its output is differentiated in backward
    # under mixed precision (`autopar.planner.precision`): bytes of the 16-bit copies autocast makes of its
    # activation inputs and saves for backward, and whether it copies the weights it reads
    cast_bytes: int = 0
    casts: bool = False
    # what backward keeps of it (`autopar.planner.saved`): its outputs it saves, and bytes saved that are no
    # op's output; None: unknown, every output counts. `saved_by`: the ops whose backward saves its outputs
    saved_outputs: frozenset[int] | None = None
    saved_hidden: int = 0
    saved_by: frozenset[str] | None = None
    # selective recomputation (`autopar.contract.attention`): whether it is in an attention's core,
    # and its outputs a core reads that backward does not save otherwise (a checkpointed core keeps them)
    attention: bool = False
    attention_inputs: frozenset[int] = frozenset()

    @property
    def output_bytes(self) -> int:
        return sum(t.nbytes for t in self.outputs)


@dataclass(frozen=True)
class Layer:
    """A maximal run of consecutive ops that share a layer hint."""

    index: int
    name: str
    nodes: tuple[str, ...]
    flops_fwd: float
    flops_bwd: float
    param_bytes: int  # parameters first used in this layer (a tied weight counts once)
    activation_bytes: int  # bytes produced by the layer's non-view ops in one forward


class OpGraph:
    """Captured operator graph with per-op costs; nodes in the exported (topological) order."""

    def __init__(
        self,
        graph: nx.DiGraph,
        *,
        params: dict[str, TensorInfo],
        buffers: dict[str, TensorInfo],
        outputs: list[str],
        warnings: list[str] | None = None,
        fx_graph: Any = None,
        placeholders: dict[str, str] | None = None,
        trainable: set[str] | None = None,
        batch: int | None = None,
    ) -> None:
        self.graph = graph
        self.params = params
        self.buffers = buffers
        self.placeholders = placeholders or {}  # exported placeholder name -> parameter / buffer FQN
        self.trainable = set(params) if trainable is None else trainable  # parameters with requires_grad
        self.outputs = outputs
        self.warnings = warnings or []
        self.fx_graph = fx_graph  # the exported torch.fx.Graph (aten ops)
        self._order = list(graph.nodes)
        self.precision: str | None = None  # "bf16" / "fp16": retyped as autocast runs it
        self.captured_fingerprint: str | None = None  # a retyped graph keeps the captured one's
        first = next((self.node(n) for n in self._order if self.node(n).op == "input" and self.node(n).outputs), None)
        # the model's batch: dim 0 of its first input (a subgraph keeps its parent's)
        self.batch = batch if batch is not None else (first.outputs[0].shape[0] if first and first.outputs[0].shape else None)
        self.parent: OpGraph | None = None  # the graph a subgraph was cut from (its inputs are the parent's ops)
        self._whole_batch: tuple | None = None  # `stage_graph.whole_batch_dims`, computed once

    @functools.cached_property
    def fx_nodes(self) -> dict[str, Any]:
        """The exported graph's torch.fx nodes by name (what the sharding rules read arguments from)."""
        return {n.name: n for n in self.fx_graph.nodes} if self.fx_graph is not None else {}

    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self) -> Iterator[OpNode]:
        return (self.graph.nodes[n]["op"] for n in self._order)

    def node(self, name: str) -> OpNode:
        return self.graph.nodes[name]["op"]

    def edges(self) -> Iterator[tuple[str, str, int]]:
        for src, dst, data in self.graph.edges(data=True):
            yield src, dst, data["bytes"]

    @property
    def num_params(self) -> int:
        return sum(_numel(t.shape) for t in self.params.values())

    @property
    def param_bytes(self) -> int:
        return sum(t.nbytes for t in self.params.values())

    @property
    def flops_fwd(self) -> float:
        return sum(n.flops_fwd for n in self)

    @property
    def flops_bwd(self) -> float:
        return sum(n.flops_bwd for n in self)

    def layers(self) -> list[Layer]:
        """Group consecutive ops by layer hint; user inputs join the layer that follows them."""
        runs: list[tuple[str, list[OpNode]]] = []
        pending: list[OpNode] = []
        for node in self:
            if node.op == "input":
                pending.append(node)
            elif runs and runs[-1][0] == node.layer:
                runs[-1][1].append(node)
            else:
                runs.append((node.layer, pending + [node]))
                pending = []
        if pending:
            runs.append(("", pending))
        seen: set[str] = set()
        return [self._layer(i, name, nodes, seen) for i, (name, nodes) in enumerate(runs)]

    def _layer(self, index: int, name: str, nodes: list[OpNode], seen: set[str]) -> Layer:
        param_bytes = 0
        for node in nodes:
            for fqn, nbytes in node.params.items():
                if fqn not in seen:
                    seen.add(fqn)
                    param_bytes += nbytes
        return Layer(
            index=index,
            name=name,
            nodes=tuple(n.name for n in nodes),
            flops_fwd=sum(n.flops_fwd for n in nodes),
            flops_bwd=sum(n.flops_bwd for n in nodes),
            param_bytes=param_bytes,
            activation_bytes=sum(n.output_bytes for n in nodes if not n.is_view and n.op != "input"),
        )

    @functools.cached_property
    def layer_list(self) -> list[Layer]:
        """`layers()`, computed once (the graph does not change after capture)."""
        return self.layers()

    def subgraph(self, names: list[str]) -> OpGraph:
        """The ops `names` as a graph of their own: tensors from outside enter as inputs (same names)."""
        keep = set(names)
        sub = nx.DiGraph()
        for n in self._order:
            if n not in keep:
                continue
            for src in self.graph.predecessors(n):
                if src not in keep and src not in sub:
                    node = self.node(src)
                    sub.add_node(src, op=OpNode(name=src, op="input", outputs=node.outputs, layer=node.layer,
                                                requires_grad=node.requires_grad))
            sub.add_node(n, op=self.node(n))
        for src, dst, data in self.graph.edges(data=True):
            if dst in keep and src in sub:
                sub.add_edge(src, dst, **data)
        used = {f for n in keep for f in self.node(n).params}
        outputs = [n for n in names if n in self.outputs or any(d not in keep for d in self.graph.successors(n))]
        sub = OpGraph(sub, params={f: t for f, t in self.params.items() if f in used},
                      buffers=self.buffers, outputs=outputs, warnings=self.warnings, fx_graph=self.fx_graph,
                      placeholders=self.placeholders, trainable=self.trainable & used, batch=self.batch)
        sub.precision = self.precision
        sub.parent = self
        return sub

    def fingerprint(self) -> str:
        """Structural hash: ops, shapes, dtypes, parameter names and edges; plans are keyed by it."""
        if self.captured_fingerprint is not None:
            return self.captured_fingerprint
        h = hashlib.sha256()
        for node in self:
            h.update(repr((node.name, node.op, node.inputs, node.outputs, sorted(node.params))).encode())
        for src, dst, nbytes in sorted(self.edges()):
            h.update(f"{src}>{dst}:{nbytes}".encode())
        return h.hexdigest()[:16]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
