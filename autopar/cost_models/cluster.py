"""Cluster descriptions: what the cost models know about the hardware.

A `ClusterSpec` is hosts × devices per host, the device's peak FLOP/s per dtype, memory and
memory bandwidth, and two links: inside a host (per device, one direction) and between hosts (per
host NIC, one direction). Presets come from public data sheets (../shared/REFERENCES.md);
`cpu-local` describes this machine, from a calibration file when one exists.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autopar.contract.errors import ClusterSpecError
from autopar.contract.jsonio import load_file, write_json
from autopar.contract.limits import MAX_DEVICES, MAX_DEVICES_PER_HOST, MAX_MEMORY_BYTES

GB = 1e9
GiB = 2**30


@dataclass(frozen=True, kw_only=True)
class Link:
    bandwidth: float  # bytes/s in one direction
    latency: float  # seconds per message (α)
    # the part of a gradient all-reduce that hides behind the backward running beside it: 1 on
    # GPUs (NCCL's kernels and copy engines), about 0 where gloo reduces on the cores backward needs
    overlap: float = 1.0
    # measured time of an all-gather / a reduce-scatter over the ring formula's with this α and β
    # (fitted on all-reduces): 1 for NCCL's ring kernels; gloo's on loopback take 2-3 times it
    # (`autopar calibrate` measures them; FSDP2's ZeRO and DTensor's redistributions run these)
    gather_factor: float = 1.0
    scatter_factor: float = 1.0

    def bandwidth_only(self) -> Link:
        """The link without its per-message cost, for bytes whose α is charged elsewhere (once per
        gradient bucket, not per tensor)."""
        return dataclasses.replace(self, latency=0.0, overlap=1.0)


@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    name: str
    peak_flops: dict[str, float] = field(hash=False)  # dtype name ("float16", ...) -> FLOP/s
    memory_bytes: int
    memory_bandwidth: float  # bytes/s
    efficiency: float = 0.5  # fraction of peak a large matmul reaches; calibration measures it
    # a matmul of f FLOPs runs at f / (f + f½) of that: small ones fall short. f½ per dtype name
    # (a dtype not listed: float32's), or one number for all
    matmul_half_flops: dict[str, float] | float = field(default=0.0, hash=False)
    # host time to issue one op (forward or backward: dispatch, autograd); it adds to the op's
    # time, or on an `asynchronous` device (a GPU) bounds it from below (the kernel-launch floor)
    op_overhead_s: float = 0.0
    # more per op dispatched on DTensors (DTensor's sharding propagation): the optimizer's steps on
    # DTensor parameters (and every op of a stage the lowering leaves to the interpreter, unpriced:
    # the planner prices stages lowered, `runtime.lower` warns where one is not)
    sharded_op_overhead_s: float = 0.0
    # more per op of a sharded stage as it runs, lowered: its program over the plain code's per op
    lowered_op_overhead_s: float = 0.0
    asynchronous: bool = False
    # Adam's step: bytes moved per parameter (fused: read 4 fp32 tensors, write 3) and ops per tensor
    optimizer_bytes: float = 28.0
    optimizer_ops: float = 0.0
    # Adam's step: seconds more per DTensor parameter than per plain one (calibrated; 0: its ops at
    # `sharded_op_overhead_s` each, a graph op's price, which overprices the step's cached ops)
    optimizer_dtensor_s: float = 0.0
    # bytes of fp32 logits per second through cross-entropy's forward and backward (calibrated: its
    # log-softmax is exp and log per element, not a copy); 0: its passes at `memory_bandwidth`
    loss_bandwidth: float = 0.0
    # a gradient compressor's own work per method ("dgc", ...): [seconds per tensor, seconds per
    # element] of encoding one gradient, its memory's update and decoding it, as measured by
    # `calibrate` (its ops and passes as they run, not as counted); a method not listed: its passes
    # at `memory_bandwidth` and its ops at `op_overhead_s` (`cost_models.compression.work`)
    compressor_s: dict[str, list[float]] = field(default_factory=dict, hash=False)
    # how far a rank's progress drifts: L seconds of its computation take L ± jitter·√L (one
    # standard deviation, in √seconds; the system's noise as a random walk), so a group meeting at a
    # collective waits for its slowest (`comm.straggler_wait`); measured in place by `calibrate`,
    # 0 on presets (no data sheet gives it; a GPU queues its kernels ahead of the collective)
    jitter: float = 0.0

    def flops_for(self, dtype: str) -> float:
        """Peak FLOP/s for `dtype`; a dtype the sheet does not list runs at the float32 rate."""
        return self.peak_flops.get(dtype, self.peak_flops["float32"])

    def half_flops_for(self, dtype: str) -> float:
        """f½ of a `dtype` matmul (`matmul_half_flops`)."""
        half = self.matmul_half_flops
        return half if not isinstance(half, dict) else half.get(dtype, half.get("float32", 0.0))


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    name: str
    num_hosts: int
    devices_per_host: int
    device: DeviceSpec
    intra_host: Link  # per device, e.g. NVLink
    inter_host: Link  # per host NIC, shared by the host's devices
    description: str = ""
    # ranks of a host that compute at once (CPU cores with a thread each); None: every device.
    # More ranks than that share them: each runs at cores / busy ranks (`cost_models.simulator`)
    cores_per_host: int | None = None
    # where optimizer states may be offloaded (FSDP2's `CPUOffloadPolicy`): the host link per device
    # (PCIe, one direction) and the bytes/s the host's CPUs stream through its memory, shared by
    # its devices (Adam's step on the host). None: offloading is not priced, as on cpu-local (the
    # devices are the host: nothing moves) and on calibrated clusters (not measured yet)
    host_link: Link | None = None
    host_memory_bandwidth: float = 0.0

    @property
    def offloads(self) -> bool:
        """Whether optimizer states may be priced in host memory (`host_link`)."""
        return self.host_link is not None and self.host_memory_bandwidth > 0

    @property
    def num_devices(self) -> int:
        return self.num_hosts * self.devices_per_host

    def with_mesh(self, hosts: int, devices_per_host: int) -> ClusterSpec:
        """The same hardware with `hosts` hosts of `devices_per_host` devices each."""
        if hosts < 1 or devices_per_host < 1:
            raise ClusterSpecError(f"mesh {hosts}x{devices_per_host}: both sizes must be at least 1")
        if devices_per_host > self.devices_per_host:
            raise ClusterSpecError(
                f"mesh {hosts}x{devices_per_host}: a {self.name} host has {self.devices_per_host} devices; "
                f"use at most {self.devices_per_host} devices per host (e.g. --mesh "
                f"{hosts * devices_per_host // self.devices_per_host or 1}x{self.devices_per_host})"
            )
        return dataclasses.replace(self, num_hosts=hosts, devices_per_host=devices_per_host)

    def with_ranks(self, ranks: int) -> ClusterSpec:
        """One host running `ranks` ranks: more than its devices share them (their cores)."""
        if ranks <= self.devices_per_host:
            return self
        return dataclasses.replace(self, devices_per_host=ranks, cores_per_host=self.cores_per_host or self.devices_per_host)

    def over_link(self, link: Link) -> ClusterSpec:
        """The same devices joined by `link`, within hosts and between them (a slower network than
        the one measured: what a compressor is for)."""
        return dataclasses.replace(self, intra_host=link, inter_host=link)

    def to_dict(self) -> dict[str, Any]:
        return {"schema": "autopar.cluster/1", **dataclasses.asdict(self)}

    def save(self, path: str | Path) -> None:
        write_json(path, self.to_dict())

    @staticmethod
    def load(path: str | Path) -> ClusterSpec:
        return _parse_cluster(load_file(path, "cluster file", ClusterSpecError), str(path))


def _parse_cluster(data: Any, source: str) -> ClusterSpec:
    """Build a ClusterSpec from JSON data, naming the first field that is missing or wrong."""
    if not isinstance(data, dict):
        raise ClusterSpecError(f"{source}: expected a JSON object, got {type(data).__name__}")
    schema = data.get("schema", "autopar.cluster/1")
    if schema != "autopar.cluster/1":
        raise ClusterSpecError(f"{source}: unknown schema {schema!r}, expected 'autopar.cluster/1'")

    def number(obj: dict, key: str, where: str, integer: bool = False, zero: bool = False, at_most: float = math.inf
               ) -> Any:
        value = obj.get(key) if isinstance(obj, dict) else None
        ok = isinstance(value, int) if integer else isinstance(value, (int, float))
        if isinstance(value, bool) or not ok or not math.isfinite(value) or value < 0 or value > at_most \
                or (value == 0 and not zero):
            kind = "a positive integer" if integer else f"a {'non-negative' if zero else 'positive'}, finite number"
            raise ClusterSpecError(f"{source}: {where}{key} must be {kind}"
                                   f"{f' of at most {at_most:g}' if at_most < math.inf else ''}, got {value!r}")
        return value

    def optional(obj: dict, key: str, where: str, default: float, at_most: float = math.inf) -> float:
        return float(number(obj, key, where, zero=True, at_most=at_most)) if key in obj else default

    def half_flops(dev: dict) -> dict[str, float] | float:
        value = dev.get("matmul_half_flops", 0.0)
        if isinstance(value, dict):
            return {k: float(number(value, k, "device.matmul_half_flops.", zero=True)) for k in value}
        return optional(dev, "matmul_half_flops", "device.", 0.0)

    def compressor_s(dev: dict) -> dict[str, list[float]]:
        value = dev.get("compressor_s", {})
        if not isinstance(value, dict) or not all(isinstance(v, list) and len(v) == 2 for v in value.values()):
            raise ClusterSpecError(f"{source}: device.compressor_s must map compression methods to [seconds per "
                                   "tensor, seconds per element]")
        return {k: [float(number(dict(enumerate(v)), i, f"device.compressor_s.{k}.", zero=True, at_most=1.0))
                    for i in range(2)] for k, v in value.items()}

    def known(obj: dict, keys: set[str], where: str) -> None:
        unknown = sorted(set(obj) - keys)
        if unknown:
            raise ClusterSpecError(f"{source}: unknown field {where}{unknown[0]!r}; the fields are {', '.join(sorted(keys))}")

    def section(key: str) -> dict:
        value = data.get(key)
        if not isinstance(value, dict):
            raise ClusterSpecError(f"{source}: missing object {key!r}")
        return value

    known(data, {f.name for f in dataclasses.fields(ClusterSpec)} | {"schema"}, "")
    dev = section("device")
    known(dev, {f.name for f in dataclasses.fields(DeviceSpec)}, "device.")
    flops = dev.get("peak_flops")
    if not isinstance(flops, dict) or "float32" not in flops:
        raise ClusterSpecError(f"{source}: device.peak_flops must map dtype names to FLOP/s and include float32")
    for dtype in flops:
        number(flops, dtype, "device.peak_flops.")
    device = DeviceSpec(
        name=str(dev.get("name", "device")),
        peak_flops={k: float(v) for k, v in flops.items()},
        memory_bytes=number(dev, "memory_bytes", "device.", integer=True, at_most=MAX_MEMORY_BYTES),
        memory_bandwidth=float(number(dev, "memory_bandwidth", "device.")),
        efficiency=float(number(dev, "efficiency", "device.")) if "efficiency" in dev else 0.5,
        matmul_half_flops=half_flops(dev),
        op_overhead_s=optional(dev, "op_overhead_s", "device.", 0.0, at_most=1.0),
        sharded_op_overhead_s=optional(dev, "sharded_op_overhead_s", "device.", 0.0, at_most=1.0),
        lowered_op_overhead_s=optional(dev, "lowered_op_overhead_s", "device.", 0.0, at_most=1.0),
        asynchronous=bool(dev.get("asynchronous", False)),
        optimizer_bytes=optional(dev, "optimizer_bytes", "device.", 28.0, at_most=1e4),
        optimizer_ops=optional(dev, "optimizer_ops", "device.", 0.0, at_most=1e4),
        optimizer_dtensor_s=optional(dev, "optimizer_dtensor_s", "device.", 0.0, at_most=1.0),
        loss_bandwidth=optional(dev, "loss_bandwidth", "device.", 0.0),
        jitter=optional(dev, "jitter", "device.", 0.0, at_most=1.0),
        compressor_s=compressor_s(dev),
    )
    if device.efficiency > 1:
        raise ClusterSpecError(f"{source}: device.efficiency must be in (0, 1], got {device.efficiency}")
    def link(key: str) -> Link:
        obj = section(key)
        known(obj, {f.name for f in dataclasses.fields(Link)}, f"{key}.")
        return Link(bandwidth=float(number(obj, "bandwidth", f"{key}.")), latency=float(number(obj, "latency", f"{key}.")),
                    overlap=optional(obj, "overlap", f"{key}.", 1.0, at_most=1.0),
                    **{f: float(number(obj, f, f"{key}.", at_most=1e3))
                       for f in ("gather_factor", "scatter_factor") if f in obj})

    links = {key: link(key) for key in ("intra_host", "inter_host")}
    cores = data.get("cores_per_host")
    host, host_memory = None, 0.0
    if data.get("host_link") is not None:
        host, host_memory = link("host_link"), float(number(data, "host_memory_bandwidth", ""))
    elif data.get("host_memory_bandwidth"):
        raise ClusterSpecError(f"{source}: host_memory_bandwidth prices an offloaded optimizer step, which needs "
                               "host_link (bandwidth, latency) too")
    hosts = number(data, "num_hosts", "", integer=True, at_most=MAX_DEVICES)
    per_host = number(data, "devices_per_host", "", integer=True, at_most=MAX_DEVICES_PER_HOST)
    if hosts * per_host > MAX_DEVICES:
        raise ClusterSpecError(f"{source}: num_hosts × devices_per_host = {hosts * per_host} devices; at most "
                               f"{MAX_DEVICES} are planned for")
    return ClusterSpec(
        name=str(data.get("name", Path(source).stem)),
        num_hosts=hosts,
        devices_per_host=per_host,
        device=device,
        description=str(data.get("description", "")),
        cores_per_host=None if cores is None else number(data, "cores_per_host", "", integer=True),
        host_link=host,
        host_memory_bandwidth=host_memory,
        **links,
    )
