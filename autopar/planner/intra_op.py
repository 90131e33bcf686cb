"""Intra-op pass: the sharding of every op of a stage on a logical mesh (dp, tp), by ILP.

1. Describe each op as an einsum (`letters.py`). Anchors (matmuls, convolutions, embeddings,
   norms, softmax, attention, unknown ops) choose which letter the tensor axis splits, or none;
   followers (element-wise ops, views, reductions) are merged into the producer they read last,
   and carry its placement through their letters (Alpa's rule).
2. The data axis always splits the batch: a tensor's batch dimension is propagated from the
   inputs through the letters. Parameters on it are `R` (gradients all-reduced) or `S(0)`
   (ZeRO-3: gathered before use, gradients reduce-scattered) — a choice per anchor.
3. Each (anchor, strategy) gets a cost: roofline compute on the sharded shapes, forward and
   backward collectives inside the op, gradient synchronisation of its parameters, and memory
   (model states + activations). Each edge gets the cost of redistributing the tensor from the
   producer's placement to the one the consumer needs, both ways.
4. Identical layers (same structural hash) share their variables, so the ILP (`ilp.py`) has one
   copy of a repeated block however many layers the stage holds.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from torch import fx

from autopar.contract.precision import PRECISIONS
from autopar.cost_models import (
    ClusterSpec,
    Link,
    axis_link,
    collective_time,
    compute_time,
    fixed_time,
    model_state_memory,
)
from autopar.cost_models.comm import all_reduce_latency
from autopar.planner import rules as L
from autopar.planner.graph import OpGraph, OpNode
from autopar.planner.ilp import InfeasibleError, Problem, solve
from autopar.planner.placement import (
    P,
    R,
    edge_time,
    redistribution,
    redistribution_time,
    shard,
    shard_dim,
)

log = logging.getLogger(__name__)

DTYPE_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}


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


@dataclass(frozen=True)
class Rule:
    """A layout convention as a constraint: which letters an anchor may split (None: replicated)."""

    # (signature, op, its batch letters) -> the letters allowed; None: any
    letters: Callable[[L.Signature, OpNode, set[str]], set[str | None]] | None
    zero: bool = True  # whether ZeRO-3 may be chosen on the data axis
    zero_only: bool = False  # ZeRO-3 wherever it may be: every weight sharded over the data axis (FSDP)
    # ZeRO-2 along the tensor axis: a weight replicated on it, whose gradient it all-reduces (the
    # axis is data-parallel for that weight, as in DeepSpeed-MoE), keeps 1/tp of its gradient
    # and optimizer state; the all-reduce becomes reduce-scatter + all-gather, the same bytes.
    # Only layouts priced for comparison set it (DeepSpeed-MoE): the runtime does not shard those
    # states, so the searches that plan runs (no rule, `REPLICATED_GRADIENTS`) do not promise it
    shard_states: bool = False


# the free search with gradients replicated on the data axis, which compressors need
REPLICATED_GRADIENTS = Rule(letters=None, zero=False)


@dataclass(frozen=True)
class Strategy:
    letter: str | None  # the letter the tensor axis splits (None: replicated on it)
    zero: bool  # parameters sharded on the data axis (ZeRO-3)
    shard_states: bool = False  # see Rule.shard_states


@dataclass
class _Eval:
    """One strategy of one anchor group: placements of its nodes and what they cost."""

    out: dict[str, list[str]] = field(default_factory=dict)  # node -> tp placement per output
    need: dict[str, list[str | None]] = field(default_factory=dict)  # node -> tp placement it needs per input
    params: dict[str, str] = field(default_factory=dict)  # fqn -> tp placement
    compute: float = 0.0
    fixed: float = 0.0  # the part of `compute` that does not shrink with the batch: per op, per microbatch
    comm: float = 0.0
    grad_sync: float = 0.0
    state_memory: float = 0.0
    activation_memory: float = 0.0
    weight_copies: float = 0.0  # 16-bit copies of weights autocast makes, per microbatch (`autopar.precision`)
    gathered: float = 0.0  # ZeRO-3: the whole parameters and their gradients during the step (FSDP2)
    zero_gather: float = 0.0  # ZeRO-3's all-gathers' bytes (forward and backward), part of `comm`: per microbatch
    zero_scatter: float = 0.0  # ZeRO-3's gradient reduce-scatter, again for every microbatch
    param_states: dict[str, float] = field(default_factory=dict)  # fqn -> its share of state_memory
    grad_memory: float = 0.0  # the gradients' part of state_memory (allocated by the step's first backward)
    collectives: list[tuple] = field(default_factory=list)  # (node, kind, phase, bytes[, axis]); axis tp if absent
    letters: dict[str, str | None] = field(default_factory=dict)  # node -> the letter split on the tensor axis
    partial: dict[str, set[int]] = field(default_factory=dict)  # node -> inputs whose gradient it leaves partial
    tp_grad_sync: bool = False  # some parameter's gradient is reduced over the tensor axis

    @property
    def time(self) -> float:
        return self.compute + self.comm + self.grad_sync


@dataclass
class StageSharding:
    """The intra-op result for one stage: the `params`, `ops` and `cost` of a plan stage."""

    logical_mesh: tuple[int, int]
    params: dict[str, list[str]]
    ops: dict[str, list[str]]
    cost: dict[str, float]
    memory: dict[str, float]
    solver: dict[str, Any]
    collectives: list[dict[str, Any]]
    needs: dict[str, list[str | None]] = field(default_factory=dict)  # see StagePlan.needs
    param_states: dict[str, float] = field(default_factory=dict)  # fqn -> its part of memory["model_states"]
    strategies: dict[str, Strategy] = field(default_factory=dict)  # anchor -> the strategy chosen for it
    # (size at the whole batch, dp × tp) of each batch dimension the tensor axis splits: a microbatch
    # count m holds only where every such size leaves ≥ 2 per rank (`StageCosts.splits_microbatch`)
    tp_batch: frozenset[tuple[int, int]] = frozenset()

    @property
    def time(self) -> float:
        return self.cost["total_s"]


def gathered_bytes(graph: OpGraph, fqn: str, shards: int) -> float:
    """What FSDP2 holds of a ZeRO-3 parameter while its unit is gathered: the whole parameter (in
    the run's precision), its unsharded gradient (same dtype) and the reduce-scatter's input
    buffer (the parameter's own dtype, fp32 under mixed precision); `shards`: its tensor-axis split."""
    info = graph.params[fqn]
    own = DTYPE_BYTES.get(info.dtype, 4)
    width = PRECISIONS[graph.precision].itemsize if graph.precision else own
    return math.prod(info.shape) / shards * (2 * width + own)


class _Stage:
    """Everything the ILP needs about one stage graph on one mesh."""

    def __init__(self, graph: OpGraph, cluster: ClusterSpec, mesh: Mesh) -> None:
        self.graph, self.cluster, self.mesh = graph, cluster, mesh
        self.fx = graph.fx_nodes
        self.names = [n.name for n in graph]
        self.index = {name: i for i, name in enumerate(self.names)}
        self.sig = {name: self._signature(name) for name in self.names}
        self.param_views = self._param_views()
        self.batch = self._batch_dims()
        self._check_batch()
        self.root = self._roots()
        self.owner = self._param_owners()
        self.owning_groups = {self.root[n] for n in self.owner.values()}  # groups that store a weight
        self._size_cache: dict[str, dict[str, int]] = {}
        self._batch_letter_cache: dict[str, set[str]] = {}
        self.members: dict[str, list[str]] = {}
        for name in self.names:
            if self.root.get(name):
                self.members.setdefault(self.root[name], []).append(name)

    # ---- structure -------------------------------------------------------------------------

    def _signature(self, name: str) -> L.Signature:
        node = self.graph.node(name)
        if node.op == "input":
            letters = "abcdefgh"[: len(node.outputs[0].shape)] if node.outputs else ""
            return L.Signature([], [letters], L.ANCHOR, set(letters))
        sig = L.signature(self.fx[name])
        warning = f"no sharding rule for {node.op}: it runs replicated"
        if sig.kind == L.UNKNOWN and warning not in self.graph.warnings:  # once per op kind and graph
            self.graph.warnings.append(warning)
            log.warning("%s (first: %s)", warning, name)
        return sig

    def _tensor_inputs(self, name: str) -> list[tuple[int, str | None]]:
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

    def _param_input(self, name: str, i: int, placement: str) -> tuple[str | None, str]:
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
            if node.op == "input":  # the batch is dim 0 of the inputs as long as the model's batch
                same = bool(node.outputs) and node.outputs[0].shape[:1] == (self.graph.batch,)
                out[name] = [0 if sig.outputs[0] and same else None]
                continue
            letter = None
            for i, src in self._tensor_inputs(name):
                if src is None or sig.inputs[i] is None:
                    continue
                d = self._batch_of(src, self._out_index(name, src), out)
                if d is not None and d < len(sig.inputs[i]):
                    letter = sig.inputs[i][d]
                    break
            out[name] = [o.find(letter) if letter and letter in o else None for o in sig.outputs]
        return out

    def _batch_of(self, name: str, k: int, batch: dict | None = None) -> int | None:
        dims = (self.batch if batch is None else batch).get(name) or []
        return dims[k] if k < len(dims) else None

    def _out_index(self, consumer: str, producer: str) -> int:
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
                producers = [(i, src) for i, src in self._tensor_inputs(name) if src and root.get(src) and sig.inputs[i]]
                if producers:
                    root[name] = root[max(producers, key=lambda p: self._lead_key(name, *p))[1]]
                    continue
            root[name] = name
        return root

    def _param_owners(self) -> dict[str, str]:
        """Each parameter's first user (through views): it stores and synchronises the weight."""
        owner: dict[str, str] = {}
        for name in self.names:
            if self.root.get(name) is None:
                continue
            for i, _ in self._tensor_inputs(name):
                fqn, _ = self._param_input(name, i, R)
                if fqn is not None:
                    owner.setdefault(fqn, name)
        return owner

    # ---- strategies and their costs --------------------------------------------------------

    def strategies(self, anchor: str, rule: Rule | None = None) -> list[Strategy]:
        """The tensor-axis splits an anchor may take (narrowed by a layout rule), each with and
        without ZeRO-3 on the data axis when the group holds parameters. The batch is the data
        axis's: the shardings are solved at the whole batch, and a batch split on the tensor axis
        that divides the whole batch need not divide a microbatch (the runtime cannot run it), so
        the search's tensor axis splits other letters (or none). A layout rule that names its
        letters may still split the batch there (DeepSpeed-MoE's every-device data parallelism);
        `StageCosts.splits_microbatch` keeps such a stage to microbatches it divides."""
        sig = self.sig[anchor]
        letters: list[str | None] = [None]
        if sig.kind in (L.ANCHOR,) and self.mesh.tp > 1:
            sizes = self._sizes(anchor)
            batch_letters = self._batch_letters(anchor)
            for c in sorted(sig.shardable):
                if c in batch_letters and (rule is None or rule.letters is None):
                    continue
                n = self.mesh.tp * (self.mesh.dp if c in batch_letters else 1)
                if c in sizes and sizes[c] % n == 0 and sizes[c] >= n:
                    if any(c in o for o in sig.outputs) or sig.linear:
                        letters.append(c)
        if rule is not None and rule.letters is not None:
            allowed = rule.letters(sig, self.graph.node(anchor), self._batch_letters(anchor))
            letters = [c for c in letters if c in allowed] or [None]
        has_params = anchor in self.owning_groups
        zeros = [False, True] if has_params and self.mesh.dp > 1 and (rule is None or rule.zero) else [False]
        zeros = [True] if rule is not None and rule.zero_only and True in zeros else zeros
        return [Strategy(c, z, rule is not None and rule.shard_states) for c in letters for z in zeros]

    def _sizes(self, name: str) -> dict[str, int]:
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

    def _batch_letters(self, name: str) -> set[str]:
        if name not in self._batch_letter_cache:
            self._batch_letter_cache[name] = self._find_batch_letters(name)
        return self._batch_letter_cache[name]

    def _find_batch_letters(self, name: str) -> set[str]:
        sig = self.sig[name]
        found = {o[d] for o, d in zip(sig.outputs, self.batch[name]) if d is not None and d < len(o)}
        for i, src in self._tensor_inputs(name):
            if src and sig.inputs[i] is not None:
                d = self._batch_of(src, self._out_index(name, src))
                if d is not None and d < len(sig.inputs[i]):
                    found.add(sig.inputs[i][d])
        return found

    def evaluate(self, anchor: str, strategy: Strategy) -> _Eval:
        ev = _Eval()
        for name in self.members[anchor]:
            if name == anchor:
                self._place_anchor(ev, name, strategy.letter)
            else:
                self._place_follower(ev, name)
            self._cost_node(ev, name, strategy)
        return ev

    def _place_anchor(self, ev: _Eval, name: str, letter: str | None) -> None:
        sig = self.sig[name]
        ev.letters[name] = letter
        ev.need[name] = [self._placement_of(letter, ls) if ls is not None else None for ls in sig.inputs]
        ev.out[name] = [self._placement_of(letter, ls, partial=sig.linear) for ls in sig.outputs]

    @staticmethod
    def _placement_of(letter: str | None, letters: str, partial: bool = False) -> str:
        if letter is None:
            return R
        if letter in letters:
            return shard(letters.index(letter))
        return P if partial else R

    def _place_follower(self, ev: _Eval, name: str) -> None:
        """Carry the primary input's placement through the follower's letters; resolve what cannot pass."""
        sig = self.sig[name]
        inputs = self._tensor_inputs(name)
        primary_i, primary = max(((i, s) for i, s in inputs if s and self.root.get(s) == self.root[name]
                                  and sig.inputs[i]), key=lambda t: self._lead_key(name, *t))
        have = ev.out[primary][self._out_index(name, primary)]
        letter = None
        ev.letters[name] = None
        if have == P and sig.view:
            ev.need[name] = [P if i == primary_i else None for i, _ in inputs]
            ev.out[name] = [P for _ in sig.outputs]
            return
        d = shard_dim(have)
        if d is not None:
            c = sig.inputs[primary_i][d]
            outs_with = [c in o for o in sig.outputs]
            if all(outs_with) and self._divisible(name, c):
                letter = c
            elif sig.linear and not any(outs_with):
                ev.need[name] = [have if i == primary_i else None for i, _ in inputs]
                ev.out[name] = [P for _ in sig.outputs]
                return
        if letter is None and have != R:  # the placement cannot pass: gather or reduce first
            nbytes = self._in_bytes(name, primary_i, primary)
            ev.comm += edge_time(have, R, nbytes, self.mesh.tp, self.mesh.tp_link, self._grad(primary))
            self._record(ev, name, have, R, nbytes)
        ev.letters[name] = letter
        ev.need[name] = [self._placement_of(letter, ls) if ls is not None else None for ls in sig.inputs]
        ev.need[name][primary_i] = have if letter is not None else R
        ev.out[name] = [self._placement_of(letter, ls) for ls in sig.outputs]

    def _divisible(self, name: str, letter: str) -> bool:
        n = self.mesh.tp * (self.mesh.dp if letter in self._batch_letters(name) else 1)
        size = self._sizes(name).get(letter, 0)
        return size >= n and size % n == 0

    def _grad(self, name: str | None) -> bool:
        return bool(name) and self.graph.node(name).requires_grad

    def _dp_share(self, name: str, out_index: int = 0) -> int:
        return self.mesh.dp if self._batch_of(name, out_index) is not None else 1

    def _in_bytes(self, name: str, i: int, src: str | None) -> float:
        """Bytes per data-parallel rank of input i (the full tensor on the tensor axis)."""
        val = self.fx[name].all_input_nodes[i].meta.get("val")
        nbytes = val.numel() * val.element_size() if hasattr(val, "numel") else 0
        return nbytes / (self._dp_share(src, self._out_index(name, src)) if src else 1)

    def _record(self, ev: _Eval, name: str, src: str, dst: str, nbytes: float, phase: str = "forward") -> None:
        for kind, f in redistribution(src, dst, self.mesh.tp):
            ev.collectives.append((name, kind.value, phase, nbytes * f))

    def _cost_node(self, ev: _Eval, name: str, strategy: Strategy) -> None:
        node, sig, mesh = self.graph.node(name), self.sig[name], self.mesh
        if node.op == "input" or sig.kind == L.NOOP:
            return
        split = any(shard_dim(p) is not None for p in ev.out[name]) or (P in ev.out[name] and not sig.view)
        tp_share = mesh.tp if split else 1
        batched = any(d is not None for d in self.batch[name]) or self._batch_letters(name)
        dp_share = mesh.dp if batched and sig.kind != L.UNKNOWN else 1
        # every op is issued forward and, when a gradient flows through it, again in backward; on
        # DTensors (split on the tensor axis, or reading split inputs) at DTensor's cost
        ops = 1 + self._grad(name)
        sharded = mesh.tp > 1 and (split or any(p not in (None, R) for p in ev.need.get(name, ())))
        device = self.cluster.device
        dtype = node.outputs[0].dtype if node.outputs else "float32"
        matmuls = (1 + 2 * self._grad(name)) if node.flops_fwd and not node.is_view else 0  # and both gradients
        fixed = fixed_time(device, dtype, ops, matmuls, sharded)
        ev.fixed += 0.0 if device.asynchronous else fixed  # paid again by every microbatch
        if node.is_view:
            ev.compute += fixed
        else:
            ev.compute += compute_time((node.flops_fwd + node.flops_bwd) / (dp_share * tp_share),
                                       3 * (node.bytes_read + node.bytes_written) / (dp_share * tp_share),
                                       device, dtype, ops=ops, matmuls=matmuls, sharded=sharded)
            for k, out in enumerate(node.outputs):  # what backward keeps of it (all, when unknown)
                if node.saved_outputs is None or k in node.saved_outputs:
                    shared = mesh.tp if shard_dim(ev.out[name][k]) is not None else 1
                    ev.activation_memory += out.nbytes / (self._dp_share(name, k) * shared)
            ev.activation_memory += (node.cast_bytes + node.saved_hidden) / (dp_share * tp_share)
        if sig.kind == L.UNKNOWN and mesh.dp > 1:  # runs on whole tensors: gather the batch first
            for i, src in self._tensor_inputs(name):
                if src and self._batch_of(src, self._out_index(name, src)) is not None:
                    nbytes = self._in_bytes(name, i, src) * mesh.dp
                    ev.comm += collective_time("all_gather", nbytes, mesh.dp, mesh.dp_link)
                    ev.collectives.append((name, "all_gather", "forward", nbytes, "dp"))
        letter, out_letters = ev.letters.get(name), "".join(sig.outputs)
        for i, src in self._tensor_inputs(name):
            if sig.inputs[i] is None:
                continue
            # the split letter is summed out of this input's gradient: its shards hold partial sums
            partial = letter is not None and letter in out_letters and letter not in sig.inputs[i]
            fqn, placement = self._param_input(name, i, ev.need[name][i] or R)
            if fqn is not None:
                self._cost_param(ev, name, fqn, placement, strategy, partial)
            elif partial and self.root.get(src) is not None and src != self._primary(name):
                ev.partial.setdefault(name, set()).add(i)  # the edge prices it: it depends on src's placement
            elif partial and self._grad(src):
                nbytes = self._in_bytes(name, i, src)
                ev.comm += collective_time("all_reduce", nbytes, mesh.tp, mesh.tp_link) / self._sharers(src)
                if self._first_sharer(src, name):
                    ev.collectives.append((name, "all_reduce", "backward", nbytes))

    def _sharers(self, src: str) -> int:
        """Consumers whose partial gradients of src add up locally before the one collective that
        completes them (its cost is shared among them)."""
        return max(1, sum(1 for n in self.graph.graph.successors(src) if self.sig[n].kind == L.ANCHOR))

    def _first_sharer(self, src: str, name: str) -> bool:
        anchors = [n for n in self.graph.graph.successors(src) if self.sig[n].kind == L.ANCHOR]
        return not anchors or min(anchors, key=self.index.get) == name  # lists the shared collective once

    def _cost_param(self, ev: _Eval, name: str, fqn: str, placement: str, strategy: Strategy, partial: bool) -> None:
        """Model states and gradient synchronisation of one parameter.

        Every user whose split leaves the weight's gradient partial all-reduces it on the tensor axis;
        the first user stores the weight and synchronises it on the data axis. Gradients move in
        buckets (as DDP and FSDP do): a parameter pays the bandwidth of its bytes, the per-message
        latency is paid per bucket (`_bucket_latency`)."""
        ev.params[fqn] = placement
        info, mesh, zero = self.graph.params[fqn], self.mesh, strategy.zero
        shards = mesh.tp if shard_dim(placement) is not None else 1
        local = info.nbytes / shards
        dp_bw, tp_bw = mesh.dp_link.bandwidth_only(), mesh.tp_link.bandwidth_only()
        trainable = fqn in self.graph.trainable
        syncs = []
        if trainable and partial and mesh.tp > 1:
            syncs.append(("tp", "all_reduce", "gradient", mesh.tp, tp_bw))
            ev.tp_grad_sync = True
        if self.owner[fqn] == name:
            if trainable and mesh.dp > 1 and zero:  # ZeRO-3: gathered for every forward and backward, a
                # layer's weights in one collective (FSDP2's unit): their α once per stage solve (`_unit_latency`)
                for phase in ("forward", "backward"):
                    ev.comm += collective_time("all_gather", local, mesh.dp, dp_bw)
                    ev.collectives.append((name, "all_gather", phase, local, "dp", "unit"))
                ev.zero_gather += 2 * collective_time("all_gather", local, mesh.dp, dp_bw)
                ev.zero_scatter += collective_time("reduce_scatter", local, mesh.dp, dp_bw)
                syncs.append(("dp", "reduce_scatter", "gradient", mesh.dp, dp_bw))
            elif trainable and mesh.dp > 1:
                syncs.append(("dp", "all_reduce", "gradient", mesh.dp, dp_bw))
            numel = math.prod(info.shape) / shards
            stage, over = (3, mesh.dp) if zero else (0, mesh.dp)
            if strategy.shard_states and partial and mesh.tp > 1 and not zero:
                stage, over = 2, mesh.tp
            states = model_state_memory(numel, DTYPE_BYTES.get(info.dtype, 4), zero_stage=stage, dp=over)
            ev.param_states[fqn] = states.total if trainable else states.params
            ev.grad_memory += states.grads if trainable else 0.0
            ev.state_memory += ev.param_states[fqn]
            if trainable and mesh.dp > 1 and zero:
                ev.gathered += gathered_bytes(self.graph, fqn, shards)
        if self.graph.node(name).casts and not zero:  # ZeRO-3 gathers 16-bit weights: nothing to copy
            ev.weight_copies += local * PRECISIONS[self.graph.precision].itemsize / DTYPE_BYTES.get(info.dtype, 4)
        for axis, kind, phase, n, link in syncs:
            ev.grad_sync += collective_time(kind, local, n, link)
            ev.collectives.append((name, kind, phase, local, axis))

    # ---- repeated layers -------------------------------------------------------------------

    def tie(self, strategies: dict[str, list[Strategy]]) -> None:
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

    # ---- edges -----------------------------------------------------------------------------

    def edge_costs(self, evals: dict[str, list[_Eval]]) -> list[tuple[str, str, np.ndarray]]:
        """(group of producer, group of consumer, cost matrix) for every tensor crossing groups,
        and for weights tied between groups. Edges of identical layers are costed once."""
        mesh = self.mesh
        counts: dict[tuple[str, str, int], int] = {}
        for src, name, i in self.cross_edges():
            key = (src, name, i) if self.canon(name) == name and self.canon(src) == src else \
                (self.canon(src), self.canon(name), i)
            counts[key] = counts.get(key, 0) + 1
        out = []
        for (src, name, i), count in counts.items():
            k, gs, g = self._out_index(name, src), self.group(src), self.group(name)
            nbytes, grad, share = self._in_bytes(name, i, src), self._grad(src), self._sharers(src)
            m = np.array([[edge_time(a.out[src][k], b.need[name][i] or R, nbytes, mesh.tp, mesh.tp_link, grad,
                                     partial_share=share if i in b.partial.get(name, ()) else 0)
                           for b in evals[g]] for a in evals[gs]])
            out.append((gs, g, m * count))
        users: dict[str, set[str]] = {}
        for n in self.names:
            for fqn in self.graph.node(n).params:
                users.setdefault(fqn, set()).add(self.root[n])
        for fqn, owner in self.owner.items():
            go = self.root[owner]
            for user in users[fqn] - {go}:
                if self.cls[user] != user or self.cls[go] != go:
                    continue  # weights shared inside repeated layers: costed with their layer
                nbytes = self.graph.params[fqn].nbytes
                m = np.array([[edge_time(a.params[fqn], b.params[fqn], nbytes, mesh.tp, mesh.tp_link, True)
                               for b in evals[user]] for a in evals[go]])
                out.append((go, user, m))
        return out

    def cross_edges(self):
        """(producer, consumer, input position) of every tensor whose placement an edge decides:
        all inputs of anchors, and the inputs of followers other than the one they follow."""
        for name in self.names:
            if self.root.get(name) is None:
                continue
            primary = self._primary(name)
            for i, src in self._tensor_inputs(name):
                if src is not None and self.root.get(src) is not None and src != primary and self.sig[name].inputs[i]:
                    yield src, name, i

    def _primary(self, name: str) -> str | None:
        if self.sig[name].kind != L.FOLLOWER or self.root[name] == name:
            return None
        return max(((i, s) for i, s in self._tensor_inputs(name) if s and self.root.get(s) == self.root[name]
                    and self.sig[name].inputs[i]), key=lambda p: self._lead_key(name, *p))[1]

    def _lead_key(self, name: str, i: int, src: str) -> tuple[int, int]:
        val = self.fx[name].all_input_nodes[i].meta.get("val")
        return (val.numel() if hasattr(val, "numel") else 0, self.index[src])

    def output_costs(self, evals: dict[str, list[_Eval]]) -> dict[str, np.ndarray]:
        """The loss needs whole samples: an output leaves replicated or split by batch, not partial
        or split along another dimension."""
        out = {}
        for name in self.graph.outputs:
            if self.root.get(name):
                nbytes = self.graph.node(name).output_bytes / self._dp_share(name)
                batch = self._batch_of(name, 0)
                out[name] = np.array([
                    0.0 if e.out[self.canon(name)][0] == shard(batch if batch is not None else -1)
                    else redistribution_time(e.out[self.canon(name)][0], R, nbytes, self.mesh.tp, self.mesh.tp_link)
                    for e in evals[self.group(name)]])
        return out


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


BUCKET_BYTES = 25e6  # DDP's default gradient bucket


def buckets(nbytes: float) -> int:
    return max(1, math.ceil(nbytes / BUCKET_BYTES)) if nbytes else 0


def _bucket_latency(stage: _Stage, chosen: list[_Eval]) -> float:
    """Per-message latency of one gradient bucket's synchronisation on the data and tensor axes."""
    mesh = stage.mesh
    tp = all_reduce_latency(mesh.tp, mesh.tp_link) if any(e.tp_grad_sync for e in chosen) else 0.0
    return all_reduce_latency(mesh.dp, mesh.dp_link) + tp


def shard_stage(
    graph: OpGraph,
    cluster: ClusterSpec,
    submesh: tuple[int, int],
    logical: tuple[int, int],
    memory_limit: float | None = None,
    time_limit_s: float = 30.0,
    rule: Rule | None = None,
    fixed: dict[str, Strategy] | None = None,
) -> StageSharding:
    """Solve the sharding of `graph` on logical mesh `logical` (dp, tp) over `submesh` (hosts, devices).

    `rule` narrows each anchor's choices (a hand-written layout such as Megatron-LM's): the ILP
    still places everything else consistently and prices it the same way. `fixed` (a result's
    `strategies`) prices that sharding again, on this cluster, without choosing."""
    mesh = Mesh.of(cluster, submesh, logical)
    stage = _Stage(graph, cluster, mesh)
    anchors = [n for n in stage.names if stage.root.get(n) == n]
    strategies = {a: stage.strategies(a, rule) for a in anchors}
    if fixed:
        strategies = {a: [s for s in options if s == fixed.get(a)] or options for a, options in strategies.items()}
    stage.tie(strategies)
    classes = [a for a in anchors if stage.cls[a] == a]
    evals = {c: [stage.evaluate(c, s) for s in strategies[c]] for c in classes}
    var = {c: i for i, c in enumerate(classes)}
    problem = Problem([np.zeros(len(strategies[c])) for c in classes], [np.zeros(len(strategies[c])) for c in classes])
    for a in anchors:
        c = stage.cls[a]
        problem.node_costs[var[c]] += np.array([e.time for e in evals[c]])
        # ZeRO-3's gathered parameters are not summed: FSDP2 gathers a layer at a time (`gathered`
        # is priced per stage: `StageCosts.gathered_per_layer`, `planner.plan_single_stage`)
        problem.node_memory[var[c]] += np.array([e.state_memory + e.activation_memory + e.weight_copies
                                                 for e in evals[c]])
    for name, costs in stage.output_costs(evals).items():
        problem.node_costs[var[stage.group(name)]] += costs
    for u, v, m in stage.edge_costs(evals):
        problem.add_edge(var[u], var[v], m)
    problem.memory_limit = cluster.device.memory_bytes * 0.9 if memory_limit is None else memory_limit
    sol = solve(problem, time_limit_s)
    chosen = {c: evals[c][sol.choice[var[c]]] for c in classes}
    picked = {a: strategies[a][sol.choice[var[stage.cls[a]]]] for a in anchors}
    result = _result(stage, logical, chosen, {c: picked[c].zero for c in classes}, sol, problem)
    return dataclasses.replace(result, strategies=picked, tp_batch=_tp_batch(stage, result))


def _tp_batch(stage: _Stage, result: StageSharding) -> frozenset[tuple[int, int]]:
    """Every batch dimension an output or a needed input splits on the tensor axis, as (its size at
    the whole batch, the pieces dp × tp cut it into): atoms are solved at the whole batch, and the
    runtime cannot split a microbatch's dimension unevenly (DTensor refuses a view of it)."""
    if stage.mesh.tp == 1:
        return frozenset()
    pieces = stage.mesh.dp * stage.mesh.tp

    def split(name: str, k: int, placement: str | None) -> set[tuple[int, int]]:
        d = stage._batch_of(name, k)
        if d is None or placement != shard(d):
            return set()
        return {(stage.graph.node(name).outputs[k].shape[d], pieces)}

    out: set[tuple[int, int]] = set()
    for name, (_, on_tp) in result.ops.items():
        out |= split(name, 0, on_tp)
    for name, placements in result.needs.items():
        for i, src in stage._tensor_inputs(name):
            if src is not None and i < len(placements):
                out |= split(src, stage._out_index(name, src), placements[i])
    return frozenset(out)


def _result(stage: _Stage, logical, chosen: dict[str, _Eval], zero: dict[str, bool], sol, problem) -> StageSharding:
    params: dict[str, list[str]] = {}
    ops: dict[str, list[str]] = {}
    needs: dict[str, list[str | None]] = {}
    collectives: list[dict[str, Any]] = []
    anchors = [n for n in stage.names if stage.root.get(n) == n]
    for name in stage.names:
        if stage.root.get(name) is None:
            continue
        ev = chosen[stage.group(name)]
        d = stage._batch_of(name, 0)
        outs = ev.out[stage.canon(name)]
        ops[name] = [shard(d) if d is not None and stage.mesh.dp > 1 else R, outs[0] if outs else R]
        if stage.mesh.tp > 1 and stage.graph.node(name).op != "input":
            needs[name] = list(ev.need[stage.canon(name)])
        for fqn, fqn_rep in zip(stage.graph.node(name).params, stage.graph.node(stage.canon(name)).params):
            if stage.owner[fqn] == name:
                params[fqn] = ["S(0)" if zero[stage.group(name)] else R, ev.params[fqn_rep]]
    for a in anchors:  # each anchor's own collectives, under its own node names
        names = {stage.canon(m): m for m in stage.members[a]}
        collectives += [{"node": names.get(n, n), "kind": k, "axis": (rest or ("tp",))[0], "phase": ph, "bytes": b,
                         **({"unit": True} if rest[1:] else {})}
                        for n, k, ph, b, *rest in chosen[stage.cls[a]].collectives]
    collectives += _edge_collectives(stage, chosen)
    for name in stage.graph.outputs:
        if stage.root.get(name):
            have, batch = chosen[stage.group(name)].out[stage.canon(name)][0], stage._batch_of(name, 0)
            if have != shard(batch if batch is not None else -1):
                nbytes = stage.graph.node(name).output_bytes / stage._dp_share(name)
                collectives += [{"node": name, "kind": k.value, "axis": "tp", "phase": "forward", "bytes": nbytes * f}
                                for k, f in redistribution(have, R, stage.mesh.tp)]
    per_anchor = [chosen[stage.cls[a]] for a in anchors]
    compute = sum(e.compute for e in per_anchor)
    gather, scatter = _unit_latency(stage.mesh, collectives)
    comm = sum(e.comm for e in per_anchor) + gather
    grad_sync = sum(e.grad_sync for e in per_anchor)
    per_bucket = _bucket_latency(stage, per_anchor)
    # what this rank synchronises: its own shard of each trainable weight (buckets hold local gradients)
    def trainable_shard(f: str, zero: bool = True) -> float:
        tp = stage.mesh.tp if shard_dim(params[f][1]) is not None else 1
        dp = stage.mesh.dp if zero and params[f][0] == "S(0)" else 1
        return stage.graph.params[f].nbytes / (tp * dp)

    trainable_bytes = sum(trainable_shard(f, zero=False) for f in stage.graph.trainable if f in params)
    latency = per_bucket * buckets(trainable_bytes)
    total = problem.objective(sol.choice) + latency + gather
    return StageSharding(
        logical_mesh=tuple(logical),
        params=dict(sorted(params.items())),
        ops=ops,
        cost={"compute_s": compute, "comm_s": comm, "reshard_s": max(0.0, total - latency - compute - comm - grad_sync),
              "grad_sync_s": grad_sync + latency, "total_s": total,
              "bucket_latency_s": per_bucket, "trainable_bytes": trainable_bytes,
              "comm_latency_s": _latency_of(stage.mesh, collectives) + gather,
              "zero_gather_s": sum(e.zero_gather for e in per_anchor) + gather,
              "zero_scatter_s": sum(e.zero_scatter for e in per_anchor) + scatter,
              "fixed_s": sum(e.fixed for e in per_anchor),
              # the optimizer's step: fp32 elements and tensors this rank updates (ZeRO-3: its shard)
              "optimizer_elements": sum(trainable_shard(f) / DTYPE_BYTES.get(stage.graph.params[f].dtype, 4)
                                        for f in stage.graph.trainable if f in params),
              "optimizer_tensors": sum(1 for f in stage.graph.trainable if f in params),
              # DTensors (on the tensor axis every parameter; under ZeRO-3, FSDP2's)
              "optimizer_dtensors": sum(1 for f in stage.graph.trainable if f in params
                                        and (stage.mesh.tp > 1 or params[f][0] == "S(0)"))},
        memory={"model_states": sum(e.state_memory for e in per_anchor),
                "activations": sum(e.activation_memory for e in per_anchor),
                "weight_copies": sum(e.weight_copies for e in per_anchor),
                "gathered": sum(e.gathered for e in per_anchor),
                "gradients": sum(e.grad_memory for e in per_anchor),
                "total": problem.memory(sol.choice), "limit": problem.memory_limit},
        solver={"status": sol.status, "objective": sol.objective, "gap": sol.gap, "time_s": sol.solve_time_s,
                "variables": sol.num_variables, "constraints": sol.num_constraints,
                "ilp_nodes": len(problem.node_costs), "anchors": len(anchors)},
        collectives=collectives,
        needs=needs,
        param_states={f: b for e in per_anchor for f, b in e.param_states.items()},
    )


def _latency_of(mesh: Mesh, collectives: list[dict[str, Any]]) -> float:
    """The per-message (α) part of every collective a microbatch runs: it does not shrink with
    the microbatch, unlike the bytes."""
    total = 0.0
    for c in collectives:
        if c["phase"] != "gradient" and not c.get("unit"):
            n, link = (mesh.dp, mesh.dp_link) if c["axis"] == "dp" else (mesh.tp, mesh.tp_link)
            total += collective_time(c["kind"], 0.0, n, link)
    return total


def _unit_latency(mesh: Mesh, collectives: list[dict[str, Any]]) -> tuple[float, float]:
    """ZeRO-3's per-message cost of a stage solve (an atom: a layer): FSDP2 gathers a unit's
    weights in one all-gather for forward and one for backward, and reduce-scatters them in one."""
    if not any(c.get("unit") for c in collectives):
        return 0.0, 0.0
    return 2 * collective_time("all_gather", 0.0, mesh.dp, mesh.dp_link), \
        collective_time("reduce_scatter", 0.0, mesh.dp, mesh.dp_link)


def _edge_collectives(stage: _Stage, chosen: dict[str, _Eval]) -> list[dict[str, Any]]:
    """The redistributions the chosen placements imply on edges, forward and backward."""
    out = []
    for src, name, i in stage.cross_edges():
        have = chosen[stage.group(src)].out[stage.canon(src)][stage._out_index(name, src)]
        need = chosen[stage.group(name)].need[stage.canon(name)][i] or R
        nbytes = stage._in_bytes(name, i, src)
        for kind, f in redistribution(have, need, stage.mesh.tp):
            out.append({"node": name, "kind": kind.value, "axis": "tp", "phase": "forward", "bytes": nbytes * f})
        if stage._grad(src):
            partial = i in chosen[stage.group(name)].partial.get(stage.canon(name), ())
            if partial and not stage._first_sharer(src, name):
                continue  # one collective completes the partial gradients of all its consumers
            for kind, f in redistribution(P if partial else need, R if have == P else have, stage.mesh.tp):
                out.append({"node": name, "kind": kind.value, "axis": "tp", "phase": "backward", "bytes": nbytes * f})
    return out


def logical_meshes(submesh: tuple[int, int]) -> list[tuple[int, int]]:
    """Every (dp, tp) with dp × tp = the submesh's devices."""
    n = submesh[0] * submesh[1]
    return [(n // tp, tp) for tp in range(1, n + 1) if n % tp == 0]


def best_sharding(graph: OpGraph, cluster: ClusterSpec, submesh: tuple[int, int], memory_limit: float | None = None,
                  time_limit_s: float = 30.0, progress: Callable[[tuple[int, int]], None] | None = None,
                  rule: Rule | None = None,
                  ) -> tuple[StageSharding, list[StageSharding], dict[tuple[int, int], str]]:
    """Solve every logical mesh of the submesh; keep the fastest that fits (ties: more data parallelism).

    Returns the best, every feasible result, and why each other logical mesh was rejected."""
    results, errors, rejected = [], [], {}
    for logical in logical_meshes(submesh):
        if progress:
            progress(logical)
        try:
            results.append(shard_stage(graph, cluster, submesh, logical, memory_limit, time_limit_s, rule))
        except InfeasibleError as exc:
            errors.append(exc)
            rejected[logical] = str(exc)
    if not results:
        if all(e.least_memory == 0 for e in errors):  # nothing failed on memory: the batch does not split
            raise InfeasibleError(f"no logical mesh of {submesh[0]}x{submesh[1]} can split the batch: "
                                  + "; ".join(str(e) for e in errors), 0.0)
        least = min(e.least_memory for e in errors if e.least_memory > 0)
        limit = cluster.device.memory_bytes * 0.9 if memory_limit is None else memory_limit
        raise InfeasibleError(
            f"fits on no logical mesh of {submesh[0]}x{submesh[1]}: the leanest sharding needs "
            f"{least / 2**30:.2f} GiB per device, {limit / 2**30:.2f} GiB is available; "
            "use more devices or a smaller batch", least)
    return min(results, key=lambda r: (float(f"{r.time:.6g}"), -r.logical_mesh[0])), results, rejected
