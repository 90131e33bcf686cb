"""Inter-op pass: cut the layers into pipeline stages, each on a submesh (Alpa eq. 2–5).

    T* = min over t_max of  (M − 1)·t_max + min Σ_i t_i   (every t_i ≤ t_max)

where t_i is the per-microbatch time of stage i (its layers on its submesh with its best logical
mesh, sharding, and recomputation when memory needs it) and the stages use every device.
`stage_dp` is a pure function over the cost array; t_max runs over the distinct stage times with
Alpa's early stop (once M·t_max exceeds the best total, no larger t_max can win). The plan it
picks is then replayed by the schedule simulator, which adds what eq. 2 leaves out: transfers
between stages and the data-parallel gradient reduction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

INF = float("inf")


def submesh_shapes(hosts: int, per_host: int) -> list[tuple[int, int]]:
    """(1,1), (1,2), (1,4) … (1,M), then (2,M), (4,M) … (N,M): Alpa's shapes, hosts in powers of
    two (and N itself), which keeps the DP small on clusters of hundreds of hosts."""
    shapes, k = [], 1
    while k < per_host:
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
             stages: int | None = None) -> tuple[float, list[StageChoice]]:
    """times[s, i, j, k]: per-microbatch time of layers [i, j) as the s-th stage from the end on
    submesh shape k (inf where it does not fit). Returns (eq. 2 total, stages in order);
    `stages` fixes how many."""
    if stages is not None:  # only plans of exactly that many stages
        times = times.copy()
        times[stages + 1:] = INF  # no deeper pipeline
        times[1:stages, 0] = INF  # the first layer opens the stage `stages` from the end
    _, n_layers, _, n_shapes = times.shape
    n_layers -= 1
    candidates = np.unique(times[np.isfinite(times)])
    if not len(candidates):
        return INF, []
    # feasibility only grows with t_max: find the smallest feasible one by bisection
    lo, hi = 0, len(candidates) - 1
    if not _dp_for(times, sizes, devices, n_layers, n_shapes, candidates[hi])[1]:
        return INF, []
    while lo < hi:
        mid = (lo + hi) // 2
        if _dp_for(times, sizes, devices, n_layers, n_shapes, candidates[mid])[1]:
            hi = mid
        else:
            lo = mid + 1
    best_total, best_plan = INF, []
    for t_max in candidates[lo:]:
        if num_microbatches * t_max >= best_total:
            break  # Alpa's early stop: every later t_max only adds to (M-1)·t_max
        total, plan = _dp_for(times, sizes, devices, n_layers, n_shapes, t_max)
        if plan and total + (num_microbatches - 1) * t_max < best_total:
            best_total, best_plan = total + (num_microbatches - 1) * t_max, plan
    return best_total, best_plan


def _dp_for(times, sizes, devices, n_layers, n_shapes, t_max) -> tuple[float, list[StageChoice]]:
    """min Σ t_i with every t_i ≤ t_max and exactly `devices` devices, by stages counted from the end.

    g[s][i][d]: layers i.. as s stages on d devices. One numpy step per (s, shape, stage length)
    over all (i, d); lengths with no stage under t_max are skipped."""
    max_stages = times.shape[0] - 1
    allowed = np.where(times <= t_max, times, INF)
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
                better = cand < g[s, : n_layers + 1 - w]
                if better.any():
                    g[s, : n_layers + 1 - w][better] = cand[better]
                    arg_j[s, : n_layers + 1 - w][better] = (np.arange(n_layers + 1 - w)[:, None] + w
                                                             ).repeat(devices + 1, axis=1)[better]
                    arg_k[s, : n_layers + 1 - w][better] = k
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


def brute_force(times: np.ndarray, sizes: list[int], devices: int, num_microbatches: int) -> float:
    """Every contiguous split × shape assignment (for tests on small instances)."""
    _, n_layers, _, n_shapes = times.shape
    n_layers -= 1
    best = INF

    def rec(i: int, chosen: list[tuple[int, int, int]]) -> None:
        nonlocal best
        if i == n_layers:
            if sum(sizes[k] for _, _, k in chosen) != devices:
                return
            s = len(chosen)
            ts = [times[s - idx, a, b, k] for idx, (a, b, k) in enumerate(chosen)]
            if all(math.isfinite(t) for t in ts):
                best = min(best, sum(ts) + (num_microbatches - 1) * max(ts))
            return
        for j in range(i + 1, n_layers + 1):
            for k in range(n_shapes):
                if len(chosen) + 1 < times.shape[0]:
                    rec(j, chosen + [(i, j, k)])

    rec(0, [])
    return best
