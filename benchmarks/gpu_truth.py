"""One GPU against the cost model: what `autopar calibrate` measures there, and predicted against
measured step time of single-device plans, eager and compiled.

1. `calibrate` on one rank of the GPU (`autopar.calibrate`: matmul rate per dtype, how small
   matmuls fall short, the kernel-launch floor, memory bandwidth, AdamW), and matmul efficiency by
   shape: square sizes and the shapes of a GPT layer (tokens × hidden × 3·hidden, × 4·hidden, …), each
   against the best rate of its dtype.
2. For each model (zoo `gpt-small` in fp32 and bf16, `gpt-1.3b` in bf16 at a batch one GPU holds),
   the single-device plan `1,1,1` priced by the planner on the calibrated spec and on the `h100-dgx`
   preset (data-sheet peak, efficiency 0.5), then measured three ways with the same weights, batches,
   AdamW and autocast: autopar's runtime (`parallelize`, eager), the model in a plain PyTorch loop
   (eager), and that loop with `torch.compile` (autopar does not compile yet: issue 38). Each is the
   median of `--steps` timed steps after `--warmup`, synchronised; with CUDA's peak allocated bytes
   of a step beside the planner's predicted peak.

Needs CUDA (no test depends on it). Writes `--out` (JSON) and the page fragment
docs/benchmarks/results/gpu_truth.md; rows are written as they finish, so a run cut short keeps them.

    python benchmarks/gpu_truth.py [--out gpu_truth.json] [--steps 10]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import time
import traceback

import torch
from _page import table, write
from _stamp import line, stamp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from autopar.api import parallelize
from autopar.calibrate import calibrate, cluster_spec
from autopar.cost_models import get_cluster
from autopar.models import load_workload
from autopar.planner.manual import Layout, manual_plan, manual_search
from autopar.planner.search import Search

# (zoo model, global batch, precision): the CPU-sized model is host-bound on a GPU, the 1.3b one is not
RUNS = [("gpt-small", 16, "fp32"), ("gpt-small", 16, "bf16"), ("gpt-1.3b", 8, "bf16")]


def matmul_shapes() -> list[tuple[int, int, int]]:
    """(m, k, n): squares, then a GPT-1.3b layer's matmuls at 8 × 1024 tokens (QKV, out, fc1, fc2)
    and gpt-small's at 16 × 128."""
    squares = [(n, n, n) for n in (256, 512, 1024, 2048, 4096, 8192)]
    gpt = [(t, h, o) for t, h in ((8192, 2048), (2048, 256)) for o in (3 * h, h, 4 * h)]
    return squares + gpt + [(8192, 8192, 2048), (2048, 1024, 256)]


DEVICE = "cuda"  # `--device cpu`: the script's own smoke test, on small shapes


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _time(fn, repeats: int) -> float:
    """Median seconds of `fn`, each call synchronised (CUDA events would hide the host's part)."""
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_table(shapes: list[tuple[int, int, int]]) -> list[dict]:
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for m, k, n in shapes:
            a, b = torch.randn(m, k, device=DEVICE, dtype=dtype), torch.randn(k, n, device=DEVICE, dtype=dtype)
            t = _time(lambda a=a, b=b: a @ b, repeats=10)
            rows.append({"dtype": str(dtype).removeprefix("torch."), "m": m, "k": k, "n": n, "s": t,
                         "flops": 2 * m * k * n / t})
    return rows


def _batches(w, n: int):
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        inputs, target = w.make_batch(w.batch, gen)
        out.append((tuple(x.to(DEVICE) for x in inputs), target.to(DEVICE)))
    return out


def plain_step(model, loss_fn, precision: str, compiled: bool):
    """What a person writes: forward under autocast, loss, backward, AdamW."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fwd = torch.compile(model) if compiled else model
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)

    def step(inputs, target) -> float:
        with torch.autocast(DEVICE, dtype=half, enabled=half is not None):
            loss = loss_fn(fwd(*inputs), target)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())
    return step


def timed(step, batches, warmup: int) -> tuple[float, int, list[float]]:
    """Median step seconds after `warmup`, the peak allocated bytes of the last step, the losses."""
    times, losses = [], []
    cuda = DEVICE == "cuda"
    for i, (inputs, target) in enumerate(batches):
        if i == len(batches) - 1 and cuda:
            torch.cuda.reset_peak_memory_stats()
        sync()
        start = time.perf_counter()
        losses.append(step(inputs, target))  # float(loss): the host waits for the step
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times), torch.cuda.max_memory_allocated() if cuda else 0, losses


def plan_for(w, cluster, precision: str):
    cluster = dataclasses.replace(cluster, num_hosts=1, devices_per_host=1)
    search = Search.start(w, cluster, (1, 1), precision=None if precision == "fp32" else precision)
    return manual_plan(manual_search(search), Layout(1, 1, 1, 1, False))


def run_model(model: str, batch: int, precision: str, spec, preset, warmup: int, steps: int) -> dict:
    row: dict = {"model": model, "batch": batch, "precision": precision}
    w = load_workload(model, batch=batch, device="meta", dtype=torch.float32)  # fp32 weights, as trained
    batches = _batches(w, warmup + steps)
    calibrated, sheet = plan_for(w, spec, precision), plan_for(w, preset, precision)
    row |= {"predicted_s": calibrated.estimate.step_time_s, "predicted_preset_s": sheet.estimate.step_time_s,
            "predicted_peak_bytes": calibrated.estimate.peak_memory_bytes}
    for how in ("autopar", "eager", "compiled"):
        w = pm = step = None
        gc.collect()
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
        try:
            torch.manual_seed(0)  # a fresh model, the same weights every way
            w = load_workload(model, batch=batch, device=DEVICE, dtype=torch.float32)
            begin = time.perf_counter()
            if how == "autopar":
                pm = parallelize(w.model, (1, 1), w.example_inputs, loss_fn=w.loss_fn, plan=calibrated,
                                 optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), mixed_precision=precision)
                step = pm.step
            else:
                step = plain_step(w.model, w.loss_fn, precision, how == "compiled")
            t, peak, losses = timed(step, batches, warmup)
            row[how] = {"step_s": t, "peak_bytes": peak, "losses": losses,
                        "first_steps_s": time.perf_counter() - begin - t * steps}
        except Exception as exc:  # a failure is a result: recorded, the next way still runs
            row[how] = {"error": f"{type(exc).__name__}: {str(exc)[:500]}"}
            traceback.print_exc()
    return row


def page(started: dict, measured: dict, matmuls: list[dict], rows: list[dict], gpu: str) -> str:
    dev = measured["device"]
    best = {d: max(r["flops"] for r in matmuls if r["dtype"] == d) for d in {r["dtype"] for r in matmuls}}
    head = (f"**{gpu}**. `calibrate` on one rank: matmul "
            + ", ".join(f"{k} {v / 1e12:.1f} TFLOP/s" for k, v in dev["matmul_flops"].items())
            + f"; an fp32 matmul reaches half of that at {dev['matmul_half_flops'] / 1e9:.2f} GFLOP; "
            f"memory {dev['memory_bandwidth'] / 1e12:.2f} TB/s (a copy, bytes read and written); "
            f"an op forward and backward {dev['op_overhead_s'] * 1e6:.1f} µs (the launch floor); "
            f"AdamW {dev['optimizer_tensor_s'] * 1e6:.1f} µs per tensor.\n\n")
    mm = table(["dtype", "m × k × n", "time", "TFLOP/s", "of the best"],
               [[r["dtype"], f"{r['m']} × {r['k']} × {r['n']}", f"{r['s'] * 1e6:.1f} µs", f"{r['flops'] / 1e12:.1f}",
                 f"{r['flops'] / best[r['dtype']]:.0%}"] for r in matmuls], right=(2, 3, 4))

    def cell(r: dict, how: str) -> str:
        m = r.get(how, {})
        return m["error"][:60] if "error" in m else f"{m['step_s'] * 1e3:.1f} ms" if m else "not run"

    def ratio(r: dict, how: str) -> str:
        m = r.get(how, {})
        return f"{m['step_s'] / r['predicted_s']:.2f}" if "step_s" in m else "–"

    steps = table(["model", "predicted (calibrated)", "predicted (h100-dgx sheet)", "autopar (eager)",
                   "measured / predicted", "plain loop (eager)", "torch.compile", "peak predicted / measured"],
                  [[f"{r['model']} {r['precision']}, batch {r['batch']}", f"{r['predicted_s'] * 1e3:.1f} ms",
                    f"{r['predicted_preset_s'] * 1e3:.1f} ms", cell(r, "autopar"), ratio(r, "autopar"),
                    cell(r, "eager"), cell(r, "compiled"),
                    f"{r['predicted_peak_bytes'] / 2**30:.2f} / " + (f"{r['autopar']['peak_bytes'] / 2**30:.2f} GiB"
                                                                    if "peak_bytes" in r.get("autopar", {}) else "–")]
                   for r in rows], right=tuple(range(1, 8)))
    return head + "Step time of single-device plans:\n\n" + steps + "\nMatmul efficiency by shape:\n\n" + mm


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="gpu_truth.json")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--only", help="comma-separated zoo models of RUNS to run (default all)")
    ap.add_argument("--from-json", metavar="FILE", help="re-make the page from a recorded run's JSON (no GPU needed)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cpu: a smoke test of this script on small matmuls (writes no page)")
    args = ap.parse_args(argv)
    if args.from_json:  # the page of a run made elsewhere, with that run's stamp
        with open(args.from_json) as f:
            rec = json.load(f)
        write("gpu_truth", rec["stamp"], page(rec["stamp"], rec["calibration"], rec["matmuls"], rec["runs"], rec["gpu"]),
              command=f"python benchmarks/gpu_truth.py` on the GPU, re-made from its JSON by `--from-json {args.from_json}")
        return 0
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("gpu_truth needs CUDA: no GPU here", file=sys.stderr)
        return 2
    started, gpu = stamp(), torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU (smoke test)"
    print(f"{gpu}; {line(started)}", file=sys.stderr, flush=True)
    result: dict = {"stamp": started, "gpu": gpu}

    def save() -> None:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, default=str)

    begin = time.perf_counter()
    result["calibration"] = measured = calibrate(1, lambda s: print(s, file=sys.stderr, flush=True))
    spec = cluster_spec(measured, 1, name="gpu-local")
    result["cluster"] = spec.to_dict()
    print(f"calibrated in {time.perf_counter() - begin:.0f} s", file=sys.stderr, flush=True)
    save()
    result["matmuls"] = matmuls = matmul_table(matmul_shapes() if DEVICE == "cuda" else [(64, 64, 64), (128, 64, 32)])
    save()
    preset, rows = get_cluster("h100-dgx"), []
    only = set(args.only.split(",")) if args.only else None
    for model, batch, precision in RUNS:
        if only and model not in only:
            continue
        begin = time.perf_counter()
        rows.append(run_model(model, batch, precision, spec, preset, args.warmup, args.steps))
        result["runs"] = rows
        save()
        print(json.dumps({k: v for k, v in rows[-1].items()}, default=str)[:1500], file=sys.stderr)
        print(f"{model} {precision}: {time.perf_counter() - begin:.0f} s", file=sys.stderr, flush=True)
    body = page(started, measured, matmuls, rows, gpu)
    print(body)
    if DEVICE == "cuda":
        write("gpu_truth", started, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
