"""`autopar calibrate`: measure this machine's ranks and write the ClusterSpec the cost model uses.

A device here is what one rank runs on (a CPU core with one thread under gloo, a GPU under NCCL).
Measured: matmul throughput per dtype (the best of a few sizes: what large matmuls reach, so the
spec's efficiency is 1), a convolution's throughput per dtype (reported), memory bandwidth (a large copy),
and for every group size 2 … N the time of all-reduce and all-gather across message sizes, with
α (latency) and β (seconds per byte) fitted by least squares to the ring formulas of
`cost_models.comm`. The link of the spec is the fit of the largest group (its ranks share the host
the way a plan's would).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from runtime.backend import free_port

SIZES = [2**k for k in range(10, 24, 2)]  # bytes per collective: 1 KiB … 4 MiB


def _timed(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_device(device: torch.device) -> dict[str, Any]:
    """FLOP/s of matmuls per dtype and of a convolution, and memory bandwidth, on one rank's device."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    flops: dict[str, float] = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        best = 0.0
        for n in (256, 512, 1024):
            a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
            t = _timed(lambda a=a, b=b: (a @ b, sync()), repeats=3)
            best = max(best, 2 * n**3 / t)
        flops[str(dtype).removeprefix("torch.")] = best
    conv: dict[str, float] = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x, w = (torch.randn(*shape, device=device).to(dtype) for shape in ((8, 64, 32, 32), (64, 64, 3, 3)))
        try:
            t = _timed(lambda x=x, w=w: (torch.nn.functional.conv2d(x, w, padding=1), sync()), repeats=3)
        except RuntimeError:  # no kernel for this dtype on this device
            continue
        conv[str(dtype).removeprefix("torch.")] = 2 * 8 * 64 * 32 * 32 * 64 * 9 / t
    big = torch.empty(16 * 2**20, device=device)  # 64 MiB
    t = _timed(lambda: (big.clone(), sync()), repeats=3)
    return {"matmul_flops": flops, "conv2d_flops": conv, "memory_bandwidth": 2 * big.numel() * 4 / t}


def _fit(sizes: list[int], times: list[float], n: int, kind: str) -> tuple[float, float]:
    """α, β from t = a·α + b·B·β: all-reduce a = 2(n−1), b = 2(n−1)/n; all-gather (B gathered) n−1, (n−1)/n."""
    a, b = (2 * (n - 1), 2 * (n - 1) / n) if kind == "all_reduce" else (n - 1, (n - 1) / n)
    slope, intercept = np.polyfit(np.array(sizes, dtype=float), np.array(times), 1)
    return max(float(intercept) / a, 1e-7), max(float(slope) / b, 1e-13)


def _rank(rank: int, world: int, port: int, out: str, backend: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    result: dict[str, Any] = {"device": measure_device(device) if rank == 0 else None, "links": {}}
    for n in range(2, world + 1):
        group = dist.new_group(list(range(n)))
        if rank >= n:
            continue
        fits = {}
        for kind in ("all_reduce", "all_gather"):
            times = []
            for nbytes in SIZES:
                x = torch.zeros(nbytes // 4, device=device)
                if kind == "all_reduce":
                    t = _timed(lambda x=x, g=group: dist.all_reduce(x, group=g), repeats=5)
                else:
                    parts = [torch.empty_like(x) for _ in range(n)]
                    t = _timed(lambda x=x, parts=parts, g=group: dist.all_gather(parts, x, group=g), repeats=5)
                times.append(t)
            sizes = [s * n for s in SIZES] if kind == "all_gather" else SIZES
            alpha, beta = _fit(sizes, times, n, kind)
            fits[kind] = {"latency": alpha, "seconds_per_byte": beta, "sizes": sizes, "times": times}
        result["links"][n] = fits
    if rank == 0:
        torch.save(result, out)
    dist.barrier()
    dist.destroy_process_group()


def calibrate(nproc: int, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Measurements of `nproc` local ranks (at least 2 for the links)."""
    from runtime import default_backend

    backend = default_backend()
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "calibration.pt")
        if progress:
            progress(f"{nproc} ranks: matmul, convolution, memory, collectives of 2…{nproc} ranks")
        mp.spawn(_rank, args=(nproc, port, out, backend), nprocs=nproc, join=True)
        return torch.load(out, weights_only=False)


def cluster_spec(measured: dict[str, Any], nproc: int, name: str = "cpu-local") -> Any:
    """The ClusterSpec of what was measured: one host of `nproc` devices."""
    from cost_models import ClusterSpec, DeviceSpec, Link

    dev = measured["device"]
    largest = measured["links"][max(measured["links"])]["all_reduce"]
    link = Link(bandwidth=1 / largest["seconds_per_byte"], latency=largest["latency"])
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(1, nproc)
    if torch.cuda.is_available():
        memory = torch.cuda.get_device_properties(0).total_memory
    return ClusterSpec(
        name=name, num_hosts=1, devices_per_host=nproc,
        device=DeviceSpec(name="cuda-gpu" if torch.cuda.is_available() else "cpu-core",
                          peak_flops=dev["matmul_flops"], memory_bytes=int(memory),
                          memory_bandwidth=dev["memory_bandwidth"], efficiency=1.0),
        intra_host=link, inter_host=link,
        description=f"this machine, {nproc} ranks, calibrated {time.strftime('%Y-%m-%d')}")
