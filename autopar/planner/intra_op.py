"""Intra-op pass: the sharding of every op of a stage on a logical mesh (dp, tp), by ILP.

1. Describe each op as an einsum (`rules.py`). Anchors (matmuls, convolutions, embeddings,
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

The structure lives in `stage_graph.py`, the strategies' costs in `strategy_costs.py`, the edges'
in `edge_costs.py`; this module builds the ILP, solves it and assembles the result.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from autopar.contract.buckets import bucket_count
from autopar.cost_models import ClusterSpec, collective_time
from autopar.cost_models.comm import all_reduce_latency
from autopar.planner.edge_costs import edge_collectives, edge_costs, output_costs
from autopar.planner.graph import OpGraph
from autopar.planner.ilp import InfeasibleError, Problem, solve
from autopar.planner.placement import R, redistribution, shard, shard_dim
from autopar.planner.stage_graph import Mesh, StageGraph
from autopar.planner.strategy_costs import DTYPE_BYTES, Evaluation, Rule, Strategy, StrategyCosts


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
    param_grads: dict[str, float] = field(default_factory=dict)  # fqn -> its gradient's part of that
    strategies: dict[str, Strategy] = field(default_factory=dict)  # anchor -> the strategy chosen for it
    # (size at the whole batch, dp × tp) of each batch dimension the tensor axis splits: a microbatch
    # count m holds only where every such size leaves ≥ 2 per rank (`StageCosts.splits_microbatch`)
    tp_batch: frozenset[tuple[int, int]] = frozenset()
    # how the ops read the values the graph takes from outside (`reads`), and every op's placement
    # on the tensor axis per output: a stage of several atoms is priced from them (`StageCosts.collectives`)
    reads: list[dict[str, Any]] = field(default_factory=list)
    outs: dict[str, list[str]] = field(default_factory=dict)

    @property
    def time(self) -> float:
        return self.cost["total_s"]


def _bucket_latency(stage: StageGraph) -> float:
    """Per-message latency of one gradient bucket's synchronisation on the data axis."""
    return all_reduce_latency(stage.mesh.dp, stage.mesh.dp_link)


@dataclass
class StageProblem:
    """A stage's sharding problem, built once (the strategies, their evaluations, the ILP's costs)
    and solved under as many memory limits as the planner asks (`solve_stage`)."""

    stage: StageGraph
    logical: tuple[int, int]
    strategies: dict[str, list[Strategy]]
    classes: list[str]
    evals: dict[str, list[Evaluation]]
    problem: Problem  # its memory set per solve
    states: list[np.ndarray]  # per ILP node: each strategy's model states (and 16-bit weight copies)
    activations: list[np.ndarray]  # and its activations

    def least_memory(self, activation_weight: float = 1.0) -> float:
        """What the leanest sharding needs, counting the activations at `activation_weight`."""
        return float(sum((s + activation_weight * a).min() for s, a in zip(self.states, self.activations)))

    def memory_of(self, result: StageSharding, activation_weight: float = 1.0) -> float:
        """What `result` (a solution of this problem) needs, counted as `least_memory` counts."""
        picks = [self.strategies[c].index(result.strategies[c]) for c in self.classes]
        return float(sum(s[i] + activation_weight * a[i] for s, a, i in zip(self.states, self.activations, picks)))


def stage_problem(graph: OpGraph, cluster: ClusterSpec, submesh: tuple[int, int], logical: tuple[int, int],
                  rule: Rule | None = None, fixed: dict[str, Strategy] | None = None) -> StageProblem:
    """The sharding problem of `graph` on logical mesh `logical` (dp, tp) over `submesh` (hosts, devices).

    `rule` narrows each anchor's choices (a hand-written layout such as Megatron-LM's): the ILP
    still places everything else consistently and prices it the same way. `fixed` (a result's
    `strategies`) prices that sharding again, on this cluster, without choosing."""
    mesh = Mesh.of(cluster, submesh, logical)
    stage = StageGraph(graph, mesh)
    costs = StrategyCosts(stage, cluster)
    anchors = [n for n in stage.names if stage.root.get(n) == n]
    strategies = {a: costs.strategies(a, rule) for a in anchors}
    if fixed:
        strategies = {a: [fixed[a]] if a in fixed else options for a, options in strategies.items()}
    stage.tie(strategies)
    classes = [a for a in anchors if stage.cls[a] == a]
    evals = {c: [costs.evaluate(c, s) for s in strategies[c]] for c in classes}
    var = {c: i for i, c in enumerate(classes)}
    def zeros() -> list[np.ndarray]:
        return [np.zeros(len(strategies[c])) for c in classes]

    problem, states, acts = Problem(zeros(), zeros()), zeros(), zeros()
    for a in anchors:
        c = stage.cls[a]
        problem.node_costs[var[c]] += np.array([e.time for e in evals[c]])
        # ZeRO-3's gathered parameters are not summed: FSDP2 gathers a layer at a time (`gathered`
        # is priced per stage: `search._gathered_per_layer`, `search.plan_single_stage`)
        states[var[c]] += np.array([e.state_memory + e.weight_copies for e in evals[c]])
        acts[var[c]] += np.array([e.activation_memory for e in evals[c]])
    for name, cost in output_costs(stage, evals).items():
        problem.node_costs[var[stage.group(name)]] += cost
    for u, v, m in edge_costs(stage, evals):
        problem.add_edge(var[u], var[v], m)
    return StageProblem(stage, logical, strategies, classes, evals, problem, states, acts)


def solve_stage(prepared: StageProblem, memory_limit: float, time_limit_s: float = 30.0,
                activation_weight: float = 1.0) -> StageSharding:
    """The fastest sharding of `prepared` within `memory_limit` bytes per device, counting the
    activations at `activation_weight` beside the model states (0: the states alone, as a pipeline
    stage of many microbatches holds few of the batch's activations at once). Raises
    `InfeasibleError` (with the least memory) where none fits."""
    stage, classes, evals = prepared.stage, prepared.classes, prepared.evals
    problem = dataclasses.replace(prepared.problem, memory_limit=memory_limit, node_memory=[
        s + activation_weight * a for s, a in zip(prepared.states, prepared.activations)])
    sol = solve(problem, time_limit_s)
    var = {c: i for i, c in enumerate(classes)}
    chosen = {c: evals[c][sol.choice[var[c]]] for c in classes}
    anchors = [n for n in stage.names if stage.root.get(n) == n]
    picked = {a: prepared.strategies[a][sol.choice[var[stage.cls[a]]]] for a in anchors}
    result = _result(stage, prepared.logical, chosen, {c: picked[c].zero for c in classes}, sol, problem)
    return dataclasses.replace(result, strategies=picked, tp_batch=_tp_batch(stage, result))


def shard_stage(graph: OpGraph, cluster: ClusterSpec, submesh: tuple[int, int], logical: tuple[int, int],
                memory_limit: float | None = None, time_limit_s: float = 30.0, rule: Rule | None = None,
                fixed: dict[str, Strategy] | None = None) -> StageSharding:
    """Solve the sharding of `graph` on logical mesh `logical` (dp, tp) over `submesh` (hosts,
    devices) within `memory_limit` (default 90 % of the device): `stage_problem`, then `solve_stage`."""
    limit = cluster.device.memory_bytes * 0.9 if memory_limit is None else memory_limit
    return solve_stage(stage_problem(graph, cluster, submesh, logical, rule, fixed), limit, time_limit_s)


def _tp_batch(stage: StageGraph, result: StageSharding) -> frozenset[tuple[int, int]]:
    """Every batch dimension an output or a needed input splits on the tensor axis, as (its size at
    the whole batch, the pieces dp × tp cut it into): atoms are solved at the whole batch, and the
    runtime cannot split a microbatch's dimension unevenly (DTensor refuses a view of it)."""
    if stage.mesh.tp == 1:
        return frozenset()
    pieces = stage.mesh.dp * stage.mesh.tp

    def split(name: str, k: int, placement: str | None) -> set[tuple[int, int]]:
        d = stage.batch_of(name, k)
        if d is None or placement != shard(d):
            return set()
        return {(stage.graph.node(name).outputs[k].shape[d], pieces)}

    out: set[tuple[int, int]] = set()
    for name, (_, on_tp) in result.ops.items():
        out |= split(name, 0, on_tp)
    for name, placements in result.needs.items():
        for i, src in stage.tensor_inputs(name):
            if src is not None and i < len(placements):
                out |= split(src, stage.out_index(name, src), placements[i])
    return frozenset(out)


def _result(stage: StageGraph, logical, chosen: dict[str, Evaluation], zero: dict[str, bool], sol, problem) -> StageSharding:
    params: dict[str, list[str]] = {}
    ops: dict[str, list[str]] = {}
    needs: dict[str, list[str | None]] = {}
    collectives: list[dict[str, Any]] = []
    anchors = [n for n in stage.names if stage.root.get(n) == n]
    for name in stage.names:
        if stage.root.get(name) is None:
            continue
        ev = chosen[stage.group(name)]
        d = stage.batch_of(name, 0)
        outs = ev.out[stage.canon(name)]
        ops[name] = [shard(d) if d is not None and stage.mesh.dp > 1 else R, outs[0] if outs else R]
        if stage.mesh.tp > 1 and stage.graph.node(name).op != "input":
            needs[name] = list(ev.need[stage.canon(name)])
        for fqn, fqn_rep in zip(stage.graph.node(name).params, stage.graph.node(stage.canon(name)).params):
            if stage.owner[fqn] == name:
                params[fqn] = ["S(0)" if zero[stage.group(name)] else R, ev.params[fqn_rep]]
    for a in anchors:  # each anchor's own collectives, under its own node names
        names = {stage.canon(m): m for m in stage.members[a]}
        collectives += [{**c, "node": names.get(c["node"], c["node"]), "tensor": names.get(c["tensor"], c["tensor"])}
                        for c in chosen[stage.cls[a]].collectives]
    collectives = distinct(collectives + edge_collectives(stage, chosen))
    for name in stage.graph.outputs:
        if stage.root.get(name):
            have = chosen[stage.group(name)].out[stage.canon(name)][0]
            if have != stage.free_output(name):
                nbytes = stage.graph.node(name).output_bytes / stage.dp_share(name)
                collectives += [stage.collective(name, k.value, "forward", nbytes * f, "tp", name, output=True)
                                for k, f in redistribution(have, R, stage.mesh.tp)]
    per_anchor = [chosen[stage.cls[a]] for a in anchors]
    compute = sum(e.compute for e in per_anchor)
    gather, scatter = _unit_latency(stage.mesh, collectives)
    comm = sum(e.comm for e in per_anchor) + gather
    grad_sync = sum(e.grad_sync for e in per_anchor)
    per_bucket = _bucket_latency(stage)
    # what this rank synchronises: its own shard of each trainable weight (buckets hold local gradients)
    def trainable_shard(f: str, zero: bool = True) -> float:
        tp = stage.mesh.tp if shard_dim(params[f][1]) is not None else 1
        dp = stage.mesh.dp if zero and params[f][0] == "S(0)" else 1
        return stage.graph.params[f].nbytes / (tp * dp)

    trainable_bytes = sum(trainable_shard(f, zero=False) for f in stage.graph.trainable if f in params)
    latency = per_bucket * bucket_count(trainable_bytes)
    total = problem.objective(sol.choice) + latency + gather
    return StageSharding(
        logical_mesh=tuple(logical),
        params=dict(sorted(params.items())),
        ops=ops,
        cost={"compute_s": compute, "comm_s": comm, "reshard_s": max(0.0, total - latency - compute - comm - grad_sync
                                                                     - sum(e.tp_grad + e.optimizer for e in per_anchor)),
              "grad_sync_s": grad_sync + latency, "total_s": total,
              "bucket_latency_s": per_bucket, "trainable_bytes": trainable_bytes,
              "comm_latency_s": _latency_of(stage.mesh, collectives) + gather,
              "tp_syncs": sum(c["axis"] == "tp" and c["phase"] != "gradient" for c in collectives),
              "zero_gather_s": sum(e.zero_gather for e in per_anchor) + gather,
              "zero_scatter_s": sum(e.zero_scatter for e in per_anchor) + scatter,
              "tp_grad_s": sum(e.tp_grad for e in per_anchor),
              "fixed_s": sum(e.fixed for e in per_anchor),
              "attention_s": sum(e.attention_s for e in per_anchor),
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
                "attention": sum(e.attention_memory for e in per_anchor),
                "attention_kept": sum(e.attention_kept for e in per_anchor),
                "total": sum(e.state_memory + e.activation_memory + e.weight_copies for e in per_anchor),
                "limit": problem.memory_limit},
        solver={"status": sol.status, "objective": sol.objective, "gap": sol.gap, "time_s": sol.solve_time_s,
                "variables": sol.num_variables, "constraints": sol.num_constraints,
                "ilp_nodes": len(problem.node_costs), "anchors": len(anchors)},
        collectives=collectives,
        needs=needs,
        reads=reads(stage, chosen),
        outs={n: list(chosen[stage.group(n)].out[stage.canon(n)]) for n in stage.names if stage.root.get(n)},
        param_states={f: b for e in per_anchor for f, b in e.param_states.items()},
        param_grads={f: b for e in per_anchor for f, b in e.param_grads.items()},
    )


def distinct(collectives: list[dict[str, Any]], segment: Callable[[dict], Any] | None = None
             ) -> list[dict[str, Any]]:
    """One collective per redistribution of a value to a placement (its `move`), however many ops
    read it so: the runtime moves it once for all of them (`ShardedGraph._run`), and their gradients
    add up before the one collective back; with `segment`, once per segment it gives a collective
    (a recomputing stage moves a value once per layer)."""
    seen: set[tuple] = set()
    out = []
    for c in collectives:
        key = (c["tensor"], c["move"], c["phase"], c["kind"], segment and segment(c)) if c.get("move") else None
        if key is None or key not in seen:
            seen.add(key)
            out.append(c)
    return out


def reads(stage: StageGraph, chosen: dict[str, Evaluation]) -> list[dict[str, Any]]:
    """How each op reads a value the graph takes from outside (an input node): the placement it
    needs, and whether it leaves that value's gradient partial. The graph priced such a value
    replicated (or as its input's strategy placed it); in a stage of several atoms it arrives as
    the atom before left it (`StageCosts.collectives`)."""
    out = []
    for name in stage.names:
        if stage.root.get(name) is None or stage.graph.node(name).op == "input":
            continue
        ev, canon = chosen[stage.group(name)], stage.canon(name)
        for i, src in stage.tensor_inputs(name):
            if src is None or stage.graph.node(src).op != "input":
                continue
            need = ev.need[canon][i] if i < len(ev.need[canon]) else None
            k = stage.out_index(name, src)
            out.append({"node": name, "tensor": src, "out": k, "need": need or R, "grad": stage.grad(src),
                        "partial": i in ev.grads_partial.get(canon, ()),
                        "bytes": stage.in_bytes(name, i, src), "batch_dims": stage.batch_rank(src, k)})
    return out


def program_collectives(collectives: list[dict[str, Any]], tp: int, m: int = 1) -> list[dict[str, Any]]:
    """Of a stage's priced collectives, those its lowered program issues (`runtime.lower`), in the
    program's terms: the tensor axis's, forward and backward (gradients' own reductions and
    FSDP2's gathers run outside it), with the bytes each rank hands in (an all-gather's 1/tp of
    what it gathers) for one of `m` microbatches: 1/m of the captured batch's per batch dimension
    of the tensor (`batch_dims`, default 1): a position embedding (none) whole in every microbatch."""
    return [{"node": c["node"], "kind": c["kind"], "phase": c["phase"],
             "bytes": c["bytes"] / m ** c.get("batch_dims", 1) / (tp if c["kind"] == "all_gather" else 1)}
            for c in collectives if c["axis"] == "tp" and c["phase"] in ("forward", "backward")]


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
