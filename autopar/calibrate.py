"""`autopar calibrate`: measure this machine's ranks and write the ClusterSpec the cost model uses.

A device here is what one rank runs on (a CPU core with one thread under gloo, a GPU under NCCL).
Measured: the matmul rate per dtype as linear layers train (forward and backward, under autocast
for 16-bit dtypes: the spec's efficiency is 1) and how far small ones fall short of it
(`matmul_half_flops`, per dtype), the best square matmul's and a convolution's throughput per
dtype (reported), memory bandwidth (a large copy), the fixed cost of an op (a chain of tiny ones,
forward and backward), the loss's rate (cross-entropy forward and backward), AdamW per tensor and
per element, how much of
an all-reduce hides behind computation (`Link.overlap`), and for every group size 2 … N the time
of all-reduce and all-gather across message sizes; α (latency) and β (seconds per byte) are
fitted to the ring formulas of `cost_models.comm` over all of them, with ranks beyond the host's
cores sharing them (`ClusterSpec.cores_per_host`). Then the runtime itself, in place: a small GPT
trained by `parallelize` on every rank gives the cost of an op on DTensors and the tensor axis's
collective latency where they are paid (`runtime_overheads`).
"""

from __future__ import annotations

import logging
import math
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

from autopar.api import parallelize
from autopar.contract.compression import parse
from autopar.cost_models import ClusterSpec, DeviceSpec, Link
from autopar.cost_models.comm import largest_of_normals
from autopar.cost_models.compression import MEASURED_RANK
from autopar.cost_models.compute import LOSS_OPS
from autopar.models import load_workload
from autopar.planner.capture import capture
from autopar.runtime import default_backend
from autopar.runtime.backend import join_local, local_store, pin, rank_cores
from autopar.runtime.breakdown import measuring, summarise
from autopar.runtime.compression import Compressed
from autopar.runtime.loop import time_steps

SIZES = [2**k for k in range(10, 24, 2)]  # bytes per collective: 1 KiB … 4 MiB


def _timed(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _chain_overhead(x: torch.Tensor, n: int = 200) -> float:
    """Seconds per op of a chain of `n` tiny element-wise ops, forward and backward each: the host's
    fixed cost of issuing an op (dispatch, autograd), which no FLOP or byte count holds."""
    def run() -> None:
        y = x
        for _ in range(n):
            y = y * 1.0
        y.sum().backward()

    return _timed(run, repeats=5) / (2 * n + 2)


# square matmul sizes whose best is a device's raw matmul rate (reported); a GPU reaches it only
# from thousands (a 1024³ bf16 matmul takes microseconds, about a kernel launch)
PEAK_SIZES = {"cpu": (256, 512, 1024), "cuda": (2048, 4096, 8192)}
# linear layers (tokens M, in K, out N) the rate the cost model uses is fitted over: the sizes of
# CPU-sized and GPU-sized transformer layers, square and not
LINEAR_SHAPES = {"cpu": [(m, k, n) for m in (128, 512, 2048) for k, n in ((256, 256), (256, 1024), (1024, 256),
                                                                          (1024, 1024))],
                 "cuda": [(m, k, n) for m in (1024, 4096, 16384) for k, n in ((1024, 1024), (1024, 4096),
                                                                              (4096, 1024), (4096, 4096))]}
LOSS_SHAPES = {"cpu": ((256, 8192), (1024, 8192), (2048, 16384)), "cuda": ((4096, 32768), (8192, 32768))}


def _linear_fit(device: torch.device, sync: Callable[[], Any], dtype: torch.dtype, overhead: float
                ) -> tuple[float, float] | None:
    """(FLOP/s, f½) of matmuls as training runs them: a linear layer's forward and backward, three
    matmuls, two with a transposed operand (under autocast to `dtype` for a 16-bit one, its casts of
    input, weight and gradients included), over `LINEAR_SHAPES`, fitted to the cost model's
    `t = (F + 3 f½) / rate + 2 ops` (`compute.fixed_time`) in relative error. The best square
    matmul is no rate for a model's layers: on a Xeon core fp32 linear layers ran at 0.73 of it
    (155 of 211 GFLOP/s) and bf16 ones under autocast at 0.39 (549 of 1,412). None: no kernel."""
    rows, ones = [], []
    for m, k, n in LINEAR_SHAPES.get(device.type, LINEAR_SHAPES["cpu"]):
        layer = torch.nn.Linear(k, n, device=device)
        x = torch.randn(m, k, device=device, requires_grad=True)
        grad = torch.ones(m, n, device=device)

        def step(layer: torch.nn.Module = layer, x: torch.Tensor = x, grad: torch.Tensor = grad) -> None:
            layer.weight.grad = layer.bias.grad = x.grad = None  # the first microbatch's: stored, not added
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                y = layer(x)
            y.backward(grad.to(y.dtype))
            sync()

        try:
            t = _timed(step, repeats=5)
        except RuntimeError:  # no kernel for this dtype on this device
            return None
        rows.append([6 * m * k * n / t, 3 / t])
        ones.append(1 - 2 * overhead / t)
    (inverse, half_over_rate), *_ = np.linalg.lstsq(np.array(rows), np.array(ones), rcond=None)
    if half_over_rate < 0:  # no fall-off to speak of: the rate alone
        inverse, half_over_rate = float(np.linalg.lstsq(np.array(rows)[:, :1], np.array(ones), rcond=None)[0][0]), 0.0
    return 1 / inverse, half_over_rate / inverse


def _loss_bandwidth(device: torch.device, sync: Callable[[], Any], overhead: float) -> float:
    """Bytes of fp32 logits per second through cross-entropy's forward and backward (log-softmax's
    exp and log per element are not a copy's cost: on a Xeon core 3.5 GB/s where a copy moves 7):
    the median over `LOSS_SHAPES` of bytes / (time less its ops' fixed cost)."""
    rates = []
    for tokens, vocab in LOSS_SHAPES.get(device.type, LOSS_SHAPES["cpu"]):
        logits = torch.randn(tokens, vocab, device=device, requires_grad=True)
        target = torch.randint(vocab, (tokens,), device=device)

        def step(logits: torch.Tensor = logits, target: torch.Tensor = target) -> None:
            logits.grad = None
            torch.nn.functional.cross_entropy(logits, target).backward()
            sync()

        t = _timed(step, repeats=5)
        rates.append(logits.numel() * 4 / max(t - LOSS_OPS * overhead, t / 10))
    return float(np.median(rates))


def measure_device(device: torch.device) -> dict[str, Any]:
    """On one rank's device: the rate and fall-off of linear layers per dtype (`_linear_fit`), the
    best square matmul's rate per dtype and a convolution's (reported), memory bandwidth, the fixed
    cost per op, the loss's rate (`_loss_bandwidth`) and the optimizer's."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    peak: dict[str, float] = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        best = 0.0
        for n in PEAK_SIZES.get(device.type, PEAK_SIZES["cpu"]):
            a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
            t = _timed(lambda a=a, b=b: (a @ b, sync()), repeats=7)
            best = max(best, 2 * n**3 / t)
        peak[str(dtype).removeprefix("torch.")] = best
    conv: dict[str, float] = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x, w = (torch.randn(*shape, device=device).to(dtype) for shape in ((8, 64, 32, 32), (64, 64, 3, 3)))
        try:
            t = _timed(lambda x=x, w=w: (torch.nn.functional.conv2d(x, w, padding=1), sync()), repeats=3)
        except RuntimeError:  # no kernel for this dtype on this device
            continue
        conv[str(dtype).removeprefix("torch.")] = 2 * 8 * 64 * 32 * 32 * 64 * 9 / t
    big = torch.empty((256 if device.type == "cuda" else 16) * 2**20, device=device)  # 1 GiB (GPUs), 64 MiB
    t = _timed(lambda: (big.clone(), sync()), repeats=7)
    bandwidth = 2 * big.numel() * 4 / t
    overhead = _chain_overhead(torch.zeros(16, device=device, requires_grad=True))
    flops, half = {}, {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        fit = _linear_fit(device, sync, dtype, overhead)
        if fit is not None:
            name = str(dtype).removeprefix("torch.")
            flops[name], half[name] = fit
    return {"matmul_flops": flops, "matmul_half_flops": half, "matmul_peak_flops": peak, "conv2d_flops": conv,
            "memory_bandwidth": bandwidth, "op_overhead_s": overhead,
            "loss_bandwidth": _loss_bandwidth(device, sync, overhead), **_optimizer(device, sync, bandwidth)}


def _optimizer(device: torch.device, sync: Callable[[], Any], bandwidth: float) -> dict[str, float]:
    """torch's AdamW as it runs here (single-tensor on CPU, foreach on GPUs): its time per tensor
    (32 tiny tensors) and bytes moved per element (one tensor of 4 Mi elements)."""
    def step_time(shapes: list[int]) -> float:
        params = [torch.zeros(n, device=device, requires_grad=True) for n in shapes]
        for p in params:
            p.grad = torch.ones_like(p)
        opt = torch.optim.AdamW(params, lr=1e-3)
        return _timed(lambda: (opt.step(), sync()), repeats=5)

    per_tensor = step_time([16] * 32) / 32
    per_element = max(0.0, step_time([2**22]) - per_tensor) / 2**22
    return {"optimizer_tensor_s": per_tensor, "optimizer_bytes": per_element * bandwidth}


def _dtensor_optimizer(device: torch.device, world: int, tensors: int = 32) -> dict[str, float]:
    """What AdamW's step costs more per parameter when the parameters are DTensors (ZeRO's FSDP2
    shards, a tensor axis's weights): 32 tiny ones sharded over every rank, against the same as
    plain tensors. DTensor dispatches each of the step's ops through its sharding propagation
    (cached for these shapes after the first step), so the cost per op differs from a graph's ops."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh(device.type, (world,))

    def per_tensor(make: Callable[[], torch.Tensor]) -> float:
        params = [torch.nn.Parameter(make()) for _ in range(tensors)]
        for p in params:
            p.grad = torch.ones_like(p)
        opt = torch.optim.AdamW(params, lr=1e-3)
        opt.step()  # DTensor's sharding propagation cached, the states made
        return _timed(opt.step, repeats=5) / tensors

    sharded = per_tensor(lambda: distribute_tensor(torch.zeros(16 * world, device=device), mesh, [Shard(0)]))
    plain = per_tensor(lambda: torch.zeros(16, device=device))
    return {"optimizer_dtensor_s": max(0.0, sharded - plain)}


# the methods whose work `calibrate` measures, each at its usual setting (`cost_models.compression.work`)
COMPRESSORS = ("fp16", "randk:0.01", f"powersgd:{MEASURED_RANK}", "topk:0.01", "dgc:0.999", "onebit", "terngrad",
               "qsgd:16", "signsgd")


def _compressors(device: torch.device, sync: Callable[[], Any], group: dist.ProcessGroup) -> dict[str, list[float]]:
    """Each compressor's own time as the runtime runs it (`Compressed.average` on a group of this
    rank alone, past its warm-up: encoding, the memory's update, decoding its own part), on weight
    matrices of 4 Ki and 64 Ki elements, less its collectives issued bare on that group (their
    cost is the link's latency, priced apart): [seconds per unit encoded, seconds per element]."""
    def bare(issued: list[tuple[str, int]]) -> None:
        for kind, nbytes in issued:
            x = torch.empty(nbytes, dtype=torch.uint8, device=device)
            if kind == "all_reduce":
                dist.all_reduce(x, group=group)
            else:
                dist.all_gather([torch.empty_like(x)], x, group=group)

    out = {}
    logging.getLogger("autopar.runtime.compression").setLevel(logging.ERROR)  # signSGD's advice, once per rank
    for text in COMPRESSORS:
        compressed = Compressed(text, group)
        compressed.step = 10**6  # past PowerSGD's dense start and the sparsifiers' warm-up
        times = []
        for rows in (64, 1024):
            grad = torch.randn(rows, 64, device=device)
            compressed.collectives.clear()
            run = _timed(lambda g=grad: (compressed.average([g], [f"w{rows}"], [True]), sync()), repeats=9)
            issued = compressed.collectives[: len(compressed.collectives) // 10]  # one call's (of 10)
            times.append(max(0.0, run - _timed(lambda i=issued: (bare(i), sync()), repeats=9)))
        per_element = max(0.0, (times[1] - times[0]) / (64 * (1024 - 64)))
        out[parse(text).method] = [max(0.0, times[0] - per_element * 64 * 64), per_element]
    return out


def _overlap(device: torch.device, nbytes: int = 2**22) -> dict[str, float]:
    """How much of an all-reduce of every rank hides behind computation running at the same time:
    1 when the two take no longer than the longer alone (GPUs: the copy engines and NCCL's own
    kernels), 0 when they add up (gloo's reduction on the cores the computation needs)."""
    flat = torch.zeros(nbytes // 4, device=device)
    a = torch.randn(256, 256, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def compute() -> None:
        for _ in range(40):
            a @ a
        sync()

    def both() -> None:
        work = dist.all_reduce(flat, async_op=True)
        compute()
        work.wait()

    alone_c = _timed(compute, repeats=3)
    alone_a = _timed(lambda: dist.all_reduce(flat), repeats=3)
    together = _timed(both, repeats=3)
    hidden = (alone_c + alone_a - together) / min(alone_c, alone_a)
    return {"compute_s": alone_c, "all_reduce_s": alone_a, "together_s": together,
            "overlap": float(min(1.0, max(0.0, hidden)))}


def runtime_overheads(device: torch.device, world: int, model: str = "gpt-tiny", steps: int = 3) -> dict[str, float]:
    """The runtime's own cost per op, measured where it is paid: a small GPT trained by
    `parallelize` on every rank, data-parallel (the model's modules, eager) and tensor-parallel
    over all of them, as it runs (the stage's lowered program: "tp") and as a stage the lowering
    leaves to the interpreter runs (DTensor op by op: "tp_interpreted"). `runtime.breakdown` separates
    the ops' time and the collectives' from the rest; the rest (less what the breakdown's own
    timing added to the step), per op the planner counts (each graph node forward, and again in
    backward), is the overhead; the tensor axis's collectives' time in place (waiting for the
    slowest rank included), lowered at two batch sizes ("tp" and "tp_large": as many collectives,
    4 times the computation between them), gives their latency there apart from the ranks' waits
    for the slowest (`jitter_fit`)."""
    out = {}
    for axis, layout, per_rank in (("dp", f"{world},1,1,1", 4), ("tp", f"1,{world},1,1", 4),
                                   ("tp_interpreted", f"1,{world},1,1", 4), ("tp_large", f"1,{world},1,1", 16)):
        torch.manual_seed(0)
        w = load_workload(model, batch=per_rank * world, device=device.type, dtype=torch.float32)
        nodes = sum(1 for n in capture(w.model, w.example_inputs) if n.op != "input")
        pm = parallelize(w.model, (1, world), w.example_inputs, loss_fn=w.loss_fn, plan=layout,
                         optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
        if axis == "tp_interpreted":
            pm.graph.program = None
        gen = torch.Generator().manual_seed(1)
        plain = time_steps(pm, lambda: w.make_batch(w.batch, gen), warmup=2, steps=steps)
        parts = []
        for _ in range(steps):
            inputs, target = w.make_batch(w.batch, gen)
            dist.barrier()
            with measuring() as mode:
                start = time.perf_counter()
                pm.step(inputs, target)
                parts.append(summarise(mode, time.perf_counter() - start))
        m = {k: statistics.median(p[k] for p in parts) for k in parts[0]}
        # what the timing itself added to the step (spread over the ops it timed) is taken out of
        # the overhead of forward and backward's
        timed = m["ops"] + m["optimizer_ops"] + m["collectives"]
        added = max(0.0, m["step_s"] - plain) * m["ops"] / timed if timed else 0.0
        per_op = max(0.0, m["overhead_s"] - added) / (2 * nodes)
        out[axis] = {**m, "untimed_step_s": plain, "per_op_s": per_op, "nodes": nodes}
    return out


def _ring(kind: str, n: int) -> tuple[float, float]:
    """(a, b) of the ring formula t = a·α + b·B·β: all-reduce 2(n−1), 2(n−1)/n; all-gather (B
    gathered) n−1, (n−1)/n (`cost_models.comm`)."""
    return (2 * (n - 1), 2 * (n - 1) / n) if kind == "all_reduce" else (n - 1, (n - 1) / n)


def fit_link(links: dict[int, dict[str, Any]], cores: int) -> tuple[float, float]:
    """α and β of the ring all-reduce over every measured group size and message size, with the
    ranks of a group sharing `cores` (a group larger than the cores takes n / cores as long, as the
    simulator's `Hosts` shares cores): least squares on relative error, so that the small messages
    of the tensor axis weigh as much as the large ones of gradient buckets."""
    rows, times = [], []
    for n, fits in links.items():
        share = max(1.0, n / cores)
        for kind, fit in fits.items():
            if kind != "all_reduce":
                continue
            a, b = _ring(kind, n)
            for nbytes, t in zip(fit["sizes"], fit["times"]):
                rows.append([a * share / t, b * nbytes * share / t])
                times.append(1.0)
    (alpha, beta), *_ = np.linalg.lstsq(np.array(rows), np.array(times), rcond=None)
    return max(float(alpha), 1e-7), max(float(beta), 1e-13)


def fit_factors(links: dict[int, dict[str, Any]], cores: int, alpha: float, beta: float) -> dict[str, float]:
    """`Link.gather_factor` / `scatter_factor`: the median, over group and message sizes, of each
    measured all-gather / reduce-scatter over the ring formula's time with the all-reduce's α and
    β (ring kernels: 1; gloo runs them as other algorithms)."""
    out = {}
    for kind, field in (("all_gather", "gather_factor"), ("reduce_scatter", "scatter_factor")):
        ratios = []
        for n, fits in links.items():
            if kind in fits:
                a, b = _ring(kind, n)
                share = max(1.0, n / cores)
                ratios += [t / ((a * alpha + b * nbytes * beta) * share) for nbytes, t in zip(fits[kind]["sizes"],
                                                                                              fits[kind]["times"])]
        if ratios:
            out[field] = float(min(1e3, max(1e-3, np.median(ratios))))
    return out


def _rank(rank: int, world: int, port: int, out: str, backend: str, cores: list[int] | None = None) -> None:
    pin(cores, rank)
    torch.set_num_threads(1)
    join_local(backend, port, rank, world)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    result: dict[str, Any] = {"device": measure_device(device) if rank == 0 else None, "links": {}}
    alone = dist.new_subgroups(group_size=1)[0]
    if rank == 0:
        sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
        result["compressors"] = _compressors(device, sync, alone)
    dist.barrier()
    result["overlap"] = _overlap(device)
    result["runtime"] = runtime_overheads(device, world)
    result["dtensor"] = _dtensor_optimizer(device, world)
    for n in range(2, world + 1):
        group = dist.new_group(list(range(n)))
        if rank >= n:
            continue
        fits = {}
        for kind in ("all_reduce", "all_gather", "reduce_scatter"):  # the last two as FSDP2 and DTensor issue them
            times = []
            for nbytes in SIZES:
                x = torch.zeros(nbytes // 4, device=device)
                if kind == "all_reduce":
                    t = _timed(lambda x=x, g=group: dist.all_reduce(x, group=g), repeats=9)
                elif kind == "all_gather":
                    whole = torch.empty(n * x.numel(), device=device)
                    t = _timed(lambda x=x, w=whole, g=group: dist.all_gather_into_tensor(w, x, group=g), repeats=9)
                else:
                    whole = torch.zeros(n * x.numel(), device=device)
                    t = _timed(lambda x=x, w=whole, g=group: dist.reduce_scatter_tensor(x, w, group=g), repeats=9)
                times.append(t)
            fits[kind] = {"sizes": SIZES if kind == "all_reduce" else [s * n for s in SIZES], "times": times}
        result["links"][n] = fits
    if rank == 0:
        torch.save(result, out)
    dist.barrier()
    dist.destroy_process_group()


def calibrate(nproc: int, progress: Callable[[str], None] | None = None, repeats: int = 3) -> dict[str, Any]:
    """Measurements of `nproc` local ranks (links from 2; one rank on a GPU measures the device
    alone), each rank on a core of its own where there are enough (`rank_cores`), in `repeats`
    starts of the ranks: each measured number the median of its starts (`median_of`), the starts
    kept under "repeats" (`term_spread`: how far the calibrated terms move between them)."""
    backend, cores = default_backend(), rank_cores(nproc)
    runs = []
    for k in range(repeats):
        with tempfile.TemporaryDirectory() as tmp, local_store() as port:
            out = os.path.join(tmp, "calibration.pt")
            if progress:
                progress(f"{nproc} ranks: matmul, convolution, memory, collectives of 2…{nproc} ranks "
                         f"(start {k + 1} of {repeats})")
            mp.spawn(_rank, args=(nproc, port, out, backend, cores), nprocs=nproc, join=True)
            runs.append(torch.load(out, weights_only=False))
    return {**median_of(runs), "repeats": runs, "pinned": cores}


def median_of(runs: list[Any]) -> Any:
    """The element-wise median of measurements of one structure (dicts, lists, numbers; anything else
    taken from the first)."""
    first = runs[0]
    if isinstance(first, dict):
        return {k: median_of([r[k] for r in runs]) for k in first}
    if isinstance(first, (list, tuple)) and all(len(r) == len(first) for r in runs):
        return type(first)(median_of([r[i] for r in runs]) for i in range(len(first)))
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        return statistics.median(runs)
    return first


def spec_terms(spec: ClusterSpec) -> dict[str, float]:
    """The calibrated terms the cost model prices with, by name."""
    dev, link = spec.device, spec.intra_host
    return {**{f"matmul {k} FLOP/s": v for k, v in dev.peak_flops.items()},
            **{f"matmul {k} half-rate FLOP": dev.half_flops_for(k) for k in dev.peak_flops},
            "memory bandwidth": dev.memory_bandwidth, "loss bytes/s": dev.loss_bandwidth,
            "per op": dev.op_overhead_s, "per op, lowered sharded": dev.lowered_op_overhead_s,
            "per op, on DTensors": dev.sharded_op_overhead_s, "optimizer per tensor (ops)": dev.optimizer_ops,
            "optimizer per DTensor, more": dev.optimizer_dtensor_s,
            "optimizer bytes per element": dev.optimizer_bytes, "link latency": link.latency,
            "jitter (√s)": dev.jitter, "link bandwidth": link.bandwidth, "overlap": link.overlap,
            "all-gather factor": link.gather_factor,
            "reduce-scatter factor": link.scatter_factor,
            **{f"{k} compressor per unit": v[0] for k, v in dev.compressor_s.items()},
            **{f"{k} compressor per element": v[1] for k, v in dev.compressor_s.items()}}


def term_spread(measured: dict[str, Any], nproc: int) -> dict[str, dict[str, float]]:
    """Per calibrated term: its value from the medians, and its spread over the starts, (max - min) /
    median of the term calibrated from each start alone: the noise floor of the calibration."""
    each = [spec_terms(cluster_spec(run, nproc)) for run in measured.get("repeats", [])]
    whole = spec_terms(cluster_spec(measured, nproc))
    out = {}
    for name, value in whole.items():
        values = [e[name] for e in each] or [value]
        mid = statistics.median(values)
        out[name] = {"value": value, "spread": (max(values) - min(values)) / mid if mid else 0.0}
    return out


def jitter_fit(runtime: dict[str, Any], nproc: int, shared: float, alpha: float, beta: float) -> tuple[float, float]:
    """(α, jitter) of the tensor axis's all-reduces in place (`runtime_overheads`): each one's time
    there less its bytes at β is its a·α (a: the ring's messages) plus the wait for the slowest
    rank after the computation since the previous one (`comm.straggler_wait`: e_n·jitter·√L, L
    the run's computation over its collectives); the runs at two batch sizes (the same
    collectives, 4 times the computation between them) separate the two. α stays at least the
    links' own (then jitter is fitted alone, least squares over both runs); with one run all the
    time in place is latency, as one number per collective."""
    tp, large = runtime["tp"], runtime.get("tp_large")
    if not tp["tp_collectives"]:
        return alpha, 0.0
    a, b = _ring("all_reduce", nproc)
    e = largest_of_normals(nproc)

    def point(run: dict[str, float]) -> tuple[float, float]:  # (seconds in place per collective, e_n·√L)
        n = run["tp_collectives"]
        spent = (run["tp_comm_s"] / shared - b * run["tp_bytes"] * beta) / n
        return spent, e * math.sqrt(max(0.0, run["forward_ops_s"] + run["backward_ops_s"]) / shared / n)

    runs = [point(tp)] + ([point(large)] if large and large["tp_collectives"] else [])
    if len(runs) < 2:
        return max(alpha, runs[0][0] / a), 0.0
    (y1, x1), (y2, x2) = runs
    jitter = (y2 - y1) / (x2 - x1) if x2 > x1 else 0.0
    latency = (y1 - jitter * x1) / a
    if latency < alpha:  # the links' own α, and the rest the waits
        latency = alpha
        jitter = sum((y - a * alpha) * x for y, x in runs) / max(sum(x * x for _, x in runs), 1e-30)
    return latency, max(0.0, jitter)


def host_cores(nproc: int) -> int:
    """Ranks of this host that can compute at once: its cores (one thread per rank), or with GPUs
    every rank."""
    return nproc if torch.cuda.is_available() else min(nproc, len(os.sched_getaffinity(0)))


def cluster_spec(measured: dict[str, Any], nproc: int, name: str = "cpu-local") -> Any:
    """The ClusterSpec of what was measured: one host of `nproc` devices."""
    dev = measured["device"]
    cores = host_cores(nproc)
    if measured["links"]:
        alpha, beta = fit_link(measured["links"], cores)
    else:  # one rank (one GPU): no collective to measure, and a plan of one device issues none; its
        # link is the device's own memory (a copy at the measured bandwidth, a kernel's floor)
        alpha, beta = dev["op_overhead_s"], 1 / dev["memory_bandwidth"]
    # in place, every rank busy: wall time is the cores' share (the simulator divides them again)
    shared = max(1.0, nproc / cores)
    dp, tp = measured["runtime"]["dp"], measured["runtime"]["tp"]
    op_overhead = max(dp["per_op_s"] / shared, dev["op_overhead_s"])  # at least a bare op's (the chain)
    lowered = max(0.0, tp["per_op_s"] / shared - op_overhead)
    # (a calibration from before the lowering measured the interpreter as "tp")
    interpreted = measured["runtime"].get("tp_interpreted", tp)
    sharded = max(0.0, interpreted["per_op_s"] / shared - op_overhead)
    alpha, jitter = jitter_fit(measured["runtime"], nproc, shared, alpha, beta)
    link = Link(bandwidth=1 / beta, latency=alpha, overlap=measured["overlap"]["overlap"],
                **fit_factors(measured["links"], cores, alpha, beta))
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(1, nproc)
    gpu = torch.cuda.is_available()
    if gpu:
        memory = torch.cuda.get_device_properties(0).total_memory
    return ClusterSpec(
        name=name, num_hosts=1, devices_per_host=nproc, cores_per_host=cores,
        device=DeviceSpec(name="cuda-gpu" if gpu else "cpu-core",
                          peak_flops=dev["matmul_flops"], memory_bytes=int(memory),
                          memory_bandwidth=dev["memory_bandwidth"], efficiency=1.0,
                          op_overhead_s=op_overhead, sharded_op_overhead_s=sharded,
                          lowered_op_overhead_s=lowered,
                          matmul_half_flops=dev["matmul_half_flops"], asynchronous=gpu,
                          loss_bandwidth=dev.get("loss_bandwidth", 0.0),
                          optimizer_ops=dev["optimizer_tensor_s"] / op_overhead if op_overhead else 0.0,
                          optimizer_dtensor_s=measured.get("dtensor", {}).get("optimizer_dtensor_s", 0.0),
                          optimizer_bytes=dev["optimizer_bytes"], jitter=jitter,
                          compressor_s=measured.get("compressors", {})),
        intra_host=link, inter_host=link,
        description=f"this machine, {nproc} ranks on {cores} cores, calibrated {time.strftime('%Y-%m-%d')}")
