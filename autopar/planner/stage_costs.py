"""Costs of pipeline stages: a layer range on a submesh, from intra-op solves of its atoms.

Each atom (module-boundary layer: an embedding, a transformer block, the output layer) is solved
by the intra-op ILP on every (submesh, logical mesh) once per structural hash — 24 identical
blocks cost one solve — in three variants (`SHARDINGS`): fastest; the fastest of those with the
least model states (what a pipeline stage of many microbatches needs: its states stay, a few
microbatches' activations come and go — Megatron-LM's tensor parallelism is such a point); and
leanest (the least memory, states and a whole batch's activations, then the fastest such). A
stage's cost is the sum of its atoms': atoms meet at replicated or batch-split boundaries, which
the intra-op pass enforces at every atom's output.

The graph is captured at the global batch; a stage of M microbatches runs each microbatch in
1/M of the batch-proportional time (compute, activation collectives) and holds 1/M of the
activations per microbatch in flight, while gradient synchronisation and model states are per
step. Recomputation keeps only each stage's input per microbatch and pays the forward again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import IntEnum
from types import SimpleNamespace
from typing import Any

import numpy as np

from autopar.contract.buckets import bucket_count, flat_held
from autopar.contract.compression import Spec, runs_dense
from autopar.contract.plan import SELECTIVE
from autopar.contract.precision import PRECISIONS
from autopar.cost_models import ClusterSpec, axis_link, optimizer_time, p2p_time
from autopar.cost_models.comm import all_reduce_time, exposed_time, stage_send_link, straggler_wait
from autopar.cost_models.compression import decide, sync_time
from autopar.cost_models.compute import loss_time
from autopar.cost_models.memory import OPTIMIZER_STATE_BYTES
from autopar.planner.graph import OpGraph
from autopar.planner.ilp import InfeasibleError
from autopar.planner.intra_op import (
    StageSharding,
    distinct,
    logical_meshes,
    program_collectives,
    shard_stage,
    solve_stage,
    stage_problem,
)
from autopar.planner.layering import cut_bytes
from autopar.planner.placement import P, R, redistribution
from autopar.planner.stage_graph import layer_hash, whole_batch_dims
from autopar.planner.strategy_costs import DTYPE_BYTES, Rule


class Col(IntEnum):
    """The quantities `StageCosts.range_sums` adds up over a range of atoms, by name."""

    fwd = 0  # compute of the forward (seconds, whole batch)
    bwd = 1  # compute of the backward
    comm = 2  # the tensor axis's collectives and reshardings
    sync = 3  # the data axis's gradient averaging, bucket latency left out
    states = 4  # model states (bytes)
    acts = 5  # activations backward keeps (whole batch)
    trainable = 6  # trainable bytes
    weighted_latency = 7  # bucket latency × trainable bytes
    latency = 8  # the collectives' latency (paid per microbatch)
    copies = 9  # autocast's 16-bit weight copies
    gathered = 10  # ZeRO-3's gathered parameters and gradients
    grads = 11  # gradient bytes
    averaged = 12  # bytes the data axis averages from flat copies (GradSync's)
    gather = 13  # ZeRO-3's all-gather (seconds)
    scatter = 14  # ZeRO-3's reduce-scatter
    fixed_f = 15  # the fixed per-op time of forward
    fixed_b = 16  # of backward
    elements = 17  # the optimizer's elements
    tensors = 18  # its tensors
    dtensors = 19  # its DTensors
    tp_grad = 20  # the tensor axis's weight-gradient all-reduces
    attention = 21  # the activations the attention cores save
    attention_s = 22  # the forward selective recomputation repeats
    attention_kept = 23  # the cores' inputs its checkpoints keep beyond those
    tp_syncs = 24  # the tensor axis's collectives a microbatch runs (its ranks meet at each)

# each atom's shardings: the fastest; the fastest of those within STATES_SLACK of the least model
# states (a bias left whole beside its sharded weight costs a few bytes and saves a collective);
# the least memory. Ranked in this order where they tie
FASTEST, LEAST_STATES, LEAST_MEMORY = SHARDINGS = (0, 1, 2)
STATES_SLACK = 0.02
# selective recomputation is weighed where attention cores hold at least this share of the model's
# activations: where attention keeps its s² scores (eager: 19–21 % in gpt-small-eager and T5; BERT's
# masked attention on CPU 17 %), not where a fused kernel keeps its output and log-sum-exp (8.6–12 %
# in Llama and gpt-small, for the kernel's forward again): the search of those stays as small as before
SELECTIVE_SHARE = 0.15


def _crossing(read: dict[str, Any], kind: str, phase: str, f: float) -> dict[str, Any]:
    """A collective where a value crosses into a later atom (`StageCosts._program`)."""
    return {"node": read["node"], "kind": kind, "phase": phase, "bytes": read["bytes"] * f, "axis": "tp",
            "tensor": read["tensor"], "move": read["move"], **({"batch_dims": read["batch_dims"]} if read["batch_dims"] != 1 else {})}


def gathered_peak(per_layer: np.ndarray, precision: str | None, loss: float = 0.0,
                  acts: np.ndarray | None = None) -> float:
    """The transient of a one-stage plan whose parameters FSDP2 gathers a layer at a time
    (ZeRO-3): during layer l's backward, its gathered bytes (`strategy_costs.gathered_bytes`,
    `per_layer`) and the parameters of layer l - 1, gathered ahead (backward prefetch: width of
    the 2·width + 4 bytes), while the activations of the layers after l are freed already
    (`acts`, per layer; None: none counted as freed). `loss`: the loss's backward (its two
    logits-sized gradients), before any layer's; the last layer's backward still holds one."""
    width = PRECISIONS[precision].itemsize if precision else 4
    per_layer = np.asarray(per_layer, dtype=float)
    at = per_layer + np.concatenate([[0.0], per_layer[:-1] * width / (2 * width + 4)])
    if acts is not None:
        at -= np.concatenate([np.cumsum(acts[::-1])[::-1][1:], [0.0]])
    at[-1] += loss / 2
    return max(float(at.max()), loss)


@dataclass(frozen=True)
class StageOption:
    """One way to run a layer range on a submesh, per microbatch of a given count."""

    logical_mesh: tuple[int, int]
    lean: int  # which of each atom's shardings (`SHARDINGS`): 0 fastest, 1 least states, 2 least memory
    recompute: bool | str  # False, True (whole layers) or SELECTIVE (attention cores)
    forward_s: float
    backward_s: float
    send_s: float
    grad_sync_s: float
    state_bytes: float
    activation_bytes: float  # per microbatch in flight
    transient_bytes: float  # during one backward: recomputed activations, the loss's gradients, ZeRO-3's gathered weights
    grad_bytes: float = 0.0  # the part of state_bytes the step's first backward allocates (gradients, but plain buckets' views)
    sync_bytes: float = 0.0  # the synchroniser's flat buffer of one bucket beside its gradients (`flat_held`)
    optimizer_s: float = 0.0  # once per step, after the gradients are averaged (and the loss's all-reduce)
    weight_s: float = 0.0  # the weight-gradient part of backward_s (what a zero-bubble schedule runs apart)
    unhidden_sync_s: float = 0.0  # grad_sync_s when no backward hides any of it (see `assemble`)
    recompute_layers: int | None = None  # with `recompute`: only the range's first this many layers (None: all)
    zero: int = 0  # ZeRO-1 / ZeRO-2 of the data-replicated parameters (`zeroed`); 0: none
    offload: bool = False  # with `zero`: its shards in host memory

    def memory(self, in_flight: int) -> float:
        """The peak with `in_flight` microbatches' activations held (an upper bound: the simulator
        knows when gradients appear)."""
        return self.state_bytes + max(in_flight * self.activation_bytes + self.transient_bytes, self.sync_bytes)

    @property
    def time(self) -> float:
        return self.forward_s + self.backward_s + self.send_s

    @property
    def zero_choice(self) -> int:
        """The ZeRO level as the variants spell it (`StageCosts.zero_levels`: negative offloads)."""
        return -self.zero if self.offload else self.zero


def _at(value: Any, at: Any) -> Any:
    """`value` at the ranges `at` where it varies by range (an [i, j] array), else itself."""
    return value[at] if isinstance(value, np.ndarray) and value.ndim == 2 else value


@dataclass
class StageCosts:
    """Intra-op results per (atom hash, submesh, logical mesh, variant), solved on demand."""

    graph: OpGraph
    cluster: ClusterSpec
    rule: Rule | None = None
    time_limit_s: float = 30.0
    compression: Spec | None = None  # prices the data axis's gradient averaging through it
    solves: int = 0
    hits: int = 0
    _cache: dict = field(default_factory=dict)
    # the atoms the planner's units start at (`Search.units`, which the DP's layers may cut finer):
    # a recomputing stage keeps each unit's input and recomputes one unit at a time, ZeRO-3 gathers
    # one at a time (`runtime.recompute`); None: every atom is a unit
    layer_starts: list[int] | None = None
    world: int = 1  # ranks of the job: the loss is all-reduced over all of them every step
    # the strategies each solve chose, by (rule, precision, atom structure, submesh, logical mesh,
    # variant): filled as solves go, or with `pin` read instead of solving (the same shardings
    # priced on another cluster: `autopar.fit`)
    choices: dict | None = None
    pin: bool = False

    def __post_init__(self) -> None:
        self.atoms = self.graph.layer_list
        self.fingerprint = self.graph.fingerprint()  # every plan priced here names it (hashing is not free)
        # weights several atoms compute with (a GPT's tied embedding and output layer): each atom's
        # result counts their states, a stage holding several of those atoms holds them once
        users: dict[str, list[int]] = {}
        for k, atom in enumerate(self.atoms):
            for f in sorted({f for n in atom.nodes for f in self.graph.node(n).params}):
                users.setdefault(f, []).append(k)
        self.tied = {f: ks for f, ks in users.items() if len(ks) > 1}
        self.hashes = [layer_hash(self.graph, a.nodes) for a in self.atoms]
        self._subgraphs: dict[int, OpGraph] = {}
        self._problems: dict = {}  # (atom, submesh, logical) -> its `StageProblem`, solved per sharding
        self._first: dict[str, int] = {}  # structural hash -> the atom its results were solved on
        self._prefix: dict = {}  # (submesh, logical, lean) -> prefix sums of atom costs
        self._splits: dict = {}  # (submesh, logical, lean) -> each atom's tp_batch
        self._collectives: dict = {}  # (atoms, submesh, logical, lean) -> priced collectives, whole batch
        self.cut = cut_bytes(self.graph, self.atoms)  # bytes crossing the boundary after atom k
        self._batch = next(n for n in self.graph if n.op == "input").outputs[0].shape[0]
        self.needs = sample_needs(self.graph, self._batch)  # what a rank's microbatch must hold
        self.flops = [(a.flops_fwd, a.flops_bwd) for a in self.atoms]
        self.largest_grad = max((self.graph.params[f].nbytes for f in self.graph.trainable), default=0)
        self._per_byte: dict = {}
        self._excess: dict = {}  # `variant_table`'s tied_excess, by (bounds, submesh, logical, lean)
        self._links: dict = {}  # (submesh, logical) -> the data axis's link
        self._shardings: dict = {}  # (submesh, logical) -> the shardings that place atoms differently (`shardings`)
        self._last_base: tuple = (None, None)  # `_base`'s last key and terms
        kept = {n.name: sum(o.nbytes for k, o in enumerate(n.outputs) if n.saved_outputs is None or k in n.saved_outputs)
                + n.saved_hidden for n in self.graph if not n.is_view and n.op != "input"}
        freed = sum(kept[n.name] for n in self.graph if n.attention and n.name in kept) - sum(
            n.outputs[k].nbytes for n in self.graph for k in n.attention_inputs)
        # the recompute choices the search weighs by default, least recomputed first (ties keep the first)
        self.recomputes = (False,) + ((SELECTIVE,) if freed >= SELECTIVE_SHARE * sum(kept.values()) > 0 else ()) + (True,)
        # the loss runs on the model's output in the last stage, in fp32 (autocast's lists and the usual
        # losses upcast): cross-entropy keeps its log-probabilities for backward (per microbatch in
        # flight), and its backward makes two logits-sized gradients (a transient of one microbatch)
        self.loss_bytes = float(sum(math.prod(o.shape) * max(4, DTYPE_BYTES.get(o.dtype, 4))
                                    for name in self.graph.outputs for o in self.graph.graph.nodes[name]["op"].outputs))

    def compressed_per_byte(self, submesh: tuple[int, int], lm: tuple[int, int]) -> float:
        """Seconds a compressor adds (or, negative, saves) per trainable byte of a stage's data-axis
        gradient averaging on this mesh: the model's parameter shapes set the ratio. The runtime
        compresses after the last backward (its rounds depend on the data), so the callers also
        start the synchronisation there rather than overlapping it with that backward."""
        return self._compressed(submesh, lm)[0]

    def compressor_runs(self, submesh: tuple[int, int], lm: tuple[int, int]) -> bool:
        """Whether a stage's data-axis averaging goes through the compressor on this mesh (after
        its last backward), not the plain synchroniser: a compressor that compresses nothing here
        runs as dense averaging (`contract.compression.runs_dense`)."""
        return self._compressed(submesh, lm)[1]

    def _compressed(self, submesh: tuple[int, int], lm: tuple[int, int]) -> tuple[float, bool]:
        """(`compressed_per_byte`, `compressor_runs`), decided once per mesh (`decide` over the
        model's parameters in backward order)."""
        if self.compression is None or lm[0] == 1:
            return 0.0, False
        key = (submesh, lm)
        if key not in self._per_byte:
            shapes = [tuple(self.graph.params[f].shape) for f in reversed(self.graph.params)
                      if f in self.graph.trainable]  # as backward produces them
            link, device = self.data_link(submesh, lm), self.cluster.device
            chosen = decide(self.compression, shapes, lm[0], link, device)
            extra = (sync_time(self.compression, shapes, lm[0], link, device, chosen)
                     - sync_time(self.compression, shapes, lm[0], link, device, [False] * len(shapes)))
            self._per_byte[key] = (extra / max(1, 4 * sum(math.prod(s) for s in shapes)),
                                   not runs_dense(self.compression, any(chosen)))
        return self._per_byte[key]

    def loss_time(self, loss):
        return loss_time(loss, self.cluster.device)

    def exposed_sync(self, sync, backward, submesh: tuple[int, int], lm: tuple[int, int], trainable, computed=0.0):
        """The part of a stage's gradient synchronisation its last backward (`backward`, one
        microbatch's) does not hide: the data axis's link's `overlap` of it. A compressor runs
        after backward (its rounds depend on the data): nothing hides, and it adds its own cost.
        And the data axis's ranks meet there after the step's `computed` seconds: they wait for
        the slowest (`straggler_wait`)."""
        wait = self.data_wait(computed, lm, trainable)
        if self.compressor_runs(submesh, lm):
            return sync + self.compressed_per_byte(submesh, lm) * trainable + wait
        return exposed_time(sync, backward, self.data_link(submesh, lm)) + wait

    def data_wait(self, computed, lm: tuple[int, int], trainable):
        """The data axis's wait for its slowest rank where it synchronises gradients (`trainable`
        bytes) after the step's `computed` seconds."""
        return np.where(np.asarray(trainable) > 0, self.straggler_wait(computed, lm[0]), 0.0)

    def straggler_wait(self, seconds, n: int):
        """What a group of `n` of this cluster's ranks waits for its slowest after `seconds` of
        computation (`comm.straggler_wait`)."""
        return straggler_wait(seconds, n, self.cluster.device.jitter)

    def data_link(self, submesh: tuple[int, int], lm: tuple[int, int]):
        """The link a stage's data axis runs over (`axis_link`, cached: the search asks it per variant)."""
        if (submesh, lm) not in self._links:
            self._links[(submesh, lm)] = axis_link(self.cluster, lm, 0, submesh)
        return self._links[(submesh, lm)]

    def atom(self, k: int, submesh: tuple[int, int], logical: tuple[int, int], lean: int) -> StageSharding | None:
        key = (self.hashes[k], submesh, logical, lean)
        if key in self._cache:
            self.hits += 1
            return self._cache[key]
        self._first.setdefault(self.hashes[k], k)
        k = self._first[self.hashes[k]]
        if k not in self._subgraphs:
            self._subgraphs[k] = self.graph.subgraph(list(self.atoms[k].nodes))
        sub = self._subgraphs[k]
        result = None
        choice = (self.rule, self.graph.precision, self.hashes[k], submesh, logical, lean)
        if self.pin:
            fixed = self.choices.get(choice)
            result = fixed and shard_stage(sub, self.cluster, submesh, logical, float("inf"), self.time_limit_s,
                                           self.rule, fixed=fixed)
            self._cache[key] = result
            return result
        try:
            problem = self._problems.get((k, submesh, logical))
            if problem is None:  # built once, solved for each of the shardings
                problem = self._problems[(k, submesh, logical)] = stage_problem(sub, self.cluster, submesh, logical,
                                                                                self.rule)
            weight = 0.0 if lean == LEAST_STATES else 1.0  # what counts: the states alone, or with activations
            slack = STATES_SLACK if lean == LEAST_STATES else 1e-9
            limit = problem.least_memory(weight) * (1 + slack) if lean else float("inf")
            fastest = self.atom(k, submesh, logical, FASTEST) if lean else None
            if fastest is not None and problem.memory_of(fastest, weight) <= limit:
                result = fastest  # the fastest is lean enough already: the same solve's answer
            else:
                self.solves += 1
                result = solve_stage(problem, limit, self.time_limit_s, activation_weight=weight)
        except InfeasibleError:
            result = None  # the data axis does not divide this atom's batch
        if self.choices is not None and result is not None:
            self.choices[choice] = result.strategies
        self._cache[key] = result
        return result

    def gap(self, atoms: tuple[int, int], submesh: tuple[int, int], logical: tuple[int, int], lean: bool
            ) -> float | None:
        """The largest optimality gap among the solves of atoms [a, b) that stopped at the time limit
        (None: all optimal), so a plan can say it. Reads the cache: solves nothing, counts no hit."""
        results = [self._cache.get((self.hashes[k], submesh, logical, lean)) for k in range(*atoms)]
        return max((r.solver["gap"] for r in results if r is not None and r.solver["status"] != "optimal"),
                   default=None)

    def placements(self, k: int, submesh: tuple[int, int], logical: tuple[int, int], lean: bool
                   ) -> tuple[dict[str, list[str]], dict[str, list[str]], dict[str, list[str | None]]]:
        """(params, ops, needs) of atom k, translated from the identical atom it was solved on."""
        result = self.atom(k, submesh, logical, lean)
        k0 = self._first[self.hashes[k]]
        nodes = dict(zip(self.atoms[k0].nodes, self.atoms[k].nodes))
        fqns = {f0: fk for n0, nk in nodes.items()
                for f0, fk in zip(self.graph.node(n0).params, self.graph.node(nk).params)}
        params = {fqns[f]: p for f, p in result.params.items() if f in fqns}
        ops = {nodes[n]: p for n, p in result.ops.items() if n in nodes}
        needs = {nodes[n]: p for n, p in result.needs.items() if n in nodes}
        return params, ops, needs

    def collectives(self, atoms: tuple[int, int], submesh: tuple[int, int], logical: tuple[int, int],
                    lean: bool, m: int = 1, recompute: bool | str = False, depth: int | None = None
                    ) -> list[dict[str, Any]]:
        """The collectives the lowered program of atoms [a, b) issues per microbatch of `m`
        (`program_collectives`). Each atom's own, but where a value crosses from one atom to a
        later one: alone, an atom priced its outputs made replicated (or batch-split) and its
        inputs read from there; the program, following the plan's placements, redistributes the
        producer's placement straight to each consumer's need (`intra_op.reads`). (The stage's
        time still sums the atoms' prices: where a split value crosses a boundary, an
        over-estimate of its collectives.) A stage that recomputes (`recompute`, its first `depth`
        layers) issues again in backward the forward collectives it recomputes (`recomputed`)."""
        if logical[1] == 1:
            return []
        key = (atoms, submesh, logical, lean)
        if key not in self._collectives:
            self._collectives[key] = self._program(atoms, submesh, logical, lean)
        if not recompute:
            return program_collectives(distinct(self._collectives[key]), logical[1], m)
        # a recomputing stage moves a value once per layer that reads it (`ShardedGraph.interpret`),
        # under SELECTIVE once in each attention core too (a segment of its own)
        regions = self.recomputed(atoms, recompute, depth)
        core = recompute == SELECTIVE
        layer = {n: (i, core and self.graph.node(n).attention) for i, region in enumerate(self._layers(atoms))
                 for n in region}

        def moved(c: dict) -> tuple:  # what one collective of the runtime serves
            return (c["tensor"], c["move"], c["kind"], layer.get(c["node"])) if c.get("move") else (id(c),)

        raw = self._collectives[key]
        again = {moved(c) for c in raw if c["phase"] == "forward" and self._again(c, regions)}
        found = distinct(raw, lambda c: layer.get(c["node"]))
        # the partial gradients a value's consumers leave add up per segment: one collective each
        found = found + [{**c, "node": n} for c in found for n in self._other_segments(c.get("sharers", ()), layer)]
        found = found + [{**c, "phase": "backward"} for c in found
                         if c["phase"] == "forward" and moved(c) in again]
        return program_collectives(found, logical[1], m)

    def recomputed(self, atoms: tuple[int, int], recompute: bool | str, depth: int | None) -> list[set[str]]:
        """The regions of atoms [a, b) a recomputing stage runs again before their backward: each
        layer (its first `depth`), or under SELECTIVE each layer's attention cores."""
        regions = self._layers(atoms)
        if recompute != SELECTIVE and depth is not None:
            regions = regions[:depth]
        if recompute == SELECTIVE:
            regions = [{n for n in region if self.graph.node(n).attention} for region in regions]
        return regions

    @staticmethod
    def _other_segments(sharers: list[str], segment: dict[str, Any]) -> list[str]:
        """Of the consumers sharing one collective, the first in each segment after the first's."""
        seen, out = {segment.get(sharers[0])} if sharers else set(), []
        for n in sharers[1:]:
            if segment.get(n) not in seen:
                seen.add(segment.get(n))
                out.append(n)
        return out

    def _layers(self, atoms: tuple[int, int]) -> list[set[str]]:
        """The nodes of each layer of atoms [a, b) (`layer_starts`): the runtime's segments."""
        starts = sorted({atoms[0], *(a for a in (self.layer_starts or range(*atoms)) if atoms[0] < a < atoms[1])})
        return [{n for k in range(a, b) for n in self.atoms[k].nodes} for a, b in zip(starts, starts[1:] + [atoms[1]])]

    def _again(self, c: dict[str, Any], regions: list[set[str]]) -> bool:
        """Whether forward collective `c` runs again before the backward. A recomputed region keeps
        only its inputs, so its backward recomputes every value it saves and what they are made of
        (`runtime.recompute`; the partitioner recomputes a collective like any op). A collective
        delivering a value to node n runs again where n saves that value, or n or an op after it in
        the region makes a value the region saves; one moving n's output, where an op after n does
        (not a value only later layers save: the next layer's input is kept)."""
        n = c["node"]
        region = next((r for r in regions if n in r), None)
        if region is None:
            return False
        succ = self.graph.graph.successors
        if c.get("output"):
            after = [u for u in succ(n) if u in region]
            by = self.graph.node(n).saved_by
            return self._leads_to_saved(after, region) or (bool(after) if by is None else bool(by & region - {n}))
        sources = [c["tensor"]] if c.get("tensor") in self.graph.graph else list(self.graph.graph.predecessors(n))
        return self._leads_to_saved([n], region) or any(
            n in (self.graph.node(p).saved_by or ()) for p in sources)

    def _leads_to_saved(self, nodes: list[str], region: set[str]) -> bool:
        """Whether one of `nodes`, or an op of `region` after them, makes a value the region's backward reads."""
        seen, todo = set(nodes), list(nodes)
        while todo:
            x = todo.pop()
            if self._saved_in(x, region):
                return True
            for u in self.graph.graph.successors(x):
                if u in region and u not in seen:
                    seen.add(u)
                    todo.append(u)
        return False

    def _saved_in(self, n: str, region: set[str]) -> bool:
        """Whether node n makes a value the backward of `region` reads."""
        op = self.graph.node(n)
        if op.saved_hidden:
            return True
        if op.saved_by is None:  # unknown: whatever the region reads of it
            return op.saved_outputs is None or bool(op.saved_outputs) and any(
                u in region for u in self.graph.graph.successors(n))
        return bool(op.saved_by & region)

    def _program(self, atoms: tuple[int, int], submesh: tuple[int, int], logical: tuple[int, int],
                 lean: bool) -> list[dict[str, Any]]:
        inside = {n for k in range(*atoms) for n in self.atoms[k].nodes}
        # values that leave the stage (to the loss, a later stage) go made whole, as each atom priced
        leaving = {n for n in inside if n in self.graph.outputs
                   or any(d not in inside for d in self.graph.graph.successors(n))}
        placed: dict[str, list[str]] = {}  # value -> its placement on the tensor axis per output
        out: list[dict[str, Any]] = []
        for k in range(*atoms):
            result, name = self.atom(k, submesh, logical, lean), self._names(k)
            own = set(self.atoms[self._first[self.hashes[k]]].nodes)
            for c in result.collectives:
                read = c["tensor"] is not None and c["tensor"] not in own  # a value from before the atom
                if read or c.get("output") and name[c["tensor"]] not in leaving:
                    continue  # a boundary: priced below, as the program crosses it
                out.append({**c, "node": name.get(c["node"], c["node"]), "tensor": name.get(c["tensor"]),
                            **({"sharers": [name.get(n, n) for n in c["sharers"]]} if "sharers" in c else {})})
            for read in result.reads:
                cross = {**read, "node": name[read["node"]], "tensor": name.get(read["tensor"], read["tensor"])}
                have = placed.get(cross["tensor"], [R] * (read["out"] + 1))[read["out"]]
                cross["move"] = f"{have}>{read['need']}"
                for kind, f in redistribution(have, read["need"], logical[1]):
                    out.append(_crossing(cross, kind.value, "forward", f))
                if read["grad"]:  # the consumers' gradients add up before the way back (`distinct`)
                    grad = P if read["partial"] else read["need"]
                    for kind, f in redistribution(grad, R if have == P else have, logical[1]):
                        out.append(_crossing(cross, kind.value, "backward", f))
            placed.update({name[n]: p for n, p in result.outs.items() if n in own})
        return out

    def _names(self, k: int) -> dict[str, str]:
        """The names of atom k's nodes and of the values it reads, from those of the identical atom
        its solve was made on (the same position in each op's inputs)."""
        k0 = self._first[self.hashes[k]]
        names = dict(zip(self.atoms[k0].nodes, self.atoms[k].nodes))
        fx = self.graph.fx_nodes
        for n0, nk in list(names.items()):
            if n0 in fx and nk in fx:
                for a0, ak in zip(fx[n0].all_input_nodes, fx[nk].all_input_nodes):
                    names.setdefault(a0.name, ak.name)
        return names

    def options(self, atoms: tuple[int, int], submesh: tuple[int, int], num_microbatches: int,
                logical: list[tuple[int, int]] | None = None, recompute: tuple | None = None,
                zeros: tuple[int, ...] | None = None) -> list[StageOption]:
        """Every (logical mesh, variant, recompute, ZeRO level) of atoms [a, b) on `submesh`, per microbatch."""
        out = []
        for lm, lean, rc, z in self.variants(submesh, num_microbatches, logical, recompute, zeros):
            sums = self.range_sums(atoms, submesh, lm, lean)
            if sums is None or not self.splits_microbatch(submesh, lm, lean, num_microbatches, atoms):
                continue
            option = self.option_for(atoms, submesh, lm, lean, rc, num_microbatches, zero=z)
            if math.isfinite(option.time):
                out.append(option)
        return out

    def zero_levels(self, lm: tuple[int, int], zeros: tuple[int, ...] | None = None) -> tuple[int, ...]:
        """The ZeRO-1/2 levels a stage on logical mesh `lm` may take (`zeroed`; 0: none; −1, −2: the
        level with its sharded states offloaded to host memory, where the cluster has a host link):
        with a data axis and replicated gradients that no compressor needs whole; the free search
        (no rule, or one allowing ZeRO) weighs all, a hand-written layout its own (`zeros`)."""
        if lm[0] == 1 or self.compression is not None:
            return (0,)
        if zeros is not None:
            return zeros
        if self.rule is not None and not self.rule.zero:
            return (0,)
        return (0, 1, 2, -1, -2) if self.cluster.offloads else (0, 1, 2)

    def variants(self, submesh: tuple[int, int], m: int, logical: list[tuple[int, int]] | None = None,
                 recompute: tuple | None = None, zeros: tuple[int, ...] | None = None,
                 ) -> list[tuple[tuple[int, int], bool, bool | str, int]]:
        """The (logical mesh, lean, recompute, ZeRO level) combinations a stage on `submesh` may use
        (ZeRO-2 only where the stage may hold every device: one-stage plans, `zeroed`); a rank's
        microbatch holds the samples the model needs (`sample_needs`)."""
        whole = submesh[0] * submesh[1] == self.world
        recompute = self.recomputes if recompute is None else recompute
        return [(lm, lean, rc, z) for lm in (logical or logical_meshes(submesh)) if self.splits_batch(m, lm[0])
                for lean in self.shardings(submesh, lm) for rc in recompute for z in self.zero_levels(lm, zeros)
                if abs(z) < 2 or whole]

    def shardings(self, submesh: tuple[int, int], lm: tuple[int, int]) -> tuple[int, ...]:
        """The shardings (`SHARDINGS`) that place some atom otherwise than every earlier one on this
        mesh: where every atom solves alike under two, the second would give the search each of the
        first's options again."""
        key = (submesh, lm)
        if key not in self._shardings:
            placed = {}
            for lean in SHARDINGS:
                self.range_sums((0, 0), submesh, lm, lean)  # solves every atom (read below without counting hits)
                results = (self._cache[(h, submesh, lm, lean)] for h in self.hashes)
                placed[lean] = [(r.params, r.ops) if r is not None else None for r in results]
            self._shardings[key] = tuple(lean for lean in SHARDINGS if all(placed[k] != placed[lean] for k in range(lean)))
        return self._shardings[key]

    def splits_batch(self, m: int, dp: int) -> bool:
        """Whether m microbatches over a data axis of dp leave each rank whole samples, as many as the
        model needs (`sample_needs`)."""
        return (self._batch // m) % dp == 0 and self.needs.holds(self._batch // m // dp)

    def zeroed(self, z: int, submesh: tuple[int, int], lm: tuple[int, int], m: int, whole: bool | np.ndarray,
               q: dict) -> dict:
        """A stage's terms under ZeRO-1 (z = 1) or ZeRO-2 (z = 2) of its data-replicated parameters,
        as FSDP2 runs them (`runtime.parallel.shard_data_axis`): gathered at the step's first
        forward and kept to its last backward (the parameters stay whole), the optimizer's states
        and fp32 master sharded over dp (Rajbhandari et al., 2020); ZeRO-2 the gradients too, then
        reduce-scattered after every microbatch's backward, ZeRO-1 after the last only. The
        all-reduce becomes a reduce-scatter (hidden behind the last backward as the buckets were)
        and an all-gather at the step's first forward (hidden behind it as far as the link
        overlaps), the same bytes. ZeRO-2 runs in one-stage plans only (`whole`: torch's pipeline
        schedules keep a stage's gradients whole until its last backward); a stage with ZeRO-3
        weights (S(0): not all trainable bytes averaged) or without weights takes neither.
        FSDP2 reduce-scatters a unit's gradients from a flat copy of them: a transient of the
        largest layer's gradients (`unit`), twice under ZeRO-2, whose unsharded gradients are not
        in the states. z < 0: level −z with FSDP2's `CPUOffloadPolicy` (ZeRO-Offload, Ren et al.,
        2021, without its overlap): the shards (fp32 weights, gradients, Adam's moments) leave the
        device; their copies over the host link ride with the collectives, and the optimizer's
        step runs at the host's memory bandwidth, after backward as on the device (`host_s`).
        `q`: states, grads, averaged, trainable, elements, tensors, sync (seconds, not yet
        exposed), fwd, bwd (per microbatch), unit; arrays or floats. Returns the changed ones, the
        exposed sync (`sync`, `unhidden`), the `transient` to add and `valid`."""
        dp, link = lm[0], self.data_link(submesh, lm)
        level = abs(z)
        host = self.cluster.host_link if z < 0 and self.cluster.offloads else None
        states, grads, averaged, elements = q["states"], q["grads"], q["averaged"], q["elements"]
        width = np.where(elements > 0, averaged / np.where(elements > 0, elements, 1), 4.0)  # bytes per element
        # Adam's fp32 moments and, under 16-bit weights, the fp32 master (`model_state_memory`);
        # with fp32 weights FSDP2's sharded copy of each beside the gathered one
        opt = elements * (OPTIMIZER_STATE_BYTES["adam"] + np.where(width < 4, 4.0, 0.0))
        states = states - opt * (1 - 1 / dp) + np.where(width >= 4, averaged / dp, 0.0)
        half = q["sync"] / 2  # the ring all-reduce's two halves, as the link runs each (`Link.*_factor`)
        scatter, gather = half * link.scatter_factor, half * link.gather_factor
        bwd, fwd, host_s = q["bwd"], q["fwd"], 0.0 * elements
        # FSDP2's copies around its collectives, memory traffic on the rank itself: the gathered
        # parameters copied out of the all-gather's buffer (read and written), each reduce-scatter's
        # gradients copied into its flat input, and under ZeRO-2 the reduced shard added to the one
        # the earlier microbatches left (both read, one written)
        bandwidth = self.cluster.device.memory_bandwidth
        copy_out, copy_in, accumulate = 2 * averaged / bandwidth, 2 * grads / bandwidth, 3 * grads / dp / bandwidth
        if level == 2:
            states, grads = states - grads * (1 - 1 / dp), grads / dp
            # every other microbatch's reduce-scatter, with its copy in and the sum after it
            bwd = bwd + (exposed_time(scatter, bwd, link) + copy_in + accumulate) * (m - 1) / m
        if host is not None:  # the shards to host memory: the device keeps the gathered weights
            states = states - opt / dp - np.where(width >= 4, averaged / dp, 0.0) - (grads if level == 2 else 0.0)
            grads = grads * (level != 2)
            # fp32 shards: copied in before the all-gather, the reduced gradients out after each
            # reduce-scatter; the optimizer steps on the host's memory, shared by its devices
            copy = p2p_time(4.0 * elements / dp, host)
            scatter, gather = scatter + copy, gather + copy
            if level == 2:
                bwd = bwd + exposed_time(copy, bwd, host) * (m - 1) / m
            host_s = elements / dp * self.cluster.device.optimizer_bytes \
                / (self.cluster.host_memory_bandwidth / self.cluster.devices_per_host)
        # every trainable byte averaged from replicas: not one weight S(0) already (a norm's included;
        # a relative tolerance let a final norm's few kB pass beside billions, and the plan was refused)
        valid = (averaged > 0) & (np.abs(averaged - q["trainable"]) < 1.0) & (whole if level == 2 else True)
        return {"states": states, "grads": grads, "averaged": 0.0 * averaged,
                "elements": elements / dp * (host is None), "host_s": host_s, "dtensors": q["tensors"], "bwd": bwd,
                "sync": exposed_time(scatter, bwd, link) + exposed_time(gather, fwd, link) + copy_in + copy_out,
                "unhidden": scatter + gather, "transient": q["unit"] * (2 if level == 2 else 1), "valid": valid}

    def splits_microbatch(self, submesh: tuple[int, int], lm: tuple[int, int], lean: bool, m: int,
                          atoms: tuple[int, int] | None = None) -> bool:
        """Whether the shardings of atoms [a, b) (default: all) hold for a microbatch: atoms are solved
        at the whole batch, and a batch dimension their tensor axis splits must still divide evenly
        over dp × tp in each of the m microbatches, at least 2 per rank (DTensor infers a wrong
        stride from a local dimension of size 1, and a view of it then fails)."""
        if lm[1] == 1:
            return True
        a, b = atoms or (0, len(self.atoms))
        return all(size % (m * pieces) == 0 and size // (m * pieces) > 1
                   for splits in self._tp_splits(submesh, lm, lean)[a:b] for size, pieces in splits)

    def _tp_splits(self, submesh: tuple[int, int], lm: tuple[int, int], lean: bool) -> list[frozenset]:
        """Each atom's `StageSharding.tp_batch` on this mesh (solving them once), cached."""
        key = (submesh, lm, lean)
        if key not in self._splits:
            self.range_sums((0, 0), submesh, lm, lean)
            self._splits[key] = [getattr(self._cache.get((h, submesh, lm, lean)), "tp_batch", frozenset())
                                 for h in self.hashes]
        return self._splits[key]

    def _base(self, bounds: np.ndarray, submesh: tuple[int, int], lm: tuple[int, int], lean: int, m: int) -> dict:
        """`variant_table`'s terms that no recompute or ZeRO choice changes, for one (mesh, sharding,
        microbatch count): the search asks for every such variant in turn, so the last is kept."""
        key = (bounds.tobytes(), submesh, lm, lean, m)
        if self._last_base[0] == key:
            return self._last_base[1]
        self.range_sums((0, 0), submesh, lm, lean)  # fills the prefix sums
        prefix = self._prefix[(submesh, lm, lean)][bounds]  # [layer boundary, quantity]
        sums = prefix[None, :, :] - prefix[:, None, :]  # [i, j, quantity]
        q = SimpleNamespace(**{c.name: sums[..., c] for c in Col})
        excess = (bounds.tobytes(), submesh, lm, lean)  # the same for every m
        if excess not in self._excess:
            self._excess[excess] = self.tied_excess(bounds, submesh, lm, lean)
        states = q.states - self._excess[excess]
        comm = q.comm - q.latency + q.latency * m  # per microbatch below: bytes scale with it, α does not
        with np.errstate(invalid="ignore", divide="ignore"):  # one bucket latency per 25 MB of the stage's weights
            n_buckets = bucket_count(q.trainable)
            sync = q.sync + np.where(q.trainable > 0, q.weighted_latency / np.where(q.trainable > 0, q.trainable, 1)
                                     * n_buckets, 0)
        # a linear layer's backward computes its input's and its weight's gradients at equal cost
        # (Qi et al. price T_W = T_B): the weights' half of the computation, none of its collectives
        weight = q.bwd / m / 2
        # autocast copies the weights once per microbatch and keeps them until its backward
        fwd, bwd, acts = q.fwd / m, q.bwd / m, q.acts / m + q.copies
        fwd, bwd = fwd + q.fixed_f * (1 - 1 / m), bwd + q.fixed_b * (1 - 1 / m)  # every microbatch issues every op
        # the tensor axis's ranks meet at each of its collectives and wait for the slowest there
        # (`straggler_wait`), K times a microbatch after 1/K of its computation c each: √(K·c) in all
        waits = self.straggler_wait(q.tp_syncs * (fwd + bwd), lm[1])
        share = np.divide(fwd, fwd + bwd, out=np.full_like(fwd, 0.5), where=fwd + bwd > 0)
        fwd, bwd = fwd + waits * share + comm / 2 / m, bwd + waits * (1 - share) + comm / 2 / m
        # ZeRO-3 gathers the parameters again for every microbatch's forward; in one stage for its
        # backward too, and reduce-scatters every microbatch's gradients (`runtime.parallel`). torch's
        # pipeline schedules keep them gathered through the backwards and reduce once, after the last
        fwd = fwd + q.gather / 2 * (1 - 1 / m)
        if bounds[0] == 0 and bounds[-1] == len(self.atoms):
            bwd[0, -1] += (q.gather[0, -1] / 2 + q.scatter[0, -1]) * (1 - 1 / m)
        loss = np.where(bounds == len(self.atoms), self.loss_bytes / (lm[0] * m), 0.0)[None, :]  # ranges ending the model
        transient = 2 * loss + q.gathered * self.held_in_pipeline(lm[0])
        inbound = np.array([self.cut[a - 1] if a > 0 else 0.0 for a in bounds]) / (lm[0] * m)  # each layer's input
        cut_after = np.array([self.cut[b - 1] if 0 < b < len(self.atoms) else 0.0 for b in bounds])
        link = stage_send_link(self.cluster, submesh)  # each rank sends its slice (Megatron's scatter)
        send = np.where(cut_after > 0, p2p_time(cut_after / (lm[0] * lm[1] * m), link), 0.0)[None, :] \
            * np.ones_like(acts)
        broken = None
        if lm[1] > 1 and any(self._tp_splits(submesh, lm, lean)):  # a range with an atom whose batch split m breaks
            cuts = np.concatenate([[0], np.cumsum([not self.splits_microbatch(submesh, lm, lean, m, (k, k + 1))
                                                   for k in range(len(self.atoms))])])[bounds]
            broken = cuts[None, :] - cuts[:, None] > 0
        base = {"prefix": prefix, "q": q, "states": states, "sync": sync, "weight": weight, "fwd": fwd, "bwd": bwd,
                "acts": acts, "loss": loss, "transient": transient, "inbound": inbound, "send": send, "broken": broken,
                "unhidden": self.exposed_sync(sync, 0.0, submesh, lm, q.trainable, m * (fwd + bwd))}
        self._last_base = (key, base)
        return base

    def variant_table(self, bounds: np.ndarray, submesh: tuple[int, int], variant, m: int,
                      depth: int | None = None) -> dict[str, np.ndarray]:
        """The stage cost, for every layer range [bounds[i], bounds[j]) at once: arrays indexed [i, j]
        (inf time where an atom has no sharding on this mesh). The one formula: `option_for` reads
        an entry (the DP ranks by the whole table, the plan is priced by the entry). With `depth`
        (recomputing variants): each range [i, j) recomputes only its first `depth` layers, those
        between bounds i and i + depth.

        What a recomputing stage checkpoints (a layer's input kept, one layer recomputed at a time;
        ZeRO's units; selective recomputation's attention, a layer's at a time) follows
        `layer_starts`, not `bounds`: the bounds may cut finer (a range may begin or end inside a
        layer, whose part in the range is then a layer of its own), and every range is priced as
        `option_for` prices it over its own layers. Partial recomputation (`depth`) ends at a layer
        start: `ends` marks the bounds where it may."""
        lm, lean, rc, z = variant
        starts = self._starts(bounds)
        b = self._base(bounds, submesh, lm, lean, m)
        q, prefix, inbound, loss = b["q"], b["prefix"], b["inbound"], b["loss"]
        states, sync, weight, fwd, bwd, acts, transient = (
            b[k] for k in ("states", "sync", "weight", "fwd", "bwd", "acts", "transient"))
        if bounds[0] == 0 and bounds[-1] == len(self.atoms):  # the whole model in one stage
            transient = transient.copy()
            transient[0, -1] = self.one_stage_transient(prefix, bounds, 2 * loss[0, -1], m, rc)
        partial: dict[str, np.ndarray] = {}
        if rc == SELECTIVE:  # the attention cores' activations recomputed, one layer's at a time
            bwd = bwd + q.attention_s / m
            acts = acts - (q.attention - q.attention_kept) / m + inbound[:, None]
            transient = transient + self._largest(prefix, starts, Col.attention) / m
        elif rc:  # keep each layer's input; one layer's activations (and the weight copies) at a time
            plain = acts + inbound[:, None]  # without recomputation
            checkpointed = np.where(starts, inbound, 0.0)  # the inputs kept where a layer starts
            # [k]: the inputs of the layers starting at bounds 1 … k kept, the activations before bound k not
            kept = np.cumsum(checkpointed) - np.concatenate(
                [[0.0], np.cumsum(np.diff(prefix[:, Col.acts]) / m + np.diff(prefix[:, Col.copies]))])
            held = self._largest(prefix, starts, Col.acts) / m + q.copies  # one layer's, recomputed
            if depth is None:
                # a range's first layers only, to a layer start k (`search._fastest`): plain + kept[k] - kept[i]
                partial = {"again": fwd, "plain_acts": plain, "depth": kept, "ends": starts}
                # the range's own input and the inputs of the layers starting inside it
                inputs = np.concatenate([[0.0], np.cumsum(checkpointed[:-1])])
                acts = inputs[None, :] - inputs[:, None] + (inbound - checkpointed)[:, None]
                bwd, transient = bwd + fwd, transient + held
            else:  # the first `depth` layers of each range as above, the rest as without recomputation
                rows = np.arange(len(bounds))
                head = np.minimum(rows + depth, len(bounds) - 1)
                bwd = bwd + fwd[rows, head][:, None]
                transient = transient + held[rows, head][:, None]
                acts = plain + (kept[head] - kept)[:, None]
        else:  # a later stage keeps what it received until that microbatch's backward
            acts = acts + inbound[:, None]
        # the loss keeps its log-probabilities; in a pipeline the schedule keeps the logits as well
        logits = loss * np.where(bounds > 0, 2.0, 1.0)[:, None]
        acts = acts + logits
        if partial:
            partial["plain_acts"] = partial["plain_acts"] + logits
        fwd, bwd = fwd + self.loss_time(loss) / 2, bwd + self.loss_time(loss) / 2
        valid = True
        whole = (bounds[:, None] == 0) & (bounds[None, :] == len(self.atoms))
        grads, averaged, elements, dtensors, tp_grad = q.grads, q.averaged, q.elements, q.dtensors, q.tp_grad
        # the gradients a lowered backward returns at once come after the loss's backward (outside
        # the graph) has freed one of its two logits-sized temporaries; the other is the graph's
        # incoming gradient, held while it runs: the larger of the two moments
        at_once = transient - loss + grads
        transient = np.where(self.graph_backward(whole, lm, rc, z, m), np.maximum(transient, at_once), transient)
        zq_in = {"states": states, "grads": grads, "averaged": averaged, "trainable": q.trainable, "elements": elements,
                 "tensors": q.tensors, "sync": sync, "fwd": fwd, "bwd": bwd,
                 "unit": self._largest(prefix, starts, Col.grads) if z else 0.0}  # the largest layer's gradient bytes

        compute_bwd = bwd  # (before ZeRO's terms: `bwd` is rebound below to the backward with them)

        def timed(at: Any, less: Any = 0.0) -> tuple:
            """(backward, exposed sync, ZeRO's terms) of the ranges `at` with a backward `less` shorter:
            how long the synchronisation is hidden depends on the backward beside it."""
            bwd_at = np.asarray(compute_bwd)[at] - less
            computed = m * (_at(fwd, at) + bwd_at)  # since the data axis's ranks last met
            if z:
                zq = self.zeroed(z, submesh, lm, m, whole[at], {k: _at(v, at) for k, v in zq_in.items()} | {"bwd": bwd_at})
                wait = self.data_wait(computed, lm, _at(q.trainable, at))
                return zq["bwd"], zq["sync"] + wait, {**zq, "unhidden": zq["unhidden"] + wait}
            return bwd_at, self.exposed_sync(_at(sync, at), bwd_at, submesh, lm, _at(q.trainable, at), computed), None

        everywhere = (slice(None), slice(None))
        bwd, exposed, zq = timed(everywhere)
        if z:
            states, grads, averaged, elements, dtensors, unhidden, valid = (
                zq[k] for k in ("states", "grads", "averaged", "elements", "dtensors", "unhidden", "valid"))
            transient = transient + zq["transient"]
            tp_grad = tp_grad + zq["host_s"]  # after the last backward: an offloaded stage's step on the host
        else:
            unhidden = b["unhidden"]
        send = b["send"]
        # after the last backward, before the optimizer: the tensor axis's partial weight gradients
        optimizer = self.optimizer_s(elements, q.tensors, dtensors) + tp_grad
        bwd = np.where(np.asarray(valid), bwd, np.inf)
        time = fwd + bwd + send
        time = np.where(np.isnan(time), np.inf, time)
        if b["broken"] is not None:  # a range with an atom whose batch split the microbatches break
            time = np.where(b["broken"], np.inf, time)
        if partial:
            def key_at(at: Any, less: Any) -> np.ndarray:
                """The DP's key (`search._stacked`) of ranges `at` recomputing `less` seconds less."""
                bwd_at, exposed_at, _ = timed(at, less)
                return np.where(np.isfinite(time[at]), _at(fwd, at) + bwd_at + _at(send, at)
                                + (exposed_at + _at(optimizer, at)) / m, np.inf)
            partial["key_at"] = key_at
        # under a split backward torch's first stage runs nothing in "I" (its input needs no gradient)
        # and its whole backward in "W" (`PipelineStage.backward_weight_one_chunk`)
        weight = np.where((bounds == 0)[:, None], bwd, weight)
        # the synchroniser points plain buckets' gradients at their zeroed views at the step's start
        # (`GradSync.zero_grad`): held before the first backward (a compressor's stay None until then)
        bucketed = averaged if self.compression is None or lm[0] == 1 else 0.0
        return {"time": time, "forward": fwd, "backward": bwd, "send": send, "sync": exposed, "unhidden": unhidden,
                "states": states, "acts": acts, "transient": transient, "grads": np.maximum(grads - bucketed, 0.0),
                "averaged": flat_held(averaged, self.largest_grad), "optimizer": optimizer, "weight": weight, **partial}

    def range_sums(self, atoms, submesh, lm, lean) -> np.ndarray | None:
        """The quantities of `Col` summed over atoms [a, b), from prefix sums (None: an atom of the
        range has no sharding on this mesh)."""
        key = (submesh, lm, lean)
        if key not in self._prefix:
            rows = []
            for k in range(len(self.atoms)):
                p = self.atom(k, submesh, lm, lean)
                row = np.full(len(Col), np.nan)
                if p is not None:
                    f, b = self.flops[k]
                    share = f / (f + b) if f + b else 0.5
                    c, mem = p.cost, p.memory  # the atom's bucket latency is replaced by the stage's (`variant_table`)
                    bucketed = lm[0] > 1 and not any(pl[0] == "S(0)" for pl in p.params.values())  # GradSync's copies
                    latency = c["bucket_latency_s"] * bucket_count(c["trainable_bytes"])
                    fixed = c.get("fixed_s", 0.0)
                    row[:] = 0.0
                    for col, value in {
                            Col.fwd: c["compute_s"] * share, Col.bwd: c["compute_s"] * (1 - share),
                            Col.comm: c["comm_s"] + c["reshard_s"], Col.sync: c["grad_sync_s"] - latency,
                            Col.states: mem["model_states"], Col.acts: mem["activations"],
                            Col.trainable: c["trainable_bytes"],
                            Col.weighted_latency: c["bucket_latency_s"] * c["trainable_bytes"],
                            Col.latency: c["comm_latency_s"], Col.tp_syncs: c.get("tp_syncs", 0),
                            Col.copies: mem.get("weight_copies", 0.0),
                            Col.gathered: mem.get("gathered", 0.0), Col.grads: mem.get("gradients", 0.0),
                            Col.averaged: c["trainable_bytes"] if bucketed else 0.0,
                            Col.gather: c.get("zero_gather_s", 0.0), Col.scatter: c.get("zero_scatter_s", 0.0),
                            Col.fixed_f: fixed * share, Col.fixed_b: fixed * (1 - share),
                            Col.elements: c.get("optimizer_elements", 0.0), Col.tensors: c.get("optimizer_tensors", 0.0),
                            Col.dtensors: c.get("optimizer_dtensors", 0.0), Col.tp_grad: c.get("tp_grad_s", 0.0),
                            Col.attention: mem.get("attention", 0.0), Col.attention_s: c.get("attention_s", 0.0),
                            Col.attention_kept: mem.get("attention_kept", 0.0)}.items():
                        row[col] = value
                rows.append(row)
            self._prefix[key] = np.vstack([np.zeros(len(Col)), np.cumsum(np.array(rows), axis=0)])
        prefix = self._prefix[key]
        sums = prefix[atoms[1]] - prefix[atoms[0]]
        return None if np.isnan(sums).any() else sums

    def layer_bounds(self, atoms: tuple[int, int]) -> np.ndarray:
        """Atoms [a, b)'s first atom, the planner's layer starts inside it, and b."""
        inside = [a for a in (self.layer_starts or range(len(self.atoms))) if atoms[0] < a < atoms[1]]
        return np.array([atoms[0], *inside, atoms[1]])

    def option_for(self, atoms, submesh, lm, lean, rc, m: int, depth: int | None = None, zero: int = 0
                   ) -> StageOption:
        """The stage of atoms [a, b) under one variant, per microbatch of `m`: `variant_table`'s entry
        for the range (its layers as the table's bounds, so a recomputing range recomputes, and
        keeps the inputs of, the planner's layers). `rc` with `depth`: recompute only the range's
        first `depth` layers (Mist, AdaPipe: as many as memory needs); the later ones keep their
        activations. `zero`: ZeRO-1/2 (`zeroed`; an option it cannot apply to has infinite time)."""
        bounds = self.layer_bounds(atoms)
        depth = depth if rc is True and depth is not None and 1 <= depth < len(bounds) - 1 else None
        t = self.variant_table(bounds, submesh, (lm, lean, rc, zero), m, depth)
        at = (0, len(bounds) - 1)
        v = [float(np.broadcast_to(t[k], t["time"].shape)[at]) for k in (
            "forward", "backward", "send", "sync", "states", "acts", "transient", "grads", "averaged", "optimizer",
            "weight", "unhidden")]
        return StageOption(lm, lean, rc, *v, depth, abs(zero), zero < 0)

    def _starts(self, bounds: np.ndarray) -> np.ndarray:
        """Which of `bounds` a layer starts at (`layer_starts`; all where it is None)."""
        if self.layer_starts is None:
            return np.ones(len(bounds), dtype=bool)
        return np.isin(bounds, self.layer_starts)

    @staticmethod
    def _largest(prefix: np.ndarray, starts: np.ndarray, column: int) -> np.ndarray:
        """[i, j]: the largest layer's `column` among the layers of [bounds[i], bounds[j]) (`prefix`:
        the prefix sums' rows at the bounds; `starts`: the bounds a layer starts at; a range's first
        and last layers are their parts inside it). A layer's part grows to the layer as the range's
        end passes through it, so a running maximum over the ends sees every whole layer once."""
        at = np.arange(len(starts))
        last = np.maximum.accumulate(np.where(starts, at, 0))  # the layer start at or before each bound
        begun = np.maximum(at[:, None], np.concatenate([[0], last[:-1]])[None, :])  # [i, k]: of the layer ending at k
        part = prefix[None, :, column] - prefix[begun, column]
        return np.maximum.accumulate(np.where(at[None, :] > at[:, None], part, 0.0), axis=1)

    def optimizer_s(self, elements, tensors, dtensors):
        """The optimizer's step on a stage's shard of the weights, and the all-reduce of the loss
        over every rank that ends each step (a latency)."""
        return optimizer_time(elements, tensors, self.cluster.device, dtensors) \
            + all_reduce_time(8.0, self.world, self.cluster.intra_host)

    def held_in_pipeline(self, dp: int) -> float:
        """The part of ZeRO-3's gathered bytes a pipeline stage holds at once: torch's schedules
        keep every unit's parameters and unsharded gradients from the first backward on and
        reduce-scatter after the last, one unit at a time (its buffer is left out: the stage's
        activations are freed by then); the sharded gradients the states count only appear then."""
        width = PRECISIONS[self.graph.precision].itemsize if self.graph.precision else 4
        return (2 * width - 4 / dp) / (2 * width + 4)

    @staticmethod
    def graph_backward(whole, lm: tuple[int, int], rc: bool | str, zero: int, m: int):
        """Where a microbatch's backward returns all of the stage's gradients at once, beside those
        accumulated from the earlier microbatches (a transient of the stage's gradient bytes, once
        the loss's backward has freed one of its own: `variant_table` takes the larger moment): a
        stage lowered to one backward graph (`runtime.lower`: a pipeline's, a tensor axis's, a
        recomputing one's) with more than one microbatch. Autograd on the module (plain data
        parallelism) adds each gradient in as it comes; ZeRO's layers (`Segmented`) return a
        layer's at a time, which `zeroed` counts. `whole`: the range is the whole model (arrays too)."""
        eager = whole & (lm[1] == 1) & (not rc)
        return ~eager & (m > 1) & (not zero) if isinstance(eager, np.ndarray) else (not eager and m > 1 and not zero)

    def one_stage_transient(self, prefix: np.ndarray, bounds: np.ndarray, loss: float, m: int, rc: bool | str
                            ) -> float:
        """`gathered_peak` over the layers of a one-stage plan (ZeRO-3: `runtime.parallel.shard_data_axis`);
        `prefix`: the prefix sums' rows at `bounds`. A recomputing stage frees little as its
        backward goes (layer inputs), so nothing is counted as freed; a selective one frees what
        its layers keep, the attention cores' aside. In a pipeline torch's
        schedules keep every layer gathered until the last backward: the stage's sum is right there."""
        starts = {0, *(self.layer_starts or range(len(self.atoms)))}
        ends = [i for i, b in enumerate(bounds) if b in starts or i == len(bounds) - 1]
        if len(ends) < 2:
            return loss
        per_layer = np.diff(prefix[ends], axis=0)
        if rc is True:
            return gathered_peak(per_layer[:, Col.gathered], self.graph.precision, loss)
        held = per_layer[:, Col.acts] - (per_layer[:, Col.attention] - per_layer[:, Col.attention_kept]
                                         if rc == SELECTIVE else 0.0)
        return gathered_peak(per_layer[:, Col.gathered], self.graph.precision, loss, held / m)

    def shared_in_group(self, stages: list[tuple[tuple[int, int], tuple[int, int], tuple[int, int], int]]
                        ) -> list[tuple[float, float]]:
        """(state bytes, of them gradient bytes) each of a device group's stages (atoms, submesh,
        logical mesh, sharding) counts of a tied weight an earlier stage of the group holds: the
        runtime keeps one parameter for the rank's stages (`LocalStages`), with one gradient and one
        optimizer state (GPT's embedding and output layer on a V's first group)."""
        out, held = [], set()
        for atoms, submesh, lm, lean in stages:
            states = grads = 0.0
            for f, ks in self.tied.items():
                inside = [self._cache.get((self.hashes[k], submesh, lm, lean)) for k in ks if atoms[0] <= k < atoms[1]]
                inside = [s for s in inside if s is not None and f in s.param_states]
                if inside and f in held:
                    top = max(inside, key=lambda s: s.param_states[f])
                    states, grads = states + top.param_states[f], grads + top.param_grads.get(f, 0.0)
                if inside:
                    held.add(f)
            out.append((states, grads))
        return out

    def tied_excess(self, bounds: np.ndarray, submesh: tuple[int, int], lm: tuple[int, int], lean: bool) -> np.ndarray:
        """[i, j]: the state bytes counted more than once in atoms [bounds[i], bounds[j]) (tied
        weights: all their atoms' shares but the largest)."""
        excess = np.zeros((len(bounds), len(bounds)))
        for f, ks in self.tied.items():
            share = {k: getattr(self._cache.get((self.hashes[k], submesh, lm, lean)), "param_states", {}).get(f, 0.0)
                     for k in ks}  # solved by range_sums already (read without counting a hit)
            for i, a in enumerate(bounds):
                for j in range(i + 1, len(bounds)):
                    inside = [share[k] for k in ks if a <= k < bounds[j]]
                    if len(inside) > 1:
                        excess[i, j] += sum(inside) - max(inside)
        return excess


_BATCH_NORMS = ("aten.batch_norm", "aten._native_batch_norm_legit_functional", "aten.native_batch_norm",
                "aten.cudnn_batch_norm", "aten._batch_norm_with_update")


@dataclass(frozen=True)
class SampleNeeds:
    """What a rank's microbatch must hold for the program that runs to be the one priced: the
    shardings are solved at the whole batch and scaled down to a microbatch, which holds only where
    the model's program at b samples is its whole-batch program cut into B / b pieces."""

    fewest: int = 1  # samples at least: a BatchNorm that trains on a 1×1 map needs 2
    group: int = 1  # samples in one unit of a batch dimension that groups them: a microbatch holds whole units
    why: str = ""  # what sets them, for the message a layout that breaks them gets

    def holds(self, samples: int) -> bool:
        return samples >= self.fewest and samples % self.group == 0


def sample_needs(graph: OpGraph, batch: int) -> SampleNeeds:
    """A BatchNorm that trains needs more than one value per channel (torch refuses one), and where
    it normalises a 1×1 map, one sample gives one. A batch dimension smaller than the batch groups
    samples (GShard's MoE routes groups of `expert_group` tokens, [B·T/group, group, M]): a
    microbatch with part of a group runs another program (its groups shrink, and the experts'
    capacity with them; the planner's capture scaled down would price groups that are not there),
    so a rank's microbatch must hold whole groups, as the data axis must divide the dimension
    (`StageGraph._check_batch`)."""
    fewest, why = 1, []
    for node in graph:
        if node.op.startswith(_BATCH_NORMS) and node.inputs and len(node.inputs[0].shape) >= 2:
            shape = node.inputs[0].shape
            per_sample = math.prod(shape) // (shape[0] * shape[1])  # values per channel of one sample
            if shape[0] == batch and per_sample == 1:
                fewest = 2
                why.append(f"a BatchNorm ({node.name}) normalises a 1×1 map over them")
                break
    group, grouping = 1, None
    dims = whole_batch_dims(graph)[0]
    for node in graph:
        for k, d in enumerate(dims.get(node.name) or []):
            if d is not None and k < len(node.outputs):
                size = node.outputs[k].shape[d]
                unit = batch // math.gcd(batch, size)  # samples per index of the dimension
                if math.lcm(group, unit) > group:
                    group, grouping = math.lcm(group, unit), (node, size)
    if grouping:
        node, size = grouping
        why.append(f"{node.module_path or 'the model'} groups {group} samples ({node.name}'s batch dimension "
                   f"is {size} at a batch of {batch})")
    return SampleNeeds(max(fewest, group), group, "; ".join(why))
