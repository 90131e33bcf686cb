"""What gradient compression costs on the data axis (the spec users write, "dgc:0.999", is the
contract's: `autopar.contract.compression`): the bytes each method hands to collectives for a gradient of a given shape (the runtime's counters are
tested against these), and the time of a compressed synchronisation including the compressor's
own work, and which gradients travel compressed at all (`compresses`: where it saves time, and
enough bytes to be worth the accuracy it costs).

The compressor's work is priced as `calibrate` measured it on this machine (seconds per unit it
encodes and per element: `DeviceSpec.compressor_s`), else as its ops at the device's cost per op
and passes over the fp32 gradient at memory bandwidth (plus PowerSGD's two thin matmuls); gather-based
methods also decode every rank's part. Threshold
quantisation sends as many values as exceed τ, which the data decides: it is priced as a dense
all-reduce (its worst case short of the fallback).
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Any

from autopar.contract.buckets import bucketed
from autopar.contract.compression import Spec, matrix, parse
from autopar.contract.placements import Shard
from autopar.cost_models.cluster import ClusterSpec, DeviceSpec, Link
from autopar.cost_models.comm import all_gather_time, all_reduce_time, axis_link

# the convergence sweep's verdict (`benchmarks/compression_sweep.py` writes it): per method as swept,
# whether it held within its accuracy target on every model, and the range it was measured over
VERDICT = Path(__file__).with_name("compression_verdict.json")
# passes over the gradient the compressor makes (encode, error feedback), before decoding
_PASSES = {"fp16": 2, "randk": 2, "powersgd": 3, "topk": 4, "dgc": 4, "onebit": 4, "terngrad": 3, "qsgd": 3,
           "signsgd": 2}
# ops the runtime dispatches per unit it encodes (one rank: encoding, the memory's update, decoding
# its own part; `tests/test_compression.py` counts them): what a unit costs on the host before its
# bytes, where `calibrate` has not measured the method
_OPS = {"fp16": 16, "randk": 23, "powersgd": 26, "topk": 55, "dgc": 76, "onebit": 83, "terngrad": 77, "qsgd": 71,
        "signsgd": 53}
MEASURED_RANK = 2  # the PowerSGD rank `calibrate` measures; its matmuls beyond it are priced at FLOP/s


def wire(spec: Spec, shape: tuple[int, ...], ranks: int) -> tuple[str, int]:
    """(collective, bytes this rank hands to it per step) for one fp32 gradient of `shape`, as
    `runtime.compression` sends it where it compresses it (`compresses`): the sparse methods fall
    back to a dense all-reduce when gathering would move more."""
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


def compresses(spec: Spec, shape: tuple[int, ...], ranks: int, link: Link | None = None,
               device: DeviceSpec | None = None) -> bool:
    """Whether a gradient of `shape` (this rank's part) travels compressed: a weight matrix
    (`contract.compression.matrix`) of at least `min_size` elements that the method shrinks at
    least `min_rate` times on the wire, and, on a known link and device, whose compressed exchange
    (the compressor's passes, its bytes) is predicted faster than its share of a dense all-reduce
    (the collectives' latency is the bucket's, paid either way)."""
    n = math.prod(shape)
    if not matrix(shape) or n < spec.option("min_size"):
        return False
    if spec.method == "threshold":  # the data decides its bytes: nothing to weigh
        return True
    kind, nbytes = wire(spec, shape, ranks)
    if kind == "all_reduce" and nbytes >= 4 * n or 4 * n < spec.option("min_rate") * nbytes:
        return False
    if link is None or device is None:
        return True
    return tensor_time(spec, shape, ranks, link, device) < all_reduce_time(4 * n, ranks, link.bandwidth_only())


def decide(spec: Spec, shapes: list[tuple[int, ...]], ranks: int, link: Link | None = None,
           device: DeviceSpec | None = None) -> list[bool]:
    """Which of one synchroniser's gradients (`shapes`: each one's part on a rank, in the order
    backward produces them) travel compressed: those `compresses` takes, and, on a known link and
    device, in each bucket (`bucketed`, as the runtime groups them) only where compressing them
    makes the bucket's priced exchange at least `min_rate` times faster than sending it all dense:
    the saving torch's hook asks of a tensor's bytes (`min_compression_rate`) asked of the time the
    bytes stand for, which on a latency- or compressor-bound bucket they do not (the digits CNN's
    40 KB gradient on 100 Mb/s and 2 ranks: top-k shrinks it 12.5×, its exchange is priced 1.15×
    faster). A tensor's own weighing leaves out the collectives a compressor adds to its bucket, a
    latency each (that CNN's two matrices weighed alone compress on 4 ranks, the bucket priced and
    measured slower so)."""
    chosen = [compresses(spec, s, ranks, link, device) for s in shapes]
    if link is None or device is None or spec.method == "threshold":
        return chosen
    for bucket in bucketed([4 * math.prod(s) for s in shapes]):
        members, flags = [shapes[i] for i in bucket], [chosen[i] for i in bucket]
        if any(flags) and (spec.option("min_rate") * bucket_time(spec, members, flags, ranks, link, device)
                           >= bucket_time(spec, members, [False] * len(bucket), ranks, link, device)):
            for i in bucket:
                chosen[i] = False
    return chosen


def compressed_params(spec: Spec, stages: list[Any], shapes: dict[str, tuple[int, ...]], cluster: ClusterSpec
                      ) -> list[str]:
    """Of the stages' trainable parameters (`shapes`: FQN → shape, in the model's order), those whose
    gradients travel compressed (`decide` on each stage's parts on a rank, in backward order, over
    the link its stage's data axis crosses): what a plan's `dp_gradient.compressed` lists."""
    out = set()
    for stage in stages:
        dp, tp = stage.logical_mesh
        if dp == 1:
            continue
        link = axis_link(cluster, stage.logical_mesh, 0, stage.submesh)
        names, parts = [], []
        for fqn in reversed([f for f in shapes if f in stage.params]):  # as backward produces them
            shape = list(shapes[fqn])
            for p in stage.params[fqn][1:]:
                if isinstance(p, Shard):
                    shape[p.dim] = -(-shape[p.dim] // tp)
            names.append(fqn)
            parts.append(tuple(shape))
        out.update(n for n, chosen in zip(names, decide(spec, parts, dp, link, cluster.device)) if chosen)
    return sorted(out)


def tensor_time(spec: Spec, shape: tuple[int, ...], ranks: int, link: Link, device: DeviceSpec) -> float:
    """Seconds one gradient of `shape` adds to a compressed bucket's exchange: the compressor's
    passes over it (and decoding every rank's part where they are gathered, PowerSGD's two thin
    matmuls), and its bytes at the link's bandwidth."""
    kind, nbytes = wire(spec, shape, ranks)
    link = link.bandwidth_only()
    # a method that encodes a bucket's gradients as one pays its fixed cost once per bucket, as the latency
    return work(spec, shape, ranks, device, fixed=spec.method in PER_TENSOR) + (all_gather_time(ranks * nbytes, ranks, link) if kind == "all_gather"
                                               else all_reduce_time(nbytes, ranks, link))


def work(spec: Spec, shape: tuple[int, ...], ranks: int, device: DeviceSpec, fixed: bool = True) -> float:
    """The compressor's own seconds on one unit of `shape` (a gradient, or a bucket's compressed
    gradients as one), measured (`DeviceSpec.compressor_s`: on one rank) or nominal (its ops at
    the device's cost per op, its passes at memory bandwidth); decoding every other rank's part
    where they are gathered; PowerSGD's thin matmuls beyond the rank measured. `fixed=False`:
    without its cost per unit."""
    n = math.prod(shape)
    measured = device.compressor_s.get(spec.method)
    if measured:
        per_unit, per_element = measured
        time = per_element * n + per_unit * fixed
        decoded, rank = ranks - 1, MEASURED_RANK
    else:
        time = _PASSES[spec.method] * 4 * n / device.memory_bandwidth + _OPS[spec.method] * device.op_overhead_s * fixed
        decoded, rank = ranks, 0
    if wire(spec, shape, ranks)[0] == "all_gather":
        time += decoded * 4 * n / device.memory_bandwidth
    if spec.method == "powersgd":
        time += 4 * n * max(0, int(spec.arg or 2) - rank) / (device.flops_for("float32") * device.efficiency)
    return time


def sync_time(spec: Spec, shapes: list[tuple[int, ...]], ranks: int, link: Link, device: DeviceSpec,
              compressed: list[bool] | None = None) -> float:
    """Seconds to average gradients of these shapes (in backward order) over `ranks` through the
    compressor, bucket by bucket (`bucket_time`): those it compresses (`compressed`, else `decide`
    on this link) and the others dense. Priced as it runs once compressing (PowerSGD's dense start
    and the sparsifiers' warm-up are a few hundred steps of a run)."""
    if compressed is None:
        compressed = decide(spec, shapes, ranks, link, device)
    return sum(bucket_time(spec, [shapes[i] for i in bucket], [compressed[i] for i in bucket], ranks, link, device)
               for bucket in bucketed([4 * math.prod(s) for s in shapes]))


def bucket_time(spec: Spec, shapes: list[tuple[int, ...]], compressed: list[bool], ranks: int, link: Link,
                device: DeviceSpec) -> float:
    """Seconds one bucket's exchange takes: its `compressed` gradients at their bytes (each
    gradient's for the methods in PER_TENSOR, their concatenation's for the others) with the
    compressor's own work, the others in one dense all-reduce; each collective's latency once per
    bucket and kind. Threshold quantisation: as dense (its bytes are the data's)."""
    if spec.method == "threshold":
        return all_reduce_time(4 * sum(math.prod(s) for s in shapes), ranks, link)
    dense, units = _units(spec, shapes, compressed)
    time = all_reduce_time(4 * sum(math.prod(s) for s in dense), ranks, link) if dense else 0.0
    volume: dict[str, int] = {}
    for shape in units:
        kind, nbytes = wire(spec, shape, ranks)
        volume[kind] = volume.get(kind, 0) + nbytes
        time += work(spec, shape, ranks, device)
    for kind, nbytes in volume.items():
        alpha = messages(spec, kind) * (ranks - 1) * link.latency
        if kind == "all_reduce":
            time += all_reduce_time(nbytes, ranks, link.bandwidth_only()) + 2 * alpha
        else:
            time += all_gather_time(ranks * nbytes, ranks, link.bandwidth_only()) + alpha
    return time


def sent_bytes(spec: Spec, shapes: list[tuple[int, ...]], ranks: int, compressed: list[bool]) -> int:
    """Bytes this rank hands to collectives per step for gradients of these shapes (those marked
    `compressed` through the compressor, the others dense), as `sync_time` prices them."""
    total = 0
    for bucket in bucketed([4 * math.prod(s) for s in shapes]):
        dense, units = _units(spec, [shapes[i] for i in bucket], [compressed[i] for i in bucket])
        total += sum(4 * math.prod(s) for s in dense) + sum(wire(spec, shape, ranks)[1] for shape in units)
    return total


def _units(spec: Spec, shapes: list[tuple[int, ...]], compressed: list[bool]):
    """One bucket's (dense gradients' shapes, the units the compressor encodes: each compressed
    gradient for the methods in PER_TENSOR, their concatenation for the others)."""
    coded = [s for s, c in zip(shapes, compressed) if c]
    units = coded if spec.method in PER_TENSOR or not coded else [(sum(math.prod(s) for s in coded),)]
    return [s for s, c in zip(shapes, compressed) if not c], units


@functools.cache
def verdict() -> dict[str, Any]:
    """The convergence sweep's verdict (`VERDICT`; {} where none was written)."""
    return json.loads(VERDICT.read_text()) if VERDICT.is_file() else {}


def auto_candidates() -> tuple[str | None, ...]:
    """What `--compression auto` weighs: dense, and each method as the convergence sweep ran it that
    met its accuracy target on every model there. The planner then keeps the fastest predicted."""
    return (None, *(text for text, v in verdict().get("methods", {}).items() if v["held"]))


def unmeasured(spec: Spec, ranks: int, local_batch: int, params: int) -> str | None:
    """Why the sweep's verdict does not cover `spec` used on `ranks` data-parallel ranks with
    `local_batch` samples a rank on a model of `params` parameters (None: it does): the method as
    configured not run to convergence, or lost more than its target there, or this use outside the
    ranks, batches and model sizes it was measured over."""
    v = verdict()
    runs = {parse(text).canonical(): (text, r) for text, r in v.get("methods", {}).items()}
    measured = runs.get(spec.canonical())
    if measured is None:
        swept = ", ".join(text for text, _ in runs.values()) or "none"
        return (f"compression {spec.text} was not run to convergence by the sweep (it ran {swept}, each with its "
                "defaults): its accuracy against dense is unmeasured")
    text, r = measured
    if not r["held"]:
        return (f"compression {text} lost {-r['worst_gap']:.2f} points against dense in the sweep, more than its "
                f"target of {r['target']:g}")
    span = v["range"]
    outside = [f"{what} {value:,}, measured {lo:,}–{hi:,}" for what, value, (lo, hi) in (
        ("data-parallel ranks", ranks, span["ranks"]), ("samples a rank", local_batch, span["local_batch"]),
        ("parameters", params, span["params"])) if not lo <= value <= hi]
    if outside:
        return (f"compression {text} held within {r['target']:g} point{'s' * (r['target'] != 1)} of dense on the "
                f"sweep's models "
                f"({', '.join(v['models'])}), but this run is outside what it measured ({'; '.join(outside)})")
    return None
