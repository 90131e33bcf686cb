"""One stage graph on a logical mesh as the intra-op pass reads it: each op's einsum signature,
which inputs are tensors and which are (views of) parameters, the batch dimension the data axis
splits, follower groups and the anchor each follows, which op owns each parameter, and identical
layers tied to one ILP variable. Structure only: `strategy_costs` prices the choices, `edge_costs`
the tensors between groups."""

from __future__ import annotations

import hashlib
import operator
from dataclasses import dataclass
from typing import Any

from torch import fx

from autopar.cost_models import ClusterSpec, Link, axis_link
from autopar.planner import rules as L
from autopar.planner.graph import OpGraph
from autopar.planner.ilp import InfeasibleError
from autopar.planner.placement import R, shard, shard_dim


@dataclass(frozen=True)
class Mesh:
    """A logical mesh (dp, tp) laid over a submesh of the cluster, with the link of each axis."""

    dp: int
    tp: int
    dp_link: Link
    tp_link: Link

    @staticmethod
    def of(cluster: ClusterSpec, submesh: tuple[int, int], logical: tuple[int, int]) -> Mesh:
        return Mesh(logical[0], logical[1], axis_link(cluster, logical, 0, submesh), axis_link(cluster, logical, 1, submesh))


def whole_batch_dims(graph: OpGraph) -> tuple[dict[str, list[int | None]], dict[str, list[frozenset[int]]]]:
    """`StageGraph.batch` and `batch_sets` over the whole of `graph` (computed once): a subgraph's
    input is an op of its parent, whose batch dimensions only the parent's ops tell (a position
    index the size of the batch is not split by it)."""
    if graph._whole_batch is None:
        whole = StageGraph(graph, Mesh(1, 1, None, None))
        graph._whole_batch = whole.batch, whole.batch_sets
    return graph._whole_batch


class StageGraph:
    """Everything the ILP needs to know about one stage graph's structure on one mesh."""

    def __init__(self, graph: OpGraph, mesh: Mesh) -> None:
        self.graph, self.mesh = graph, mesh
        self.fx = graph.fx_nodes
        self.names = [n.name for n in graph]
        self.index = {name: i for i, name in enumerate(self.names)}
        self.sig = {name: self._signature(name) for name in self.names}
        self.param_views = self._param_views()
        self.batch = self._batch_dims()
        self.batch_sets = self._batch_sets()
        self._check_batch()
        self.root = self._roots()
        self.owner, self.param_users = self._param_owners()
        self.owning_groups = {self.root[n] for n in self.owner.values()}  # groups that store a weight
        self._size_cache: dict[str, dict[str, int]] = {}
        self._batch_letter_cache: dict[str, set[str]] = {}
        self.members: dict[str, list[str]] = {}
        for name in self.names:
            if self.root.get(name):
                self.members.setdefault(self.root[name], []).append(name)

    def _signature(self, name: str) -> L.Signature:
        node = self.graph.node(name)
        if node.op == "input":
            letters = "abcdefgh"[: len(node.outputs[0].shape)] if node.outputs else ""
            return L.Signature([], [letters], L.ANCHOR, set(letters))
        return L.signature(self.fx[name])  # without a rule: replicated (`planner.unruled` says so once)

    def tensor_inputs(self, name: str) -> list[tuple[int, str | None]]:
        """(position in fx all_input_nodes, producer op name, or None for parameters, their views,
        buffers and constants)."""
        if self.graph.node(name).op == "input":
            return []
        return [(i, n.name if n.name in self.index and n.name not in self.param_views else None)
                for i, n in enumerate(self.fx[name].all_input_nodes)]

    def _param_views(self) -> dict[str, tuple[str, list[str]]]:
        """Views of a parameter (e.g. `W.t()`): node -> (FQN, the view nodes from the parameter to it).

        They are not ops of their own: the consumer's placement maps back through them to the weight."""
        out: dict[str, tuple[str, list[str]]] = {}
        for name in self.names:
            node = self.fx.get(name)
            if node is None or not self.sig[name].view or len(node.all_input_nodes) != 1:
                continue
            src = node.all_input_nodes[0].name
            fqn = self.graph.placeholders.get(src)
            if fqn in self.graph.params:
                out[name] = (fqn, [name])
            elif src in out:
                out[name] = (out[src][0], out[src][1] + [name])
        return out

    def param_input(self, name: str, i: int, placement: str) -> tuple[str | None, str]:
        """The parameter input i of `name` reads (directly or through views), and its placement there."""
        src = self.fx[name].all_input_nodes[i].name
        if src in self.param_views:
            fqn, chain = self.param_views[src]
            for view in reversed(chain):  # map the placement back through each view's letters
                d = shard_dim(placement)
                if d is not None:
                    letter = self.sig[view].outputs[0][d]
                    placement = shard(self.sig[view].inputs[0].index(letter)) if letter in self.sig[view].inputs[0] else R
            return fqn, placement
        fqn = self.graph.placeholders.get(src)
        return (fqn if fqn in self.graph.params else None), placement

    def _check_batch(self) -> None:
        """The data axis splits every batch dimension: it must divide them."""
        if self.mesh.dp == 1:
            return
        for name in self.names:
            for k, d in enumerate(self.batch[name]):
                size = self.graph.node(name).outputs[k].shape[d] if d is not None else None
                if size is not None and size % self.mesh.dp:
                    raise InfeasibleError(
                        f"data-parallel size {self.mesh.dp} does not divide the batch dimension ({size}) of {name}",
                        least_memory=0.0)

    def _batch_dims(self) -> dict[str, list[int | None]]:
        """Which dimension of each output is the batch (split on the data axis), if any."""
        out: dict[str, list[int | None]] = {}
        for name in self.names:
            sig = self.sig[name]
            node = self.graph.node(name)
            if node.op == "input":
                if self._made_before(name):
                    out[name] = whole_batch_dims(self.graph.parent)[0][name]
                    continue
                # the model's own inputs: the batch is dim 0 where it is the model's batch
                same = bool(node.outputs) and node.outputs[0].shape[:1] == (self.graph.batch,)
                out[name] = [0 if sig.outputs[0] and same else None]
                continue
            letter = None
            for i, src in self.tensor_inputs(name):
                if src is None or sig.inputs[i] is None:
                    continue
                d = self.batch_of(src, self.out_index(name, src), out)
                # the first input whose batch letter the op keeps (not one it gathers away: `x[arange(b), eos]`)
                if d is not None and d < len(sig.inputs[i]) and any(sig.inputs[i][d] in o for o in sig.outputs):
                    letter = sig.inputs[i][d]
                    break
            if letter is None and self._sized_by_batch(name, node, sig):
                out[name] = [0]  # a buffer broadcast to the batch (BERT's token types): every rank expands to its slice
                continue
            if letter is None and sig.kind == L.UNKNOWN:
                out[name] = self._kept_length(name, node, out)
                continue
            out[name] = [o.find(letter) if letter and letter in o else None for o in sig.outputs]
        return out

    def _made_before(self, name: str) -> bool:
        """Whether input `name` is an op of the graph this stage was cut from, made before it: its
        batch dimensions are the whole graph's (`whole_batch_dims`), not guessed from its size."""
        parent = self.graph.parent
        return parent is not None and name in parent.graph and parent.node(name).op != "input"

    def _kept_length(self, name: str, node, batch: dict) -> list[int | None]:
        """An op without a rule keeps a batch dimension where its output has one as long as its
        input's (an MoE router's argsort of its tokens by expert, and the division that maps them
        back): each rank's output is as long as its slice. Its letters are its own, so nothing stays
        split on the tensor axis through it."""
        for i, src in self.tensor_inputs(name):
            d = self.batch_of(src, self.out_index(name, src), batch) if src is not None else None
            shape = self.fx[name].all_input_nodes[i].meta.get("val")
            if d is not None and hasattr(shape, "shape") and d < len(shape.shape):
                n = shape.shape[d]
                return [next((j for j, size in enumerate(t.shape) if size == n), None) for t in node.outputs]
        return [None for _ in node.outputs]

    def _sized_by_batch(self, name: str, node, sig) -> bool:
        """An expand whose dimension 0 is new (broadcast from size 1, or prepended) and the batch's
        size, a repeat that tiles dimension 0 as many times as the batch has samples (DeBERTa's
        relative positions, once per sample and head), or a tensor of two or more dimensions made
        from nothing whose first is the batch's size (not a square of it: a causal mask as long as
        the batch): the model sized it from its input's batch, which the runtime traces at each
        rank's slice. (Export fixes sizes, so these are read from sizes.)"""
        shape = node.outputs[0].shape if node.outputs else ()
        if sig.kind == L.SOURCE:  # made from nothing: `torch.ones(b, s)`, OPT's mask for its positions
            return len(shape) >= 2 and shape[0] == self.graph.batch and set(shape) != {shape[0]}
        if not shape or not sig.outputs[0][:1].isupper():
            return False
        if node.op == "aten.expand.default":
            return shape[0] == self.graph.batch
        return node.op == "aten.repeat.default" and list(self.fx[name].args[1])[:1] == [self.graph.batch]

    def _batch_sets(self) -> dict[str, list[frozenset[int]]]:
        """Every dimension of each output that is the batch's (`batch` names the first): CLIP's
        image-text similarities have two, and shrink by the data axis and the microbatches twice."""
        out: dict[str, list[frozenset[int]]] = {}
        for name in self.names:
            sig, node, first = self.sig[name], self.graph.node(name), self.batch[name]
            if node.op == "input" and self._made_before(name):
                out[name] = whole_batch_dims(self.graph.parent)[1][name]
                continue
            letters: set[str] = set()
            for i, src in self.tensor_inputs(name):
                if src is not None and sig.inputs[i] is not None:
                    k = self.out_index(name, src)
                    dims = out[src][k] if k < len(out[src]) else ()
                    letters |= {sig.inputs[i][d] for d in dims if d < len(sig.inputs[i])}
            out[name] = [frozenset() if d is None else frozenset({d} | {j for j, c in enumerate(o) if c in letters})
                         for o, d in zip(sig.outputs, first)]
        return out

    def batch_of(self, name: str, k: int, batch: dict | None = None) -> int | None:
        dims = (self.batch if batch is None else batch).get(name) or []
        return dims[k] if k < len(dims) else None

    def out_index(self, consumer: str, producer: str) -> int:
        """Which output of `producer` the consumer reads (getitem picks one; others read the first)."""
        node = self.fx.get(consumer)
        if node is not None and node.target is operator.getitem and len(self.sig[producer].outputs) > 1:
            return node.args[1]
        return 0

    def _roots(self) -> dict[str, str | None]:
        """Each follower joins the group of its largest input (the latest among equals): `eq(x, arange)`
        follows x, not the broadcast index; anchors, sources and unknowns lead one."""
        root: dict[str, str | None] = {}
        for name in self.names:
            sig = self.sig[name]
            if sig.kind == L.NOOP or name in self.param_views:
                root[name] = None
                continue
            if sig.kind == L.FOLLOWER:
                producers = [(i, src) for i, src in self.tensor_inputs(name) if src and root.get(src) and sig.inputs[i]]
                if producers:
                    root[name] = root[max(producers, key=lambda p: self.lead_key(name, *p))[1]]
                    continue
            root[name] = name
        return root

    def _param_owners(self) -> tuple[dict[str, str], dict[str, set[str]]]:
        """Each parameter's first user (through views: it stores and synchronises the weight), and
        the groups of all its users (they must agree on its placement, or pay to move it)."""
        owner: dict[str, str] = {}
        users: dict[str, set[str]] = {}
        for name in self.names:
            if self.root.get(name) is None:
                continue
            for i, _ in self.tensor_inputs(name):
                fqn, _ = self.param_input(name, i, R)
                if fqn is not None:
                    owner.setdefault(fqn, name)
                    users.setdefault(fqn, set()).add(self.root[name])
        return owner, users

    def sizes(self, name: str) -> dict[str, int]:
        if name not in self._size_cache:
            self._size_cache[name] = self._letter_sizes(name)
        return self._size_cache[name]

    def _letter_sizes(self, name: str) -> dict[str, int]:
        node = self.graph.node(name)
        ins = [None] * len(self.sig[name].inputs)
        if node.op != "input":
            for i, n in enumerate(self.fx[name].all_input_nodes):
                val = n.meta.get("val")
                ins[i] = tuple(val.shape) if hasattr(val, "shape") else None
        return L.letter_sizes(self.sig[name], ins, [t.shape for t in node.outputs])

    def batch_letters(self, name: str) -> set[str]:
        if name not in self._batch_letter_cache:
            self._batch_letter_cache[name] = self._find_batch_letters(name)
        return self._batch_letter_cache[name]

    def _find_batch_letters(self, name: str) -> set[str]:
        sig = self.sig[name]
        found = {o[d] for o, d in zip(sig.outputs, self.batch[name]) if d is not None and d < len(o)}
        for i, src in self.tensor_inputs(name):
            if src and sig.inputs[i] is not None:
                d = self.batch_of(src, self.out_index(name, src))
                if d is not None and d < len(sig.inputs[i]):
                    found.add(sig.inputs[i][d])
        return found

    def divisible(self, name: str, letter: str) -> bool:
        n = self.mesh.tp * (self.mesh.dp if letter in self.batch_letters(name) else 1)
        size = self.sizes(name).get(letter, 0)
        return size >= n and size % n == 0

    def grad(self, name: str | None) -> bool:
        return bool(name) and self.graph.node(name).requires_grad

    def free_output(self, name: str) -> str | None:
        """The placement a model's output leaves in without a collective: split along dimension 0
        where that is a batch dimension (the runtime then computes the loss per shard:
        `ShardedGraph.output_shard`); None where it is not (every other placement is gathered)."""
        sets = self.batch_sets.get(name) or []
        return shard(0) if sets and 0 in sets[0] else None

    def batch_rank(self, name: str, k: int = 0) -> int:
        """How many dimensions of output k are the batch's (each shrinks with the data axis and the microbatch)."""
        sets = self.batch_sets.get(name) or []
        return len(sets[k]) if k < len(sets) else 0

    def dp_share(self, name: str, out_index: int = 0) -> int:
        return self.mesh.dp ** self.batch_rank(name, out_index)

    def in_bytes(self, name: str, i: int, src: str | None) -> float:
        """Bytes per data-parallel rank of input i (the full tensor on the tensor axis)."""
        val = self.fx[name].all_input_nodes[i].meta.get("val")
        nbytes = val.numel() * val.element_size() if hasattr(val, "numel") else 0
        return nbytes / (self.dp_share(src, self.out_index(name, src)) if src else 1)

    def collective(self, node: str, kind: str, phase: str, nbytes: float, axis: str, tensor: str | None = None,
                   **flags: Any) -> dict:
        """One priced collective (`StageSharding.collectives`) at `node`, moving `tensor` (read by
        `node`, or its own output), with how many batch dimensions it has (`batch_dims`: 0, every
        microbatch moves it whole; 2, a microbatch moves a quarter of what one of half the size
        does; `intra_op.program_collectives`)."""
        dims = 1 if tensor is None else self.batch_rank(tensor, 0 if tensor == node else self.out_index(node, tensor))
        return {"node": node, "kind": kind, "phase": phase, "bytes": nbytes, "axis": axis, "tensor": tensor,
                **flags, **({"batch_dims": dims} if dims != 1 else {})}

    def sharers(self, src: str) -> int:
        """Consumers whose partial gradients of src add up locally before the one collective that
        completes them (its cost is shared among them)."""
        return max(1, sum(1 for n in self.graph.graph.successors(src) if self.sig[n].kind == L.ANCHOR))

    def first_sharer(self, src: str, name: str) -> bool:
        anchors = [n for n in self.graph.graph.successors(src) if self.sig[n].kind == L.ANCHOR]
        return not anchors or min(anchors, key=self.index.get) == name  # lists the shared collective once

    def tie(self, strategies: dict[str, list]) -> None:
        """Anchors at the same position of identical layers share one ILP variable (`cls`).

        Only the first of each is evaluated: `canon(n)` names the node whose placements stand for
        n's, and `group(n)` the anchor whose variable decides them.
        """
        rep = _representatives(self.graph)
        self.cls = {}
        for a in (n for n in self.names if self.root.get(n) == n):
            b = rep.get(a, a)
            same = (b != a and self.root.get(b) == b and len(strategies[a]) == len(strategies[b])
                    and len(self.members[a]) == len(self.members[b])
                    and all(rep.get(m) == mb for m, mb in zip(self.members[a], self.members[b])))
            self.cls[a] = b if same else a
        self.rep = rep

    def group(self, name: str) -> str:
        return self.cls[self.root[name]]

    def canon(self, name: str) -> str:
        return self.rep.get(name, name) if self.group(name) != self.root[name] else name

    def cross_edges(self):
        """(producer, consumer, input position) of every tensor whose placement an edge decides:
        all inputs of anchors, and the inputs of followers other than the one they follow; a scalar
        (0-d) one only where it takes a gradient, which a split consumer leaves partial (CLIP's
        learnable logit scale times split similarities)."""
        for name in self.names:
            if self.root.get(name) is None:
                continue
            primary = self.primary(name)
            for i, src in self.tensor_inputs(name):
                letters = self.sig[name].inputs[i]
                if src is not None and self.root.get(src) is not None and src != primary and (
                        letters or letters == "" and self.grad(src)):
                    yield src, name, i

    def primary(self, name: str) -> str | None:
        if self.sig[name].kind != L.FOLLOWER or self.root[name] == name:
            return None
        return max(((i, s) for i, s in self.tensor_inputs(name) if s and self.root.get(s) == self.root[name]
                    and self.sig[name].inputs[i]), key=lambda p: self.lead_key(name, *p))[1]

    def lead_key(self, name: str, i: int, src: str) -> tuple[int, int]:
        val = self.fx[name].all_input_nodes[i].meta.get("val")
        return (val.numel() if hasattr(val, "numel") else 0, self.index[src])


def _representatives(graph: OpGraph) -> dict[str, str]:
    """Node -> the node at the same position of the first identical layer (structural hash)."""
    first: dict[str, tuple[str, ...]] = {}
    rep: dict[str, str] = {}
    for layer in graph.layers():
        h = layer_hash(graph, layer.nodes)
        if h in first and len(first[h]) == len(layer.nodes):
            rep.update(zip(layer.nodes, first[h]))
        else:
            first[h] = layer.nodes
    return rep


def layer_hash(graph: OpGraph, nodes: tuple[str, ...]) -> str:
    """Structure of a layer without names: ops, shapes, parameter shapes and internal wiring."""
    pos = {n: i for i, n in enumerate(nodes)}
    h = hashlib.sha256()
    for n in nodes:
        node = graph.node(n)
        preds = sorted(pos.get(p, -1) - pos[n] if p in pos else -10**6 for p in graph.graph.predecessors(n))
        params = [(graph.params[f].shape, graph.params[f].dtype) for f in node.params]
        fx_node = graph.fx_nodes.get(n)  # scalar arguments too: transpose dims, softmax dim, is_causal
        scalars = repr(fx.node.map_arg((fx_node.args, fx_node.kwargs), lambda _: None)) if fx_node is not None else ""
        h.update(repr((node.op, node.inputs, node.outputs, params, preds, scalars)).encode())
    return h.hexdigest()
