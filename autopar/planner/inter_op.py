"""Inter-op pass: cut the layers into pipeline stages, each on a submesh (Alpa eq. 2–5).

    T* = min over t_max of  (M − 1)·t_max + min Σ_i t_i   (every t_i ≤ t_max)

where t_i is the per-microbatch time of stage i (its layers on its submesh with its best logical
mesh, sharding, and recomputation when memory needs it) and the stages use every device.
`stage_dp` is a pure function over the cost array; t_max runs over the distinct stage times with
Alpa's early stop (once M·t_max exceeds the best total, no larger t_max can win). `candidates`
sweeps the same way a second total that charges each stage's once-per-step tail (gradient
synchronisation, optimizer) once rather than spread over its microbatches, since the stages run
theirs at the same time. The plans either finds are then replayed by the schedule simulator, which
adds what both leave out: transfers between stages, which stage's tail ends the step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

INF = float("inf")


WHOLE_HOSTS_ABOVE = 8  # hosts: on larger clusters every stage takes whole hosts


def submesh_shapes(hosts: int, per_host: int) -> list[tuple[int, int]]:
    """(1,1), (1,2), (1,4) … (1,M), then (2,M), (4,M) … (N,M): Alpa's shapes, hosts in powers of
    two (and N itself). Beyond 8 hosts the part-host shapes go: the DP then counts devices in
    whole hosts (8× fewer states on DGX clusters), and a stage of a few GPUs beside hundreds of
    full hosts is a layout nobody would run."""
    shapes, k = [], 1
    while k < per_host and hosts <= WHOLE_HOSTS_ABOVE:
        shapes.append((1, k))
        k *= 2
    n, hosts_list = 1, []
    while n < hosts:
        hosts_list.append(n)
        n *= 2
    return shapes + [(h, per_host) for h in hosts_list + [hosts]]


@dataclass(frozen=True)
class StageChoice:
    layers: tuple[int, int]
    shape: int  # index into the submesh shapes


def stage_dp(times: np.ndarray, sizes: list[int], devices: int, num_microbatches: int,
             stages: int | None = None, tolerance: float = 0.0, bound: float = INF,
             ) -> tuple[float, list[StageChoice]]:
    """times[s, i, j, k]: per-microbatch time of layers [i, j) as the s-th stage from the end on
    submesh shape k (inf where it does not fit). Returns (eq. 2 total, stages in order), the best
    of `candidates`; `stages` fixes how many."""
    found = candidates(times, sizes, devices, num_microbatches, stages, tolerance, bound)
    return found[0] if found else (INF, [])


def candidates(times: np.ndarray, sizes: list[int], devices: int, num_microbatches: int,
               stages: int | None = None, tolerance: float = 0.0, bound: float = INF, slack: float = 0.0,
               tails: np.ndarray | None = None, seeds: list[list[StageChoice]] = ()) -> list[tuple[float, list[StageChoice]]]:
    """Every plan the threshold sweep finds (the least Σ f_i under each threshold on the slowest
    stage) with a total within (1 + `slack`) of the best, best first: the total leaves out transfers
    and how stages overlap, so a runner-up may be the faster step, and the simulator judges them.

    Without `tails` the total is eq. 2 over `times` (each stage's per-microbatch time, its
    once-per-step share spread over the microbatches). With `tails` (that once-per-step part τ of
    each entry: gradient synchronisation left exposed, the optimizer) it is the tail charged once:

        Σ_i f_i + max_i ((M − 1)·f_i + τ_i),   f = times − τ/M,

    each stage's own time line (its M microbatches after the pipeline fills, then its tail), the
    slowest deciding: the stages run their tails at the same time, where eq. 2 adds every stage's.
    Both are Σ f_i + max_i g_i, swept the same way (eq. 2: f = times, g = (M − 1)·times).

    With `tolerance` ε > 0, the threshold on g is tried on a grid: one DP stands for every
    threshold within a factor (1 + ε) below it, so the total is within (1 + ε) of the optimum.
    `bound` is a step time already reached (the simulated step of another microbatch count's
    plan): a stage runs its M microbatches and its once-per-step share on its own devices (M·times),
    so a plan with a stage at or above it cannot beat it; often that rules the count out at once.
    (Totals of different counts do not bound each other.) `seeds`: plans already found (another
    objective's), priced here too: they bound the sweep from the start."""
    m = num_microbatches
    if stages is not None:  # only plans of exactly that many stages
        times = times.copy()
        times[stages + 1:] = INF  # no deeper pipeline
        times[1:stages, 0] = INF  # the first layer opens the stage `stages` from the end
    times = np.where(m * times < bound, times, INF)
    finite = np.isfinite(times)
    tails = np.where(finite, 0.0 if tails is None else tails, 0.0)
    f = np.where(finite, times - tails / m, 0.0)
    g = np.where(finite, (m - 1) * f + tails, INF)
    f[~finite] = INF
    unit = math.gcd(devices, *sizes)  # count devices in units of the smallest common submesh
    sizes, devices = [s // unit for s in sizes], devices // unit
    _, n_layers, _, n_shapes = times.shape
    n_layers -= 1
    order = np.argsort(g[finite], kind="stable")
    if not len(order):
        return []
    ordered = g[finite][order]
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
    thresholds = ordered[starts]
    # a plan whose largest g is thresholds[t] has a stage that alone runs M·times ≥ own[t] (its
    # microbatches and its tail): no total below that
    own = np.minimum.reduceat((m * times[finite])[order], starts)
    later = np.minimum.accumulate(own[::-1])[::-1]  # the least of own[t:]

    def dp(g_max: float) -> tuple[float, list[StageChoice]]:
        return _dp_for(np.where(g <= g_max, f, INF), sizes, devices, n_layers, n_shapes)

    def total_of(plan: list[StageChoice]) -> float:
        at = [(len(plan) - i, c.layers[0], c.layers[1], c.shape) for i, c in enumerate(plan)]
        return float(sum(f[a] for a in at)) + _largest(g, plan)

    # feasibility only grows with the threshold: find the smallest feasible one by bisection (to
    # within the grid: the sweep's first window then holds it), from the least threshold under
    # which every layer is in some stage to the largest g of a seed
    floor, plan = dp(thresholds[-1])  # the least Σ f of any plan: a floor under every total
    if not plan:
        return []
    least = g.min(axis=(0, 3))  # [i, j]
    covered = max(least[: layer + 1, layer + 1:].min() for layer in range(n_layers))
    lo = int(np.searchsorted(thresholds, covered))
    hi = min([len(thresholds) - 1] + [int(np.searchsorted(thresholds, _largest(g, plan))) for plan in seeds])
    while lo < hi and thresholds[hi] > thresholds[lo] * (1 + tolerance):
        mid = (lo + hi) // 2
        if dp(thresholds[mid])[1]:
            hi = mid
        else:
            lo = mid + 1

    found = {tuple(plan): total_of(plan) for plan in seeds}
    best_total = min(found.values(), default=INF)
    while lo < len(thresholds):
        if max(thresholds[lo] + floor, later[lo]) >= best_total * (1 + slack):
            break  # no later threshold can win (eq. 2: Alpa's early stop, M·t_max above the best)
        top = int(np.searchsorted(thresholds, thresholds[lo] * (1 + tolerance), side="right")) - 1
        if own[lo:top + 1].min() >= best_total * (1 + slack):
            lo = top + 1
            continue
        total, plan = dp(thresholds[top])
        if plan:
            found[tuple(plan)] = total_of(plan)
            best_total = min(best_total, found[tuple(plan)])
        lo = top + 1
    return sorted(((total, list(plan)) for plan, total in found.items() if total <= best_total * (1 + slack)),
                  key=lambda x: x[0])


def _largest(g: np.ndarray, plan: list[StageChoice]) -> float:
    return float(max(g[len(plan) - i, c.layers[0], c.layers[1], c.shape] for i, c in enumerate(plan)))


def _dp_for(allowed, sizes, devices, n_layers, n_shapes) -> tuple[float, list[StageChoice]]:
    """min Σ t_i over the `allowed` entries (inf: not) with exactly `devices` devices, by stages
    counted from the end.

    g[s][i][d]: layers i.. as s stages on d devices. One numpy step per (s, shape, stage length)
    over all (i, d); lengths with no stage allowed are skipped."""
    max_stages = allowed.shape[0] - 1
    g = np.full((max_stages + 1, n_layers + 1, devices + 1), INF)
    g[0, n_layers, 0] = 0.0
    arg_j = np.zeros((max_stages + 1, n_layers + 1, devices + 1), dtype=np.int32)
    arg_k = np.zeros((max_stages + 1, n_layers + 1, devices + 1), dtype=np.int32)
    finite = np.isfinite(allowed)
    # which (s, shape) have any stage of w layers under t_max: one pass instead of one test per step
    spans = [finite.diagonal(offset=w, axis1=1, axis2=2).any(axis=-1) for w in range(n_layers + 1)]
    for s in range(1, max_stages + 1):
        if not np.isfinite(g[s - 1]).any():
            break  # nothing to build on: deeper pipelines are impossible too
        for k in range(n_shapes):
            n = sizes[k]
            if n > devices:
                continue
            shifted = np.full((n_layers + 1, devices + 1), INF)
            shifted[:, n:] = g[s - 1, :, : devices + 1 - n]  # g[s-1][j][d - n]
            for w in range(1, n_layers + 1):  # stages of w layers: i -> j = i + w
                if not spans[w][s, k]:
                    continue
                t = np.diagonal(allowed[s, :, :, k], offset=w)  # t[i] = allowed[s, i, i + w, k]
                cand = t[:, None] + shifted[w:, :]  # [i, d]
                best = g[s, : n_layers + 1 - w]  # views: written in place where the candidate is better
                better = cand < best
                if better.any():
                    np.copyto(best, cand, where=better)
                    np.copyto(arg_j[s, : n_layers + 1 - w], np.arange(w, n_layers + 1)[:, None], where=better)
                    np.copyto(arg_k[s, : n_layers + 1 - w], k, where=better)
    totals = g[1:, 0, devices]
    if not np.isfinite(totals).any():
        return INF, []
    s = int(np.argmin(totals)) + 1
    total = float(totals[s - 1])
    plan, i, d = [], 0, devices
    while s > 0:
        j, k = int(arg_j[s, i, d]), int(arg_k[s, i, d])
        plan.append(StageChoice((i, j), k))
        i, d, s = j, d - sizes[k], s - 1
    return total, plan


def microbatch_counts(batch: int, limit: int = 4096) -> list[int]:
    """Divisors of the global batch (the number of microbatches must split it evenly)."""
    return [m for m in range(1, min(batch, limit) + 1) if batch % m == 0]


def brute_force(times: np.ndarray, sizes: list[int], devices: int, num_microbatches: int,
                tails: np.ndarray | None = None) -> float:
    """Every contiguous split × shape assignment, priced as `candidates` prices (for tests on small
    instances)."""
    _, n_layers, _, n_shapes = times.shape
    n_layers -= 1
    best = INF

    def rec(i: int, chosen: list[tuple[int, int, int]]) -> None:
        nonlocal best
        if i == n_layers:
            if sum(sizes[k] for _, _, k in chosen) != devices:
                return
            s, m = len(chosen), num_microbatches
            at = [(s - idx, a, b, k) for idx, (a, b, k) in enumerate(chosen)]
            ts = [times[x] for x in at]
            if all(math.isfinite(t) for t in ts):
                if tails is None:
                    best = min(best, sum(ts) + (m - 1) * max(ts))
                else:  # the tails once: Σ f + max((M − 1)·f + τ)
                    fs = [times[x] - tails[x] / m for x in at]
                    best = min(best, sum(fs) + max((m - 1) * f + tails[x] for f, x in zip(fs, at)))
            return
        for j in range(i + 1, n_layers + 1):
            for k in range(n_shapes):
                if len(chosen) + 1 < times.shape[0]:
                    rec(j, chosen + [(i, j, k)])

    rec(0, [])
    return best
