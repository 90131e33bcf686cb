"""What gradient compression costs on the data axis (the spec users write, "dgc:0.999", is the
contract's: `autopar.contract.compression`): the bytes each method hands to collectives for a gradient of a given shape (the runtime's counters are
tested against these), and the time of a compressed synchronisation including the compressor's
own work.

The compressor's work is priced as passes over the fp32 gradient at memory bandwidth (plus
PowerSGD's two thin matmuls); gather-based methods also decode every rank's part. Threshold
quantisation sends as many values as exceed τ, which the data decides: it is priced as a dense
all-reduce (its worst case short of the fallback).
"""

from __future__ import annotations

import math

from autopar.contract.buckets import bucketed
from autopar.contract.compression import Spec, dgc_sparsifies
from autopar.cost_models.cluster import DeviceSpec, Link
from autopar.cost_models.comm import all_gather_time, all_reduce_time

# the methods `--compression auto` weighs: those published without loss of accuracy at these settings
AUTO = (None, "fp16", "powersgd:4", "dgc:0.999")
# passes over the gradient the compressor makes (encode, error feedback), before decoding
_PASSES = {"fp16": 2, "randk": 2, "powersgd": 3, "topk": 4, "dgc": 4, "onebit": 4, "terngrad": 3, "qsgd": 3,
           "signsgd": 2}


def wire(spec: Spec, shape: tuple[int, ...], ranks: int) -> tuple[str, int]:
    """(collective, bytes this rank hands to it per step) for one fp32 gradient of `shape`, as
    `runtime.compression` sends it: the sparse methods fall back to a dense all-reduce when
    gathering would move more."""
    n = math.prod(shape)
    a = spec.arg
    if spec.method == "fp16":
        return "all_reduce", 2 * n
    if spec.method == "randk":
        return "all_reduce", 4 * math.ceil(a * n)
    if spec.method == "powersgd":
        if len(shape) < 2:
            return "all_reduce", 4 * n
        rows, cols = shape[0], n // shape[0]
        return "all_reduce", 4 * min(int(a or 2), rows, cols) * (rows + cols)
    if spec.method == "dgc" and not dgc_sparsifies(shape):
        return "all_reduce", 4 * n
    if spec.method in ("topk", "dgc"):
        kept = math.ceil((a if spec.method == "topk" else 1 - a) * n)
        header = 16 if spec.method == "dgc" else 0  # its sizes travel first: two int64
        if ranks * 8 * kept >= 2 * 4 * n:
            return "all_reduce", 4 * n + header
        return "all_gather", 8 * kept + header
    if spec.method == "onebit":
        cols = n // shape[0] if len(shape) > 1 else 1
        return "all_gather", math.ceil(n / 8) + 8 * cols
    if spec.method == "terngrad":
        return "all_gather", math.ceil(n / 4) + 4
    if spec.method == "qsgd":
        return "all_gather", n + 4 * math.ceil(n / 512)  # int8 levels, an fp32 norm per 512
    if spec.method == "signsgd":
        return "all_gather", math.ceil(n / 8)
    raise ValueError(f"compression {spec.text!r} sends what the data decides: no formula gives its bytes")


PER_TENSOR = ("dgc", "powersgd", "onebit", "terngrad", "qsgd")  # the others compress a bucket end to end


def messages(spec: Spec, kind: str) -> int:
    """Collectives the runtime issues per bucket for one kind: every tensor's parts travel together."""
    if kind == "all_reduce":
        return 2 if spec.method == "powersgd" else 1
    return (1 if spec.method == "dgc" else 0) + (1 if spec.method == "signsgd" else 2)  # DGC: sizes first


def buckets(shapes: list[tuple[int, ...]]) -> list[list[tuple[int, ...]]]:
    """Gradients of these shapes (fp32, in the order backward produces them) grouped as the
    synchroniser groups them (`comm.bucketed`)."""
    return [[shapes[i] for i in group] for group in bucketed([4 * math.prod(s) for s in shapes])] or [[]]


def sync_time(spec: Spec, shapes: list[tuple[int, ...]], ranks: int, link: Link, device: DeviceSpec) -> float:
    """Seconds to average gradients of these shapes over `ranks` through the compressor, bucket by
    bucket: the bytes of its collectives (each gradient's for the methods in PER_TENSOR, the
    bucket's end to end for the others), their latency once per bucket and kind, and the
    compressor's own work."""
    if spec.method == "threshold":
        return dense_time(shapes, ranks, link)
    time = 0.0
    for bucket in buckets(shapes):
        units = bucket if spec.method in PER_TENSOR else [(sum(math.prod(s) for s in bucket),)]
        volume: dict[str, int] = {}
        for shape in units:
            n = math.prod(shape)
            kind, nbytes = wire(spec, shape, ranks)
            volume[kind] = volume.get(kind, 0) + nbytes
            if kind == "all_gather":
                time += ranks * 4 * n / device.memory_bandwidth  # decoding every rank's part
            time += _PASSES[spec.method] * 4 * n / device.memory_bandwidth
            if spec.method == "powersgd" and len(shape) > 1:
                time += 4 * n * int(spec.arg or 2) / (device.flops_for("float32") * device.efficiency)
        for kind, nbytes in volume.items():
            alpha = messages(spec, kind) * (ranks - 1) * link.latency
            if kind == "all_reduce":
                time += all_reduce_time(nbytes, ranks, link.bandwidth_only()) + 2 * alpha
            else:
                time += all_gather_time(ranks * nbytes, ranks, link.bandwidth_only()) + alpha
    return time


def dense_time(shapes: list[tuple[int, ...]], ranks: int, link: Link) -> float:
    return all_reduce_time(4 * sum(math.prod(s) for s in shapes), ranks, link.bandwidth_only())
