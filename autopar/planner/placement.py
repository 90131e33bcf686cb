"""Placements on one mesh axis ("R", "S(d)", "P") and what moving between them costs.

Forward, a consumer that needs another placement than its producer's pays the collective that
converts it; backward, the gradient pays the way back (DTensor's rule: the backward of a
redistribution is the reverse redistribution; a partial sum's gradient is replicated, free).
"""

from __future__ import annotations

import re

from autopar.cost_models import Collective, Link, collective_time

R, P = "R", "P"
_SHARD = re.compile(r"S\((\d+)\)")


def shard(dim: int) -> str:
    return f"S({dim})"


def shard_dim(placement: str) -> int | None:
    m = _SHARD.fullmatch(placement)
    return int(m.group(1)) if m else None


def redistribution(src: str, dst: str, n: int) -> list[tuple[Collective, float]]:
    """Collectives converting `src` to `dst` over n devices, each with the bytes it is sized by
    as a fraction of the full tensor (see cost_models.comm for what the size means)."""
    if n <= 1 or src == dst or src == R or dst == P:
        return []  # slicing a replica, or keeping a local value as a partial sum, is free
    if src == P:
        return [(Collective.ALL_REDUCE, 1.0)] if dst == R else [(Collective.REDUCE_SCATTER, 1.0)]
    if dst == R:
        return [(Collective.ALL_GATHER, 1.0)]
    return [(Collective.ALL_TO_ALL, 1.0 / n)]  # S(d) -> S(e): each device holds 1/n


def redistribution_time(src: str, dst: str, nbytes: float, n: int, link: Link) -> float:
    return sum(collective_time(kind, nbytes * f, n, link) for kind, f in redistribution(src, dst, n))


def edge_time(src: str, dst: str, nbytes: float, n: int, link: Link, grad: bool, partial_share: int = 0) -> float:
    """Forward redistribution, plus the gradient's way back when the tensor is differentiated.

    With `partial_share`, the consumer leaves the gradient a partial sum (a column-parallel
    matmul's input): it goes back as P to the producer's placement — all-reduce to R,
    reduce-scatter to S(d), as DTensor does — once for all `partial_share` consumers that add up first."""
    t = redistribution_time(src, dst, nbytes, n, link)
    back = R if src == P else src
    if grad and partial_share:
        t += redistribution_time(P, back, nbytes, n, link) / partial_share
    elif grad:
        t += redistribution_time(dst, back, nbytes, n, link)
    return t
