"""`autopar plan`: capture, cluster into layers, cost stages, run the stage DP, simulate, emit a Plan."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from autopar.contract import schedules
from autopar.contract.compat import plan_refusal
from autopar.contract.compression import parse
from autopar.contract.errors import AutoparError
from autopar.contract.limits import MAX_DEVICES, MAX_DEVICES_PER_HOST
from autopar.contract.placements import Shard, placed
from autopar.contract.plan import SELECTIVE, Estimate, Plan, StagePlan
from autopar.contract.units import human_bytes
from autopar.contract.workload import Workload
from autopar.cost_models import ClusterSpec
from autopar.cost_models.compression import auto_candidates, compressed_params, unmeasured
from autopar.cost_models.simulator import Hosts, Simulation, StageTimes, simulate, step_floor
from autopar.planner.capture import capture
from autopar.planner.graph import OpGraph
from autopar.planner.ilp import InfeasibleError
from autopar.planner.inter_op import INF, candidates, microbatch_counts, submesh_shapes
from autopar.planner.intra_op import best_sharding, logical_meshes, program_collectives
from autopar.planner.layering import Layer, cluster_layers, dp_layers
from autopar.planner.placement import shard_dim
from autopar.planner.precision import with_precision
from autopar.planner.stage_costs import StageCosts, StageOption, gathered_peak
from autopar.planner.strategy_costs import REPLICATED_GRADIENTS, Rule, gathered_bytes

RESERVE = 0.1  # of device memory kept for the allocator, workspaces and fragmentation
RECOMPUTES = (False, SELECTIVE, True)  # recompute choices, least recomputed first (ties keep the first)
DP_TOLERANCE = 0.01  # the stage DP's total is within 1 % of its optimum (stage_dp's t_max grid)
# the stage DP's runner-ups the simulator judges: eq. 2 adds every stage's once-per-step share (gradient
# sync, optimizer) although stages run theirs at once, and charging it once still leaves out which
# stage's ends the step, so a plan up to this much behind by either total can be the faster step
# (`inter_op.candidates`); also how far from the best simulated step a microbatch count's plan is refined
EQ2_SLACK = 0.1

log = logging.getLogger(__name__)


def parse_mesh(text: str) -> tuple[int, int]:
    """'HxD' -> (hosts, devices per host)."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isascii() and p.isdigit() and len(p) <= 6 and int(p) > 0 for p in parts):
        raise AutoparError(f"malformed mesh {text!r}: write HOSTSxDEVICES, e.g. --mesh 1x8 or --mesh 8x8")
    hosts, per_host = int(parts[0]), int(parts[1])
    if hosts * per_host > MAX_DEVICES or per_host > MAX_DEVICES_PER_HOST:
        raise AutoparError(f"mesh {text}: {hosts * per_host} devices ({per_host} per host); autopar plans at most "
                           f"{MAX_DEVICES} devices, {MAX_DEVICES_PER_HOST} per host")
    return hosts, per_host


@dataclass
class Search:
    """What the planner works from: the graph, its layers and the stage cost model."""

    workload: Workload
    cluster: ClusterSpec
    mesh: tuple[int, int]
    graph: OpGraph
    layers: list[Layer]
    costs: StageCosts
    memory_limit: float
    schedule: str = "1f1b"
    virtual: int = 1  # stages per device group
    # the atoms a unit of recomputation (and of ZeRO-3) starts at, which the stages may cut finer
    # than (`StageCosts.variant_table`, `Plan.units`); None: each layer is a unit
    units: list[int] | None = None

    def __post_init__(self) -> None:
        self.costs.layer_starts = self.unit_starts  # what a recomputing stage checkpoints

    @property
    def unit_starts(self) -> list[int]:
        return list(self.units) if self.units is not None else [layer.atoms[0] for layer in self.layers]

    @staticmethod
    def start(workload: Workload, cluster: ClusterSpec, mesh: tuple[int, int], *, memory_limit: float | None = None,
              schedule: str = "1f1b", virtual: int = 1, rule: Rule | None = None, time_limit_s: float = 30.0,
              graph: OpGraph | None = None, compression: str | None = None, precision: str | None = None,
              choices: dict | None = None, pin: bool = False) -> Search:
        """`compression`: price the data axis's gradient averaging through this compressor (and keep
        gradients replicated there, which compressors need: no ZeRO-3). `precision` ("bf16",
        "fp16"): price mixed-precision training (`autopar.planner.precision`); a graph retyped for it keeps it.
        `choices` / `pin`: `StageCosts`'s record of the shardings chosen, or the shardings to price again."""
        spec = parse(compression) if compression else None
        if spec is not None:
            rule = dataclasses.replace(rule, zero=False) if rule is not None else REPLICATED_GRADIENTS
        cluster = cluster.with_mesh(*mesh)
        graph = graph or capture(workload.model, workload.example_inputs)
        if precision is not None and graph.precision not in (None, precision):
            raise AutoparError(f"the graph was retyped for {graph.precision}: pass the captured one to price {precision}")
        if precision is not None and graph.precision != precision:
            graph = with_precision(graph, workload.model, precision)
        limit = cluster.device.memory_bytes * (1 - RESERVE) if memory_limit is None else memory_limit
        units = cluster_layers(graph)  # what a recomputing stage checkpoints; the DP may cut finer
        return Search(workload, cluster, mesh, graph, dp_layers(graph, units),
                      StageCosts(graph, cluster, rule, time_limit_s, spec, world=mesh[0] * mesh[1], choices=choices,
                                 pin=pin), limit, schedule, virtual, units=[u.atoms[0] for u in units])

    def compressed(self, compression: str | None) -> Search:
        """The same search with the data axis priced through `compression` (None: dense)."""
        return Search.start(self.workload, self.cluster, self.mesh, memory_limit=self.memory_limit,
                            schedule=self.schedule, virtual=self.virtual, rule=self.costs.rule if self.costs.rule is not REPLICATED_GRADIENTS
                            else None, time_limit_s=self.costs.time_limit_s, graph=self.graph, compression=compression)

    def atoms(self, i: int, j: int) -> tuple[int, int]:
        return self.layers[i].atoms[0], self.layers[j - 1].atoms[1]

    def stage_table(self, i: int, j: int, shape: tuple[int, int], m: int, depth: int,
                    logical: list[tuple[int, int]] | None = None, recompute: tuple | None = None,
                    ) -> list[StageOption | None]:
        """For s = 1 … depth stages from the end: the fastest way to run layers [i, j) on `shape`
        that fits with the microbatches that stage keeps in flight (index 0 unused)."""
        table: list[StageOption | None] = [None] * (depth + 1)
        for s in range(1, depth + 1):
            table[s] = self.fastest(i, j, shape, m, self.in_flight(s, m, depth), self.memory_limit, logical, recompute)
        return table

    def fastest(self, i: int, j: int, shape: tuple[int, int], m: int, in_flight: int, limit: float,
                logical: list[tuple[int, int]] | None = None, recompute: tuple | None = None,
                zeros: tuple[int, ...] | None = None) -> StageOption | None:
        """The fastest way to run layers [i, j) on `shape` within `limit` bytes with `in_flight`
        microbatches' activations held (the gradient reduction overlaps the last backward, as the
        simulator replays it)."""
        opts = sorted(self.costs.options(self.atoms(i, j), shape, m, logical, recompute, zeros),
                      key=lambda o: (o.time + (o.grad_sync_s + o.optimizer_s) / m, o.lean,
                                     RECOMPUTES.index(o.recompute), o.zero, o.offload))
        fits = [o for o in opts if o.memory(in_flight) <= limit]
        # offloaded only where nothing fits on the device (stricter than `_fastest`'s per level)
        return next((o for o in fits if not o.offload), fits[0] if fits else None)

    def budget(self, index: int, stages: int, m: int) -> tuple[int, float]:
        """(microbatches in flight, bytes) that stage `index` of `stages` may hold: with v stages
        per device group, a v-th of the group's memory and of the microbatch-stages its rank keeps
        (an even split: the simulator then replays the group's real peak)."""
        if self.virtual == 1:
            return self.in_flight(stages - index, m, stages), self.memory_limit
        groups = stages // self.virtual
        rank = schedules.stage_ranks(self.schedule, groups, self.virtual)[index]
        chunks = schedules.in_flight(self.schedule, groups, rank, m, self.virtual)
        return -(-chunks // self.virtual), self.memory_limit / self.virtual

    def in_flight(self, s: int, m: int, depth: int) -> int:
        """Microbatches a stage with s stages from the end holds (the DP does not know the
        pipeline's length: with fewer microbatches than the deepest one it may build, the schedule
        may run its fallback, 1F1B GPipe's order, in which every stage holds all of them)."""
        return schedules.in_flight(schedules.runs(self.schedule, depth, m).name, s, 0, m)

    def times(self, shapes: list[tuple[int, int]], m: int, depth: int) -> list[tuple[np.ndarray, np.ndarray, dict]]:
        """times[s, i, j, k] of `stage_table` for every range and shape at once (vectorised), the
        once-per-step part of each (exposed gradient synchronisation and optimizer: the tails
        `candidates` charges once), and which (logical mesh, lean, recompute, ZeRO level) each entry
        uses: with the weights on the device, then, where the cluster can offload, with offloading
        too (`_fastest`)."""
        n = len(self.layers)
        bounds = np.array([layer.atoms[0] for layer in self.layers] + [self.layers[-1].atoms[1]])
        offloads = (False, True) if self.cluster.offloads else (False,)
        out = [(np.full((depth + 1, n + 1, n + 1, len(shapes)), INF), np.zeros((depth + 1, n + 1, n + 1, len(shapes))), {})
               for _ in offloads]
        valid = np.triu(np.ones((n + 1, n + 1), dtype=bool), k=1)
        for k, shape in enumerate(shapes):
            variants = self.costs.variants(shape, m)
            if not variants:
                continue
            stacked = _stacked([self.costs.variant_table(bounds, shape, v, m) for v in variants], m)
            for s in range(1, depth + 1):
                in_flight = self.in_flight(s, m, depth)
                same = s > 1 and in_flight == self.in_flight(s - 1, m, depth)
                found = None if same else _fastest(stacked, in_flight, self.memory_limit, variants, offloads)
                for o, (times, tails, picks) in enumerate(out):
                    if same:
                        times[s, :, :, k], picks[(s, k)] = times[s - 1, :, :, k], picks[(s - 1, k)]
                        tails[s, :, :, k] = tails[s - 1, :, :, k]
                    else:
                        times[s, :, :, k], picks[(s, k)] = np.where(valid, found[o][0], INF), (variants, found[o][1])
                        tails[s, :, :, k] = np.take_along_axis(stacked["tail"], found[o][1][None], axis=0)[0]
        return out

    def range_times(self, shape: tuple[int, int], m: int, in_flight: int, limit: float,
                    logical: list[tuple[int, int]] | None = None, recompute: tuple | None = None,
                    zeros: tuple[int, ...] | None = None) -> tuple[np.ndarray, tuple]:
        """time[i, j] of the fastest way to run layers [i, j) on `shape` (on one of the `logical`
        meshes) within `limit` bytes with `in_flight` microbatches held (inf: none fits), and
        (variants, the pick of each range)."""
        n = len(self.layers)
        bounds = np.array([layer.atoms[0] for layer in self.layers] + [self.layers[-1].atoms[1]])
        variants = self.costs.variants(shape, m, logical, recompute, zeros)
        if not variants:
            return np.full((n + 1, n + 1), INF), (variants, None)
        (chosen, best), = _fastest(_stacked([self.costs.variant_table(bounds, shape, v, m) for v in variants], m),
                                   in_flight, limit, variants)
        return np.where(np.triu(np.ones((n + 1, n + 1), dtype=bool), k=1), chosen, INF), (variants, best)

    def option(self, i: int, j: int, shape: tuple[int, int], m: int, variant) -> StageOption:
        lm, lean, rc, z = variant
        atoms = self.atoms(i, j)
        return self.costs.option_for(atoms, shape, lm, lean, rc, m, zero=z)


def _stacked(tables: list[dict], m: int) -> dict[str, np.ndarray]:
    """The variants' tables stacked, [variant, i, j], with the key `_fastest` ranks them by."""
    out = {k: np.stack([t[k] for t in tables]) for k in ("states", "acts", "transient", "averaged")}
    out["tail"] = np.stack([t["sync"] + t["optimizer"] for t in tables])
    out["key"] = np.stack([t["time"] + out["tail"][k] / m for k, t in enumerate(tables)])  # sync, optimizer: per step
    ks = [k for k, t in enumerate(tables) if "depth" in t]  # recomputing variants: `_recompute_fewer`
    # where a partial recomputation may end (a layer start: `variant_table`'s `ends`), its depth; inf elsewhere
    reach = [np.where(tables[k]["ends"], tables[k]["depth"], np.inf) for k in ks]
    out["partial"] = {"k": np.array(ks, dtype=int),
                      **({"again": np.stack([tables[k]["again"] for k in ks]),
                          "plain": np.stack([tables[k]["plain_acts"] for k in ks]),
                          "depth": np.stack([tables[k]["depth"] for k in ks]),
                          "reach": np.stack(reach),
                          "start": np.array([_rises_until(r) if tables[k]["ends"].all() else len(r)
                                             for k, r in zip(ks, reach)]),
                          "key_at": [tables[k]["key_at"] for k in ks]} if ks else {})}
    return out


def _recompute_fewer(stacked: dict, v: np.ndarray, in_flight: int, limit: float, rows: np.ndarray,
                     cols: np.ndarray) -> np.ndarray:
    """For ranges [i, j) = (rows, cols) of recomputing variants `stacked["partial"]["k"][v]`: the key
    of recomputing only as many of a range's first layers as fit (at least one, fewer than all:
    Mist, AdaPipe), inf where none does. Priced in the DP, so the search weighs a stage that
    recomputes a few layers at what it costs, not at a whole recomputation; `recompute_less` then
    sets each chosen stage's depth exactly. Its key is the table's own formula (`key_at`) with the
    backward shorter by the forwards not run again: a shorter backward hides less of the gradient
    synchronisation. The transient is the whole recomputation's (its largest layer), an upper bound."""
    p = stacked["partial"]
    at = (p["k"][v], rows, cols)
    states, transient, averaged = (stacked[name][at] for name in ("states", "transient", "averaged"))
    plain, depth = p["plain"][v, rows, cols], p["depth"]
    rhs = (limit - states - transient) / in_flight - plain + depth[v, rows]
    end = _first_within(p["reach"], p["start"], v, rows, rhs)
    inside = end < cols  # fewer layers than the range's
    end = np.where(inside, end, rows)
    memory = states + np.maximum(in_flight * (plain + depth[v, end] - depth[v, rows]) + transient, averaged)
    ok = inside & (memory <= limit)
    key = np.full(len(rows), INF)
    less = p["again"][v, rows, cols] - p["again"][v, rows, end]
    for u in np.unique(v[ok]):
        sel = ok & (v == u)
        key[sel] = p["key_at"][u]((rows[sel], cols[sel]), less[sel])
    return key


def _rises_until(depth: np.ndarray) -> int:
    """The first index from which `depth` does not rise (0: it never does)."""
    rises = np.nonzero(np.diff(depth) > 0)[0]
    return int(rises[-1]) + 1 if len(rises) else 0


def _first_within(depth: np.ndarray, start: np.ndarray, v: np.ndarray, rows: np.ndarray, rhs: np.ndarray
                  ) -> np.ndarray:
    """For each (variant v, row i, bound): the first layer boundary k > i with depth[v, k] ≤ bound
    (depth.shape[1]: none). Each variant's `depth` falls where a layer's input is smaller than its
    activations: everywhere from `start[v]` on (`_rises_until`; before, an embedding's output is
    larger than what it keeps). There one `searchsorted` answers every query of every variant (the
    variants' negated rows laid end to end, each lifted above the last); the rows before `start`
    search their own running minimum (all of them where some bounds are no layer start: `_stacked`
    gives those an infinite depth, which a running minimum passes over)."""
    n = depth.shape[1]
    finite = np.isfinite(depth)
    big = float(np.abs(depth[finite]).max(initial=0.0)) + 1.0
    # past an atom without a sharding on this mesh (nan onwards): found, then refused by the memory check
    lifted = np.where(finite, -depth, big - 0.25)
    lifted[np.arange(n)[None, :] < start[:, None]] = -big  # before `start`: never the first within
    lifted += 4 * big * np.arange(len(depth))[:, None]
    found = np.searchsorted(lifted.ravel(), 4 * big * v + np.clip(-rhs, -big + 0.5, big - 0.5), side="left") - n * v
    out = np.maximum(found, rows + 1)
    early = np.flatnonzero(rows + 1 < start[v])
    for at in np.array_split(early, -(-len(early) // 65536)) if len(early) else ():  # a block of rows at a time
        d = depth[v[at]]
        hit = ((d <= rhs[at, None]) | np.isnan(d)) & (np.arange(n)[None, :] > rows[at, None])
        out[at] = np.where(hit.any(axis=1), hit.argmax(axis=1), n)
    return out


def _fastest(stacked: dict[str, np.ndarray], in_flight: int, limit: float, variants: list,
             offloads: tuple[bool, ...] = (True,)) -> list[tuple[np.ndarray, np.ndarray]]:
    """Over the variants (`_stacked`): the time per microbatch of the fastest that fits, and its
    index, per entry of `offloads`. An offloaded variant (ZeRO level < 0) only with offloading,
    and only where its level on the device does not fit, which is never slower: the once-per-step
    terms are spread over the microbatches here, and an offloaded stage's host step hides so only
    in the pipeline's bottleneck (`plan_dp` weighs plans with and without it by the simulator)."""
    memory = stacked["states"] + np.maximum(in_flight * stacked["acts"] + stacked["transient"], stacked["averaged"])
    masked = np.where(memory <= limit, stacked["key"], INF)
    index = {v: i for i, v in enumerate(variants)}
    ks = stacked["partial"]["k"]
    if len(ks):  # recomputing as few of a range's layers as fit: where the whole recomputation fits and none does not
        twins = np.array([index.get((*variants[k][:2], False, variants[k][3]), -1) for k in ks])
        kept = np.isfinite(masked[np.maximum(twins, 0)]) & (twins >= 0)[:, None, None]
        v, rows, cols = np.nonzero(np.isfinite(masked[ks]) & ~kept)
        if len(v):
            at = (ks[v], rows, cols)
            masked[at] = np.minimum(masked[at], _recompute_fewer(stacked, v, in_flight, limit, rows, cols))
    out = []
    for offload in offloads:
        kept = masked.copy() if any(v[3] < 0 for v in variants) else masked
        for i, v in enumerate(variants):
            if v[3] < 0:
                on_device = index.get((*v[:3], -v[3]))
                kept[i] = INF if not offload else np.where(
                    on_device is not None and np.isfinite(masked[on_device]), INF, masked[i])
        best = np.argmin(kept, axis=0)
        chosen = np.take_along_axis(kept, best[None], axis=0)[0]
        out.append((np.where(np.isfinite(chosen), chosen, INF), best))
    return out


def plan_dp(search: Search, *, stages: int | None = None, num_microbatches: int | None = None,
              progress: Callable[[str], None] | None = None) -> Plan:
    """Search stages, submeshes, logical meshes and the microbatch count; the simulator decides.

    One stage is the intra-op pass alone: one ILP over the whole graph per logical mesh. With
    `search.schedule` "auto" the stage DP runs for 1F1B and the other schedules are weighed
    around its plan (`_other_schedules`)."""
    schedule = search.schedule
    around = schedule == "auto" or not dp_prices(schedule)  # weighed around the DP's 1F1B plan
    if around:
        search = dataclasses.replace(search, schedule="1f1b")
        if stages == 1 and schedule != "auto":
            raise AutoparError(f"--schedule {schedule} runs a pipeline; --stages 1 has none")
    if stages == 1 and not num_microbatches:
        return plan_single_stage(search)
    best, best_chosen, counts = _stage_dp_plans(search, stages, num_microbatches, progress)
    unbounded = best is None and around and np.isfinite(search.memory_limit)
    if unbounded:
        # the other schedules hold memory otherwise (a V's first group keeps the weight its first and
        # last stages tie once): they are weighed around the 1F1B plan of no limit, priced again under
        # this one, and only a plan that fits is the answer
        free, best_chosen, _ = _stage_dp_plans(dataclasses.replace(search, memory_limit=INF), stages,
                                               num_microbatches, progress)
        best = None if free is None else assemble(search, best_chosen, free.num_microbatches, name="auto")
    if best is None:
        raise _nothing_fits(search, stages, num_microbatches)
    best.search.update({"ilp_solves": search.costs.solves, "cache_hits": search.costs.hits,
                        "microbatch_counts": len(counts)})
    if around:
        best = _other_schedules(search, best, best_chosen, progress, None if schedule == "auto" else schedule)
        if unbounded and not best.estimate.fits:
            raise _nothing_fits(search, stages, num_microbatches)
    return best


def _stage_dp_plans(search: Search, stages: int | None, num_microbatches: int | None,
                    progress: Callable[[str], None] | None) -> tuple[Plan | None, list, list[int]]:
    """The stage DP's fastest plan over the microbatch counts (None: none found), its stages
    (layers, submesh, option) and the counts tried. At each count the simulator judges the plans
    of both totals (`inter_op.candidates`: eq. 2, and the tails charged once where they can rank
    plans otherwise, `_tails_matter`), skipping those whose `step_floor` cannot beat the best step so
    far (the count's best by eq. 2: cannot come within `EQ2_SLACK` of it); the count's fastest is
    then `refine`d, cut by cut, where it is within that slack (a refined neighbour of a plan a
    little behind can be the fastest step)."""
    hosts, per_host = search.mesh
    shapes = submesh_shapes(hosts, per_host)
    sizes = [h * d for h, d in shapes]
    devices = hosts * per_host
    n = len(search.layers)
    depth = min(n, devices, stages or n)
    best: Plan | None = None
    best_chosen: list = []
    # many microbatches first (small bubbles): the best simulated step so far rules out most others
    counts = [num_microbatches] if num_microbatches else microbatch_counts(search.workload.batch)[::-1]
    bound = INF  # the fastest simulated step that fits so far (`stage_dp`: why it bounds every count)
    for m in counts:
        if progress:
            progress(f"{m} microbatch{'es' if m > 1 else ''}")
        # with the weights on the device, then offloading too where it lets a range fit that did
        # not: eq. 2 spreads an offloaded stage's host step over the microbatches, too hopeful
        # outside the bottleneck, so only the simulator judges it
        tables = search.times(shapes, m, depth)
        here = None
        for offloaded, (times, tails, picks) in enumerate(tables):
            if offloaded and not np.any((times < tables[0][0]) & (m * times < bound)):
                break
            pool = candidates(times, sizes, devices, m, stages, DP_TOLERANCE, bound, EQ2_SLACK)
            if pool and _tails_matter(times, tails, m, depth, pool[0][0]):
                seen = {tuple(c) for _, c in pool}
                pool += [x for x in candidates(times, sizes, devices, m, stages, DP_TOLERANCE, bound, EQ2_SLACK, tails,
                                               seeds=[c for _, c in pool]) if tuple(x[1]) not in seen]
            for k, (total, choice) in enumerate(pool):
                # the count's best by eq. 2 is simulated within EQ2_SLACK of the best step so far, since
                # `refine` may make it the fastest; the runner-ups only where they can beat that step
                limit = bound * (1 + EQ2_SLACK) if k == 0 and not offloaded else bound
                if m * max(times[len(choice) - i, c.layers[0], c.layers[1], c.shape] for i, c in enumerate(choice)) >= limit:
                    continue  # its slowest stage alone runs longer than that (`stage_dp`)
                chosen = []
                for idx, c in enumerate(choice):
                    variants, pick = picks[(len(choice) - idx, c.shape)]
                    variant = variants[pick[c.layers]]
                    chosen.append((c.layers, shapes[c.shape], search.option(*c.layers, shapes[c.shape], m, variant)))
                if offloaded and not any(opt.offload for _, _, opt in chosen):
                    continue  # the plan on the device again
                chosen = recompute_less(search, chosen, m)
                if step_floor(_pipeline(chosen), m) >= limit:
                    continue  # cannot come near the best step so far (and simulating a deep pipeline takes seconds)
                plan = assemble(search, chosen, m, name="auto")
                plan.search["eq2_total_s"] = float(total)
                if plan.estimate.fits:
                    bound = min(bound, plan.estimate.step_time_s)
                if here is None or plan.estimate.step_time_s < here[0].estimate.step_time_s:
                    here = plan, chosen, (times, picks)
        if here is not None and here[0].estimate.fits and here[0].estimate.step_time_s <= bound * (1 + EQ2_SLACK):
            here = (*_refined(search, *here, depth, shapes, fixed=True), here[2])
            bound = min(bound, here[0].estimate.step_time_s)
        if here is not None and (best is None or here[0].estimate.step_time_s < best.estimate.step_time_s):
            best, best_chosen, best_table = here
    if stages is None and best is not None and best.estimate.fits:  # the stage count too, around the fastest
        best, best_chosen = _refined(search, best, best_chosen, best_table, depth, shapes, fixed=False)
    return best, best_chosen, counts


def _refined(search: Search, plan: Plan, chosen: list, table: tuple[np.ndarray, dict], depth: int,
             shapes: list[tuple[int, int]], fixed: bool) -> tuple[Plan, list]:
    """`plan` (of stages `chosen`) after `refine`, assembled again where that found a faster one."""
    m = plan.num_microbatches
    better = refine(search, chosen, m, plan.estimate.step_time_s, table, depth, shapes, fixed)
    if better is chosen:
        return plan, chosen
    found = assemble(search, better, m, name="auto")
    if not (found.estimate.fits and found.estimate.step_time_s < plan.estimate.step_time_s):
        return plan, chosen
    found.search["eq2_total_s"] = plan.search.get("eq2_total_s")
    return found, better


def _tails_matter(times: np.ndarray, tails: np.ndarray, m: int, depth: int, total: float) -> bool:
    """Whether charging the tails once (`candidates` with `tails`) can rank plans otherwise than eq. 2
    by more than the DP's own tolerance: the two totals of a plan of at most `depth` stages differ
    by at most (depth / m + 1)·τ for its largest tail τ, counted over the entries a plan within the
    slack of eq. 2's best `total` can use."""
    in_play = np.isfinite(times) & (m * times < total * (1 + EQ2_SLACK))
    return bool(in_play.any()) and (depth / m + 1) * float(tails[in_play].max()) > DP_TOLERANCE * total


def _simulated(search: Search, chosen: list, m: int, step: float) -> tuple[float, bool]:
    """(step, fits) of stages `chosen` as the DP's pipeline runs them (one stage per group, whole
    backward); (inf, False) without simulating where its `step_floor` is already at `step` or above."""
    times = _pipeline(chosen)
    if step_floor(times, m) >= step:
        return INF, False
    sim = simulate(times, m, search.schedule, hosts(search.cluster, [h * d for _, (h, d), _ in chosen]))
    return sim.step_time_s, max(sim.peak_memory_bytes) <= search.memory_limit


def _pipeline(chosen: list) -> list[StageTimes]:
    """The simulator's view of stages `chosen` in the DP's pipeline (one stage per group, whole backward)."""
    return [StageTimes(forward_s=o.forward_s, backward_s=o.backward_s, send_s=o.send_s, grad_sync_s=o.grad_sync_s,
                       optimizer_s=o.optimizer_s, state_bytes=o.state_bytes, transient_bytes=o.transient_bytes,
                       grad_bytes=o.grad_bytes, sync_bytes=o.sync_bytes, weight_s=o.weight_s,
                       activation_bytes=o.activation_bytes) for _, _, o in chosen]


def refine(search: Search, chosen: list, m: int, step: float, table: tuple[np.ndarray, dict], depth: int,
           shapes: list[tuple[int, int]], fixed: bool = False) -> list:
    """A local search the simulator judges, from the DP's plan: move one cut by one layer, split a
    stage into two on halves of its submesh, or merge two neighbours of one shape onto the submesh
    of twice their devices (not where the stage count is `fixed`), while the simulated step falls.
    Each stage of a neighbour is at the fastest that fits its place in that pipeline
    (`Search.budget`: the DP's `table` where the DP assumed that budget, else `range_times`),
    recomputing as little as fits. Both totals miss which stage's tail ends the step (a stage's
    last backward ends before those of the stages before it, so its tail hides behind theirs)."""
    tables: dict[tuple, tuple] = {}
    sizes = {shape: shape[0] * shape[1] for shape in shapes}
    half = {s: h for s in shapes for h in shapes if 2 * sizes[h] == sizes[s]}
    double = {h: s for s, h in half.items()}

    def option(idx: int, n: int, i: int, j: int, shape: tuple[int, int]):
        key = (shape, *search.budget(idx, n, m))
        if key not in tables:
            s, k = n - idx, shapes.index(shape)
            tables[key] = ((table[0][s, :, :, k], table[1][(s, k)])
                           if s <= depth and key[1:] == (search.in_flight(s, m, depth), search.memory_limit)
                           else search.range_times(shape, m, *key[1:]))
        times, (variants, pick) = tables[key]
        return search.option(i, j, shape, m, variants[pick[i, j]]) if np.isfinite(times[i, j]) else None

    def neighbours(chosen: list):
        """[(range, shape)] of each pipeline one move, split or merge away."""
        n = len(chosen)
        stages = [(r, shape) for r, shape, _ in chosen]
        for c in range(1, n):
            (a, b), (_, e) = stages[c - 1][0], stages[c][0]
            for cut in (b - 1, b + 1):
                if a < cut < e:
                    yield stages[:c - 1] + [((a, cut), stages[c - 1][1]), ((cut, e), stages[c][1])] + stages[c + 1:]
        if fixed:
            return
        for c, ((a, e), shape) in enumerate(stages):
            for cut in range(a + 1, e) if shape in half else ():
                yield stages[:c] + [((a, cut), half[shape]), ((cut, e), half[shape])] + stages[c + 1:]
        for c in range(1, n):
            (a, _), shape = stages[c - 1]
            if stages[c][1] == shape and shape in double:
                yield stages[:c - 1] + [((a, stages[c][0][1]), double[shape])] + stages[c + 1:]

    improved = True
    while improved:
        improved = False
        for stages in neighbours(chosen):
            n = len(stages)
            # a stage kept where it was keeps its option; every other one is picked again
            same = {idx for idx, st in enumerate(stages) if n == len(chosen) and st == chosen[idx][:2]}
            trial = [chosen[idx] if idx in same else (r, shape, option(idx, n, *r, shape))
                     for idx, (r, shape) in enumerate(stages)]
            if any(opt is None for _, _, opt in trial):
                continue
            trial = recompute_less(search, trial, m)
            t, fits = _simulated(search, trial, m, step)
            if fits and t < step * (1 - 1e-9):
                chosen, step, improved = trial, t, True
                break
    return chosen


def dp_prices(schedule: str) -> bool:
    """Whether the stage DP prices the schedule itself: one stage per group, a whole backward."""
    return schedules.get(schedule).virtual == (1,) and not schedules.splits_backward(schedule)


AUTO_VIRTUAL = (2, 3, 4)  # stages per device group the schedule search tries (Megatron-LM's runs use 2–4)


def _other_schedules(search: Search, base: Plan, chosen: list, progress: Callable[[str], None] | None,
                     only: str | None = None) -> Plan:
    """`--schedule auto`: the 1F1B plan of the stage DP against the schedules that run its device
    groups otherwise, each replayed by the simulator; the fastest that fits wins (`only`: the
    fastest of that schedule). Kept small: the DP runs once (for 1F1B); ZB-H1 re-times its stages;
    interleaved-1f1b, interleaved-zb and zbv cut the layers into p·v balanced stages on the same p
    groups and microbatch count (v in `AUTO_VIRTUAL`), one simulation each. Only pipelines of one
    submesh and logical mesh qualify (torch runs these schedules on equal stages)."""
    tried, skipped = {"1f1b": base}, {}
    p, m = base.groups, base.num_microbatches
    shape, lm = base.stages[0].submesh, base.stages[0].logical_mesh
    names = [only] if only else ["interleaved-1f1b", "interleaved-zb", "zbv"]
    if p > 1 and all(st.submesh == shape and st.logical_mesh == lm for st in base.stages):
        if progress:
            progress("zero-bubble and interleaved schedules")
        zb = None if "interleaved-zb" not in names or schedules.problem("interleaved-zb", p, m) else assemble(
            dataclasses.replace(search, schedule="interleaved-zb"), _without_zero(search, chosen, m), m, "auto")
        if zb is not None and runs(zb):
            tried["interleaved-zb"] = zb
        for v in AUTO_VIRTUAL:
            for name in names:
                if p * v <= len(search.layers) and not schedules.problem(name, p, m, v):
                    bound = min((plan.estimate.step_time_s for k, plan in tried.items()
                                 if plan.estimate.fits and not (only and k == "1f1b")), default=INF)
                    plan = _virtual_plan(dataclasses.replace(search, schedule=name, virtual=v), p, shape, lm, m, bound)
                    if isinstance(plan, Plan):
                        tried[f"{name}/v{v}"] = plan
                    elif plan is not None:
                        skipped[f"{name}/v{v}"] = plan
    if only:  # the 1F1B plan stood as the bound; the answer runs the schedule asked for
        del tried["1f1b"]
        if not tried:
            raise AutoparError(
                f"--schedule {only}: the stage DP's best pipeline ({p} stage(s) on "
                f"{', '.join(sorted({f'{st.submesh[0]}x{st.submesh[1]}' for st in base.stages}))}, {m} microbatches) "
                f"has no layout {only} runs here (it needs 2 or more groups of one submesh and logical mesh, stages "
                "that fit the memory limit (a split backward recomputes nothing), and ZeRO-3 only with a whole "
                "backward); use --schedule auto, or --manual with --virtual")
    fits = [plan for plan in tried.values() if plan.estimate.fits] or list(tried.values())
    best = min(fits, key=lambda plan: (not plan.estimate.fits, plan.estimate.step_time_s))
    best.search.update({k: base.search[k] for k in ("ilp_solves", "cache_hits", "microbatch_counts")})
    best.search["schedules"] = {k: {"step_time_s": plan.estimate.step_time_s, "fits": plan.estimate.fits}
                                for k, plan in tried.items()}
    best.search["schedules"].update({k: {"busiest_group_s": work, "skipped": True} for k, work in skipped.items()})
    return best


def _without_zero(search: Search, chosen: list, m: int) -> list:
    """The DP's stages with ZeRO-1/2 undone (a split backward does not run under ZeRO: `runs`);
    where that no longer fits, the simulator says so."""
    out = []
    for (i, j), shape, opt in chosen:
        if opt.zero:
            atoms = search.atoms(i, j)
            opt = search.costs.option_for(atoms, shape, opt.logical_mesh, opt.lean, opt.recompute, m,
                                          depth=opt.recompute_layers)
        out.append(((i, j), shape, opt))
    return out


def balanced_cuts(times: np.ndarray, q: int) -> list[int] | None:
    """Layer boundaries [0, …, n] of q contiguous stages (times[i, j]: layers [i, j), inf where it
    does not fit) with the least slowest stage, then the least total (None: no q stages fit).
    The slowest stage is found by bisection over the distinct times, each a reachability DP."""
    n = times.shape[0] - 1
    if q > n:
        return None
    values = np.unique(times[np.isfinite(times)])

    def reach(cap: float) -> np.ndarray:  # total[c, j]: least total of layers [0, j) as c stages under cap
        allowed = np.where(times <= cap, times, INF)
        total = np.full((q + 1, n + 1), INF)
        total[0, 0] = 0.0
        for c in range(1, q + 1):
            total[c] = np.min(total[c - 1][:, None] + allowed, axis=0)
        return total

    lo, hi = 0, len(values) - 1
    if hi < 0 or not np.isfinite(reach(values[hi])[q, n]):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if np.isfinite(reach(values[mid])[q, n]):
            hi = mid
        else:
            lo = mid + 1
    cap = values[lo]
    total = reach(cap)
    allowed = np.where(times <= cap, times, INF)
    cuts, j = [n], n
    for c in range(q, 0, -1):  # walk back: a stage [i, j) that the best total of c − 1 stages reaches
        i = int(np.argmin(total[c - 1] + allowed[:, j]))
        cuts.append(i)
        j = i
    return cuts[::-1]


def _virtual_plan(search: Search, p: int, shape: tuple[int, int], lm: tuple[int, int], m: int, bound: float
                  ) -> Plan | float | None:
    """The layers cut into p·v stages of the least bottleneck (then the least total) on p groups
    of `shape`, each stage within its share of its group's memory (`Search.budget`); None when no
    such cut fits. Not simulated when the busiest group's own work (its compute, gradient
    synchronisation and optimizer) already takes `bound` seconds: that time instead. Where no cut
    fits the even share, a cut within the group's whole memory is tried, kept where the simulator
    says the groups fit: a V's first group holds the first and the last stage, rarely alike."""
    q = p * search.virtual
    in_flight, limit = max((search.budget(s, q, m) for s in range(q)), key=lambda b: b[0])
    found = _virtual_cut(search, p, shape, lm, m, bound, in_flight, limit)
    if found is None and search.virtual > 1:
        found = _virtual_cut(search, p, shape, lm, m, bound, in_flight, search.memory_limit)
        if isinstance(found, Plan) and not found.estimate.fits:
            return None
    return found


def _virtual_cut(search: Search, p: int, shape: tuple[int, int], lm: tuple[int, int], m: int, bound: float,
                 in_flight: int, limit: float) -> Plan | float | None:
    recompute = (False,) if schedules.splits_backward(search.schedule) else None  # `runs`
    # one mesh; no ZeRO-1/2: a device group's stages would have to take it alike (`runtime.pipeline`)
    times, (variants, picks) = search.range_times(shape, m, in_flight, limit, [lm], recompute, zeros=(0,))
    if not variants:
        return None
    cuts = balanced_cuts(times, p * search.virtual)
    if cuts is None:
        return None
    chosen = [((i, j), shape, search.option(i, j, shape, m, variants[picks[i, j]])) for i, j in zip(cuts, cuts[1:])]
    chosen = recompute_less(search, chosen, m)
    work = [0.0] * p
    for group, (_, _, opt) in zip(schedules.stage_ranks(search.schedule, p, search.virtual), chosen):
        work[group] += m * (opt.forward_s + opt.backward_s) + opt.grad_sync_s + opt.optimizer_s
    if max(work) >= bound:
        return max(work)
    plan = assemble(search, chosen, m, "auto")
    return plan if runs(plan) else None


def runs(plan: Plan) -> bool:
    """Whether the runtime runs the plan's combination of features (`contract.compat`: under a split
    backward FSDP2 does not yet train as one process does, and torch's checkpoint cannot recompute
    a layer twice, among others)."""
    return plan_refusal(plan) is None


def plan_compressed(search: Search, compression: str | None, make: Callable[[Search], Plan],
                    progress: Callable[[str], None] | None = None) -> Plan:
    """`make(search)` with the data axis priced through `compression`; "auto" weighs none and each
    of the methods that held in the convergence sweep (`cost_models.compression.auto_candidates`)
    and keeps the fastest predicted plan (the choice is recorded in `plan.search["compression"]`)."""
    candidates = list(auto_candidates()) if compression == "auto" else [compression]
    plans = {}
    for text in candidates:
        if progress and len(candidates) > 1:
            progress(f"compression {text or 'none'}")
        plans[text] = make(search.compressed(text) if text else search)
    best = min(plans.values(), key=lambda p: (not p.estimate.fits, p.estimate.step_time_s))
    if len(plans) > 1:
        best.search["compression"] = {text or "none": p.estimate.step_time_s for text, p in plans.items()}
    elif compression and best.dp_gradient.get("compressed") == [] and any(s.logical_mesh[0] > 1 for s in best.stages):
        log.warning("compression %s: no gradient is worth compressing on %s's links (no bucket's exchange is "
                    "priced min_rate times faster compressed, or its matrices are below min_size): all travel dense. "
                    "Plan for the link you train over (--cluster), or lower min_rate or min_size",
                    best.dp_gradient["compression"], search.cluster.name)
    warn_time_limited(best, search.costs.time_limit_s)
    return best


_WARNED: set[str] = set()


def warn_unmeasured(plan: Plan, params: int) -> None:
    """One warning per process and reason where the plan compresses gradients in a way the
    convergence sweep did not show safe (`cost_models.compression.unmeasured`); called where a
    plan is handed over (`autopar plan`, `parallelize`), cached or not."""
    text = plan.dp_gradient.get("compression")
    ranks = max((s.logical_mesh[0] for s in plan.stages), default=1)
    if not text or ranks == 1 or plan.dp_gradient.get("compressed") == []:
        return
    why = unmeasured(parse(text), ranks, plan.batch // ranks, params)
    if why and why not in _WARNED:
        _WARNED.add(why)
        log.warning("%s: compare it with dense on a short run before relying on it", why)


def warn_time_limited(plan: Plan, time_limit_s: float) -> None:
    """One warning when a stage of the plan the user gets was sharded by a solve that stopped at its
    time limit (candidates the search dropped say nothing): the plan is then only as good as the gap."""
    limited = plan.search.get("time_limited")
    if limited:
        stages = ", ".join(f"stage {s['stage']} (layers {s['layers'][0]}–{s['layers'][1] - 1}, gap {s['gap']:.1%})"
                           for s in limited)
        log.warning("time limit hit: the sharding ILP stopped at its %g s limit in %s; the plan uses the best "
                    "assignment found, and the optimum may cost up to the gap less: raise --time-limit",
                    time_limit_s, stages)


def plan_single_stage(search: Search) -> Plan:
    """Every device in one stage, one microbatch: the whole graph's ILP on each logical mesh."""
    costs, g = search.costs, search.graph
    share = g.flops_fwd / (g.flops_fwd + g.flops_bwd) if g.flops_fwd + g.flops_bwd else 0.5

    def transient(r, loss: float = 0.0) -> float:  # ZeRO-3 gathers a layer at a time (the ILP leaves it out)
        return gathered_peak(_gathered_per_layer(search, r.params, r.logical_mesh[1]), g.precision, loss)

    try:
        best, results, _ = best_sharding(search.graph, search.cluster, search.mesh, search.memory_limit,
                                         costs.time_limit_s, rule=costs.rule)
        if best.memory["total"] + transient(best) > search.memory_limit:  # again, keeping room for any layer
            room = transient(dataclasses.replace(best, params={f: ["S(0)", "R"] for f in g.params}, logical_mesh=(1, 1)))
            best, results, _ = best_sharding(search.graph, search.cluster, search.mesh, search.memory_limit - room,
                                             costs.time_limit_s, rule=costs.rule)
    except InfeasibleError as exc:
        raise InfeasibleError(f"{search.workload.name} (batch {search.workload.batch}) {exc}", exc.least_memory) from None

    def compute(r) -> float:  # with the tensor axis's waits for its slowest rank (`StageCosts.straggler_wait`)
        c = r.cost
        return c["compute_s"] + float(costs.straggler_wait(c.get("tp_syncs", 0) * c["compute_s"], r.logical_mesh[1]))

    def backward(r) -> float:
        return compute(r) * (1 - share) + (r.cost["comm_s"] + r.cost["reshard_s"]) / 2 + loss(r) / 2

    def loss(r) -> float:
        return float(costs.loss_time(costs.loss_bytes / r.logical_mesh[0]))

    def step(r) -> float:  # the estimate's terms: the ILP's time leaves out the loss, the optimizer, the
        c = r.cost  # part of the gradient averaging backward hides and what a compressor adds (`exposed_sync`)
        return (compute(r) + c["comm_s"] + c["reshard_s"] + loss(r)
                + float(costs.exposed_sync(c["grad_sync_s"], backward(r), search.mesh, r.logical_mesh, c["trainable_bytes"],
                                           compute(r) + loss(r)))
                + float(costs.optimizer_s(c["optimizer_elements"], c["optimizer_tensors"], c["optimizer_dtensors"]))
                + c.get("tp_grad_s", 0.0))

    fitting = [r for r in results if r.memory["total"] + transient(r) <= search.memory_limit] or [best]
    best = min(fitting, key=lambda r: (float(f"{step(r):.6g}"), -r.logical_mesh[0]))
    c = best.cost
    comm = c["comm_s"] + c["reshard_s"]
    stage = StagePlan(
        layers=(0, len(search.layers)), submesh=search.mesh, logical_mesh=best.logical_mesh, params=placed(best.params),
        ops=placed(best.ops), needs=placed(best.needs),
        collectives=program_collectives(best.collectives, best.logical_mesh[1]), cost={"forward_s": compute(best) * share + comm / 2 + loss(best) / 2,
                            "backward_s": backward(best), "send_s": 0.0,
                            "grad_sync_s": float(costs.exposed_sync(c["grad_sync_s"], backward(best), search.mesh,
                                                                    best.logical_mesh, c["trainable_bytes"],
                                                                    compute(best) + loss(best))),
                            "optimizer_s": float(costs.optimizer_s(c["optimizer_elements"], c["optimizer_tensors"],
                                                                  c["optimizer_dtensors"])) + c.get("tp_grad_s", 0.0),
                            "state_bytes": best.memory["model_states"],
                            **_memory_costs(best.memory["activations"] + best.memory["weight_copies"] + costs.loss_bytes
                                            / best.logical_mesh[0], transient(best, 2 * costs.loss_bytes
                                                                             / best.logical_mesh[0]),
                                            best.memory["gradients"],
                                            c["trainable_bytes"] if best.logical_mesh[0] > 1 and not any(
                                                p[0] == "S(0)" for p in best.params.values()) else 0.0)})
    sim = simulate([stage_times(stage.cost)], 1, search.schedule, hosts(search.cluster, [stage.devices]))
    limited = [] if best.solver["status"] == "optimal" else [
        {"stage": 0, "layers": [0, len(search.layers)], "gap": best.solver["gap"]}]
    return _plan(search, [stage], sim, 1, "auto", {"ilp_solves": len(logical_meshes(search.mesh)), "cache_hits": 0,
                                                   "microbatch_counts": 1, **_time_limited(limited)})


def _nothing_fits(search: Search, stages: int | None = None, num_microbatches: int | None = None) -> AutoparError:
    """How much memory per device the leanest way to hold the whole model on every device needs
    (one stage, ZeRO-3, recomputation, the smallest microbatch its shardings allow); where that
    fits, what ruled it out: the stage or microbatch count asked for."""
    hosts, per_host = search.mesh
    where = f"{hosts}x{per_host} {search.cluster.name}"
    n, batch = len(search.layers), search.workload.batch
    counts = sorted(microbatch_counts(batch), reverse=True)  # the smallest microbatch that shards
    lean = next(([o.memory(1) for o in opts] for m in counts
                 if (opts := search.costs.options(search.atoms(0, n), search.mesh, m))), [])
    fixed = ", ".join(x for x in (f"{stages} stages" if stages else "",
                                  f"{num_microbatches} microbatches" if num_microbatches else "") if x)
    if lean and fixed and min(lean) <= search.memory_limit:
        return AutoparError(
            f"{search.workload.name} (batch {batch}) fits on no layout of {where} with {fixed} under "
            f"{human_bytes(search.memory_limit)} per device; the leanest layout (one stage, ZeRO-3, recomputation) "
            f"needs {human_bytes(min(lean))}: leave the {fixed} to the planner")
    if lean:
        return AutoparError(
            f"{search.workload.name} (batch {batch}) fits on no layout of {where}: even spread over every device "
            f"with ZeRO-3 and recomputation it needs {human_bytes(min(lean))} per device, "
            f"{human_bytes(search.memory_limit)} is available; use more devices or a smaller batch")
    return AutoparError(f"{search.workload.name} (batch {batch}) fits on no layout of {where}: "
                        "no data-parallel size divides the batch; change --batch")


def recompute_less(search: Search, chosen: list[tuple[tuple[int, int], tuple[int, int], StageOption]],
                   m: int) -> list[tuple[tuple[int, int], tuple[int, int], StageOption]]:
    """Each recomputing stage recomputes only as many of its first layers as its memory needs (Mist,
    AdaPipe): the fewest that fit the stage's budget in this pipeline (`Search.budget`, the same
    bound the DP checked, with the pipeline's real length); the later layers keep their activations."""
    out = []
    for idx, ((i, j), shape, opt) in enumerate(chosen):
        if opt.recompute is True and j - i > 1:
            in_flight, limit = search.budget(idx, len(chosen), m)
            atoms = search.atoms(i, j)
            for k in range(1, j - i):
                fewer = search.costs.option_for(atoms, shape, opt.logical_mesh, opt.lean, True, m, depth=k,
                                                zero=opt.zero_choice)
                if fewer.memory(in_flight) <= limit:
                    opt = fewer
                    break
        out.append(((i, j), shape, opt))
    return out


def assemble(search: Search, chosen: list[tuple[tuple[int, int], tuple[int, int], StageOption]], m: int,
             name: str) -> Plan:
    """Turn (layers, submesh, option) per stage into a Plan and simulate it. Under a split
    backward torch writes the weight gradients itself (no hook launches a bucket), and of a rank's
    several stages only the first one's buckets launch during backward: there the data axis's
    averaging is priced with nothing hidden."""
    unhidden = schedules.splits_backward(search.schedule) or search.virtual > 1
    stages, times, limited = [], [], []
    shared = [(0.0, 0.0)] * len(chosen)  # a weight a group's stages tie, held once (`shared_in_group`)
    if search.virtual > 1:
        where = schedules.stage_ranks(search.schedule, len(chosen) // search.virtual, search.virtual)
        for group in set(where):
            mine = [k for k, g in enumerate(where) if g == group]
            for k, excess in zip(mine, search.costs.shared_in_group(
                    [(search.atoms(*chosen[k][0]), chosen[k][1], chosen[k][2].logical_mesh, chosen[k][2].lean)
                     for k in mine])):
                shared[k] = excess
    for idx, ((i, j), shape, opt) in enumerate(chosen):
        params: dict[str, list[str]] = {}
        ops: dict[str, list[str]] = {}
        needs: dict[str, list[str | None]] = {}
        for k in range(*search.atoms(i, j)):
            atom_params, atom_ops, atom_needs = search.costs.placements(k, shape, opt.logical_mesh, opt.lean)
            params.update(atom_params)
            ops.update(atom_ops)
            needs.update(atom_needs)
        stages.append(StagePlan(
            layers=(i, j), submesh=shape, logical_mesh=opt.logical_mesh, params=placed(dict(sorted(params.items()))),
            ops=placed(ops), needs=placed(needs), recompute=bool(opt.recompute), recompute_layers=opt.recompute_layers,
            recompute_granularity=opt.recompute if opt.recompute == SELECTIVE else None,
            zero=opt.zero or None, offload=opt.offload or None,
            collectives=search.costs.collectives(search.atoms(i, j), shape, opt.logical_mesh, opt.lean, m,
                                               opt.recompute, opt.recompute_layers),
            cost={"forward_s": opt.forward_s, "backward_s": opt.backward_s, "weight_s": opt.weight_s, "send_s": opt.send_s,
                  "grad_sync_s": opt.unhidden_sync_s if unhidden else opt.grad_sync_s, "optimizer_s": opt.optimizer_s,
                  "state_bytes": opt.state_bytes - shared[idx][0],
                  **_memory_costs(opt.activation_bytes, opt.transient_bytes, opt.grad_bytes - shared[idx][1],
                                  opt.sync_bytes)}))
        times.append(stage_times(stages[-1].cost))
        gap = search.costs.gap(search.atoms(i, j), shape, opt.logical_mesh, opt.lean)
        if gap is not None:
            limited.append({"stage": idx, "layers": [i, j], "gap": gap})
    groups = len(stages) // search.virtual
    sim = simulate(times, m, search.schedule, hosts(search.cluster, [s.devices for s in stages[:groups]]),
                   search.virtual)
    return _plan(search, stages, sim, m, name, {"method": name, **_time_limited(limited)})


def hosts(cluster: ClusterSpec, devices: list[int]) -> Hosts | None:
    """The simulator's view of a host whose ranks share fewer cores (None: each has its own)."""
    cores = cluster.cores_per_host
    if cores is None or cores >= cluster.devices_per_host:
        return None
    return Hosts(tuple(devices), cluster.devices_per_host, cores)


def replay(plan: Plan) -> Simulation:
    """The simulation a plan's estimate came from, from the plan alone."""
    shared = plan.search.get("hosts")
    where = Hosts(tuple(plan.group_devices), *shared) if shared else None
    return simulate([stage_times(s.cost) for s in plan.stages], plan.num_microbatches, plan.schedule, where,
                    plan.virtual)


def _gathered_per_layer(search: Search, params: dict[str, list[str]], tp: int) -> np.ndarray:
    """ZeRO-3's gathered bytes per layer of a whole-graph sharding (`params`: the plan's
    placements; a weight counts in the first layer that uses it)."""
    seen: set[str] = set()
    out = []
    for layer in search.layers:
        total = 0.0
        for fqn in (f for name in layer.nodes for f in search.graph.node(name).params):
            if fqn in params and fqn in search.graph.trainable and fqn not in seen:
                seen.add(fqn)
                if params[fqn][0] == "S(0)":
                    total += gathered_bytes(search.graph, fqn, tp if shard_dim(params[fqn][1]) is not None else 1)
        out.append(total)
    return np.array(out)


def _memory_costs(acts: float, transient: float, grads: float, averaged: float) -> dict[str, float]:
    """A plan stage's memory terms beside its state bytes (what `stage_times` reads back)."""
    return {"activation_bytes_per_microbatch": acts, "transient_bytes": transient, "grad_bytes": grads,
            "sync_bytes": averaged}


def stage_times(cost: dict[str, float]) -> StageTimes:
    """The simulator's view of a plan stage, from the costs it carries (older plans lack some: 0)."""
    c = {k: cost.get(k, 0.0) for k in ("forward_s", "backward_s", "send_s", "grad_sync_s", "optimizer_s",
                                       "state_bytes", "transient_bytes", "grad_bytes", "sync_bytes", "weight_s")}
    return StageTimes(**c, activation_bytes=cost.get("activation_bytes_per_microbatch", 0.0))


def _time_limited(stages: list[dict]) -> dict:
    """`plan.search["time_limited"]`: the stages whose sharding solve stopped at the time limit,
    with the worst gap of their atoms; absent when every solve was optimal (plans stay unchanged)."""
    return {"time_limited": stages} if stages else {}


def _plan(search: Search, stages: list[StagePlan], sim, m: int, name: str, info: dict) -> Plan:
    devices = sum(s.devices for s in stages[:len(stages) // search.virtual])
    model_flops = search.graph.flops_fwd + search.graph.flops_bwd
    peak = float(max(sim.peak_memory_bytes))
    for stage, stage_peak in zip(stages, sim.peak_memory_bytes):  # what a rank of the stage should measure
        stage.cost["peak_bytes"] = float(stage_peak)
    estimate = Estimate(
        step_time_s=sim.step_time_s, tflops_per_device=model_flops / sim.step_time_s / devices / 1e12,
        peak_memory_bytes=peak, bubble_fraction=sim.bubble_fraction, fits=peak <= search.memory_limit)
    zero = any(p[0] == Shard(0) for s in stages for p in s.params.values())
    starts = set(search.costs.layer_starts or ())
    units = [k for k, layer in enumerate(search.layers) if layer.atoms[0] in starts]
    plan = Plan(
        model=search.workload.name, graph_hash=search.costs.fingerprint, batch=search.workload.batch,
        cluster=search.cluster.name, mesh=search.mesh,
        layers=[{"name": layer.name, "nodes": list(layer.nodes)} for layer in search.layers],
        stages=stages, num_microbatches=m, schedule=search.schedule, virtual=search.virtual, precision=search.graph.precision,
        dp_gradient={"zero_stage": 3 if zero else max((s.zero or 0 for s in stages), default=0),
                     "compression": search.costs.compression.canonical() if search.costs.compression else None,
                     "compressed": compressed_params(search.costs.compression, stages, {
                         f: tuple(search.graph.params[f].shape) for f in search.graph.params if f in search.graph.trainable},
                         search.cluster)
                     if search.costs.compression else None,
                     "delay": 0},
        estimate=estimate, name=name, units=None if len(units) == len(search.layers) else units,
        search={"method": name, **info, **({"hosts": [sim.hosts.devices_per_host, sim.hosts.cores_per_host]}
                                            if sim.hosts else {})})
    for stage in stages:
        if stage.collectives is not None:
            stage.collectives_key = plan.record_key(stage)
    return plan
