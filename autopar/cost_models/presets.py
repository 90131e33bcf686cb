"""Cluster presets from public data sheets (figures in ../shared/REFERENCES.md).

Bandwidths are one direction: NVLink totals are halved (V100 NVLink 2: 300 GB/s total per GPU ->
150 GB/s each way). Latencies are not on data sheets: 5 µs inside a host and 10 µs across
InfiniBand are the usual NCCL figures, 30 µs for AWS's 25 Gb/s TCP network; calibration
replaces them. `efficiency` 0.5 is what Megatron-LM reaches end to end (44–52 % of peak, Table 1).
GPUs issue kernels asynchronously (`asynchronous`); their per-op floor and small-matmul shortfall
are not on data sheets and stay 0 until a calibration on the GPU measures them. Adam moves 28
bytes per parameter (fused), the gradient all-reduce hides behind backward (`overlap` 1).
Host side (optimizer offload): each GPU's PCIe x16 link at its generation's rate per direction
(Gen3 15.75 GB/s on p3, Gen4 31.5 on DGX A100, Gen5 63 on DGX H100; PCI-SIG), and the host CPUs'
memory bandwidth (channels × transfer rate × 8 bytes: p3's 2 × Xeon E5-2686 v4, 4 × DDR4-2400
each, 153.6 GB/s; DGX A100's 2 × EPYC 7742, 8 × DDR4-3200 each, 409.6; DGX H100's 2 × Xeon 8480C,
8 × DDR5-4800 each, 614.4), at 10 µs per copy.
"""

from __future__ import annotations

import os
from pathlib import Path

from autopar.contract.errors import ClusterSpecError
from autopar.cost_models.cluster import GB, ClusterSpec, DeviceSpec, GiB, Link

V100 = DeviceSpec(
    name="V100-SXM2-16GB",
    peak_flops={"float16": 125e12, "bfloat16": 15.7e12, "float32": 15.7e12},  # no bf16 tensor cores
    memory_bytes=16 * GiB,
    memory_bandwidth=900 * GB,
    asynchronous=True,
)
A100 = DeviceSpec(
    name="A100-SXM-80GB",
    peak_flops={"float16": 312e12, "bfloat16": 312e12, "float32": 19.5e12},
    memory_bytes=80 * GiB,
    memory_bandwidth=2039 * GB,
    asynchronous=True,
)
H100 = DeviceSpec(
    name="H100-SXM-80GB",
    peak_flops={"float16": 989e12, "bfloat16": 989e12, "float32": 67e12},
    memory_bytes=80 * GiB,
    memory_bandwidth=3350 * GB,
    asynchronous=True,
)


def _gpu_cluster(name: str, device: DeviceSpec, nvlink: float, nic: float, nic_latency: float, pcie: float,
                 host_memory: float, about: str) -> ClusterSpec:
    """8 hosts of 8 GPUs; `nvlink` and `pcie` per GPU and `nic` per host, bytes/s in one direction."""
    return ClusterSpec(
        name=name,
        num_hosts=8,
        devices_per_host=8,
        device=device,
        intra_host=Link(bandwidth=nvlink, latency=5e-6),
        inter_host=Link(bandwidth=nic, latency=nic_latency),
        host_link=Link(bandwidth=pcie, latency=10e-6),
        host_memory_bandwidth=host_memory,
        description=about,
    )


V100_P3 = _gpu_cluster("v100-p3", V100, 150 * GB, 25e9 / 8, 30e-6, 15.75 * GB, 153.6 * GB,
                       "AWS p3.16xlarge: 8 V100-16GB on NVLink, 25 Gb/s between hosts (Alpa's testbed)")
A100_DGX = _gpu_cluster("a100-dgx", A100, 300 * GB, 8 * 200e9 / 8, 10e-6, 31.5 * GB, 409.6 * GB,
                        "DGX A100-80GB: NVLink 600 GB/s, 8x200 Gb/s InfiniBand per host (Megatron-LM's)")
H100_DGX = _gpu_cluster("h100-dgx", H100, 450 * GB, 8 * 400e9 / 8, 10e-6, 63 * GB, 614.4 * GB,
                        "DGX H100-80GB: NVLink 900 GB/s, 8x400 Gb/s InfiniBand per host")


def calibration_file() -> Path:
    """Where `autopar calibrate` keeps this machine's measured cluster ($AUTOPAR_CLUSTER overrides)."""
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "autopar" / "cpu-local.json"
    return Path(os.environ.get("AUTOPAR_CLUSTER", default))


def _cpu_local() -> ClusterSpec:
    """This machine: measured if calibrated, else nominal figures for one rank per core.

    Nominal: 2.5 GHz × 32 FP32 FLOP/cycle (AVX2, two FMA units) per core, 10 GB/s of memory
    bandwidth per core, and gloo over loopback at 2 GB/s with 50 µs per message.
    """
    path = calibration_file()
    if path.is_file():
        return ClusterSpec.load(path)
    return nominal_cpu(os.cpu_count() or 1, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def nominal_cpu(cores: int, memory: int) -> ClusterSpec:
    """`cpu-local`'s nominal figures for a machine of `cores` cores and `memory` bytes (tests plan
    for a fixed one, so that a searched plan does not depend on the machine running them)."""
    core_flops = 2.5e9 * 32
    return ClusterSpec(
        name="cpu-local",
        num_hosts=1,
        devices_per_host=cores,
        device=DeviceSpec(
            name="cpu-core",
            peak_flops={"float32": core_flops, "bfloat16": core_flops, "float16": core_flops / 4},
            memory_bytes=int(memory // cores),
            memory_bandwidth=10 * GB,
        ),
        intra_host=Link(bandwidth=2 * GB, latency=50e-6),
        inter_host=Link(bandwidth=2 * GB, latency=50e-6),
        description=f"this machine, {cores} CPU cores as devices (nominal until `autopar calibrate`)",
    )


PRESETS = {
    "v100-p3": lambda: V100_P3,
    "a100-dgx": lambda: A100_DGX,
    "h100-dgx": lambda: H100_DGX,
    "cpu-local": _cpu_local,  # read when asked: a calibration may have written it since
}


def get_cluster(name_or_path: str) -> ClusterSpec:
    """A preset by name, or a cluster JSON file by path."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]()
    if name_or_path.endswith(".json") or os.sep in name_or_path:
        return ClusterSpec.load(name_or_path)
    raise ClusterSpecError(
        f"unknown cluster {name_or_path!r}: presets are {', '.join(PRESETS)}, or give a cluster JSON file "
        "(e.g. one written by `autopar calibrate --out cluster.json`)"
    )
