"""α-β communication costs of collectives along one axis of a device mesh.

For n devices on a link of latency α and β seconds per byte (ring algorithms):
all-reduce `2(n-1)α + 2(n-1)/n·B·β`; all-gather, reduce-scatter and all-to-all
`(n-1)α + (n-1)/n·B·β`, B being the full (gathered / unscattered) size; point-to-point `α + B·β`.

Which link an axis uses follows from where its devices are: a logical mesh is laid row-major over
the submesh's devices, host by host. An axis whose groups stay inside a host uses the intra-host
link; one that crosses hosts pays inter-host latency, and every group with members on a host
shares that host's NIC.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from enum import Enum

import numpy as np

from autopar.cost_models.cluster import ClusterSpec, Link


class Collective(str, Enum):
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"


def all_reduce_latency(n: int, link: Link) -> float:
    """The α part of a ring all-reduce: what one more message (a gradient bucket) adds."""
    return 2 * (n - 1) * link.latency if n > 1 else 0.0


def all_reduce_time(nbytes: float, n: int, link: Link) -> float:
    if n <= 1:
        return 0.0
    return all_reduce_latency(n, link) + 2 * (n - 1) / n * nbytes / link.bandwidth


def _ring_half(nbytes: float, n: int, link: Link) -> float:
    """Half a ring all-reduce: (n − 1) messages and (n − 1)/n of `nbytes` through the link."""
    if n <= 1:
        return 0.0
    return (n - 1) * link.latency + (n - 1) / n * nbytes / link.bandwidth


def all_gather_time(nbytes: float, n: int, link: Link) -> float:
    """`nbytes` is the gathered size; each device starts with nbytes / n."""
    return _ring_half(nbytes, n, link) * link.gather_factor


def reduce_scatter_time(nbytes: float, n: int, link: Link) -> float:
    """`nbytes` is the size before scattering; each device ends with nbytes / n."""
    return _ring_half(nbytes, n, link) * link.scatter_factor


def all_to_all_time(nbytes: float, n: int, link: Link) -> float:
    """`nbytes` is what each device holds; it keeps 1/n and sends the rest."""
    return _ring_half(nbytes, n, link)


def p2p_time(nbytes: float | np.ndarray, link: Link) -> float | np.ndarray:
    return link.latency + nbytes / link.bandwidth


_TIME = {
    Collective.ALL_REDUCE: all_reduce_time,
    Collective.ALL_GATHER: all_gather_time,
    Collective.REDUCE_SCATTER: reduce_scatter_time,
    Collective.ALL_TO_ALL: all_to_all_time,
}


def collective_time(kind: Collective | str, nbytes: float, n: int, link: Link) -> float:
    return _TIME[Collective(kind)](nbytes, n, link)


def axis_link(cluster: ClusterSpec, logical: tuple[int, ...], axis: int, submesh: tuple[int, int] | None = None) -> Link:
    """The effective link of the groups along `axis` of `logical`, laid over `submesh` (hosts, devices).

    Groups that cross hosts share each host's NIC: the busiest host divides it among its groups.
    """
    hosts, per_host = submesh or (cluster.num_hosts, cluster.devices_per_host)
    if math.prod(logical) != hosts * per_host:
        raise ValueError(f"logical mesh {logical} does not tile submesh {hosts}x{per_host}")
    device_ids = np.arange(hosts * per_host).reshape(logical)
    groups = np.moveaxis(device_ids, axis, -1).reshape(-1, logical[axis]) // per_host  # host of each member
    crossing = [set(g.tolist()) for g in groups if len(set(g.tolist())) > 1]
    if not crossing:
        return cluster.intra_host
    busiest = max(sum(host in g for g in crossing) for host in range(hosts))
    nic_share = cluster.inter_host.bandwidth / busiest
    return dataclasses.replace(cluster.inter_host, bandwidth=min(cluster.intra_host.bandwidth, nic_share))


def p2p_link(cluster: ClusterSpec, same_host: bool) -> Link:
    return cluster.intra_host if same_host else cluster.inter_host


@functools.cache
def largest_of_normals(n: int) -> float:
    """E[max of n independent standard normals] (0 for 1, 0.56 for 2, 1.03 for 4, 1.42 for 8)."""
    if n <= 1:
        return 0.0
    x = np.linspace(-8.0, 8.0, 4001)
    pdf = np.exp(-x * x / 2) / math.sqrt(2 * math.pi)
    cdf = np.cumsum(pdf) * (x[1] - x[0])
    return float(np.sum(x * n * pdf * np.minimum(cdf, 1.0) ** (n - 1)) * (x[1] - x[0]))


def straggler_wait(seconds: float | np.ndarray, n: int, jitter: float) -> float | np.ndarray:
    """What a group of `n` ranks waits for its slowest at a collective after `seconds` of
    computation since they last met: each rank's time drifts as a random walk (`DeviceSpec.jitter`
    √seconds per √second, the system's noise: Hoefler et al., SC 2010, on how noise that is
    harmless to one rank is amplified by collectives), so the slowest of n arrives
    E[max of n normals]·jitter·√seconds after the mean."""
    if n <= 1 or not jitter:
        return 0.0 * np.asarray(seconds)
    return largest_of_normals(n) * jitter * np.sqrt(np.maximum(seconds, 0.0))


def exposed_time(sync: float | np.ndarray, backward: float | np.ndarray, link: Link) -> float | np.ndarray:
    """What a gradient synchronisation of `sync` seconds adds after a backward of `backward` seconds
    running beside it: the link's `overlap` of it hides."""
    return np.maximum(0.0, sync - link.overlap * backward)


def stage_send_link(cluster: ClusterSpec, submesh: tuple[int, int]) -> Link:
    """The link a pipeline stage on `submesh` sends its boundary over: inside a host when the
    stage does not fill it, else the host's NIC, shared by the host's devices."""
    if submesh[0] == 1 and submesh[1] < cluster.devices_per_host:
        return cluster.intra_host
    return dataclasses.replace(cluster.inter_host, overlap=1.0,
                               bandwidth=cluster.inter_host.bandwidth / min(submesh[1], cluster.devices_per_host))
