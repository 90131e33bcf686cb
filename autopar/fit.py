"""`autopar calibrate --from BENCH.json`: the cluster file's parameters adjusted to measured step
times, with the error on layouts the fit did not see.

Each hand-written layout of the bench is planned again on the calibrated cluster (the shardings
each solve chooses recorded), then priced again, those shardings held, on clusters with one
parameter doubled: FLOP rate, memory bandwidth, a plain op's fixed cost, a sharded op's (on DTensors
and in a lowered stage alike),
link latency, link bandwidth. A stage's times are sums of terms each proportional to one of
them, so the six differences give every stage's times for any scaling (exactly, up to the
roofline's max and the overlap's clipping), and the simulator turns them into step times. The
scalings (bounded to 1/5 … 5) are fitted by least squares on log step time to half of the
layouts (every other one by measured time); the other half is predicted. No layout has a factor
of its own.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable
from typing import Any

import numpy as np

from autopar.bench import candidate_plans
from autopar.contract.errors import AutoparError
from autopar.contract.plan import Plan
from autopar.cost_models.simulator import StageTimes, simulate
from autopar.planner.search import hosts

PARAMS = ("flops", "memory", "op_overhead", "sharded_overhead", "latency", "bandwidth")
FIELDS = ("forward_s", "backward_s", "send_s", "grad_sync_s", "optimizer_s", "weight_s")
BOUND = 5.0


def scaled(cluster: Any, factors: dict[str, float]) -> Any:
    """The cluster with each parameter's time multiplied by its factor (rates divided by it)."""
    f = {k: factors.get(k, 1.0) for k in PARAMS}
    dev = cluster.device
    device = dataclasses.replace(
        dev, peak_flops={k: v / f["flops"] for k, v in dev.peak_flops.items()},
        memory_bandwidth=dev.memory_bandwidth / f["memory"], loss_bandwidth=dev.loss_bandwidth / f["memory"],
        op_overhead_s=dev.op_overhead_s * f["op_overhead"],
        sharded_op_overhead_s=dev.sharded_op_overhead_s * f["sharded_overhead"],
        optimizer_dtensor_s=dev.optimizer_dtensor_s * f["sharded_overhead"],
        lowered_op_overhead_s=dev.lowered_op_overhead_s * f["sharded_overhead"])

    def link(x: Any) -> Any:
        return dataclasses.replace(x, latency=x.latency * f["latency"], bandwidth=x.bandwidth / f["bandwidth"])

    return dataclasses.replace(cluster, device=device, intra_host=link(cluster.intra_host),
                               inter_host=link(cluster.inter_host))


def _fields(plan: Plan) -> np.ndarray:
    return np.array([[s.cost.get(k, 0.0) for k in FIELDS] for s in plan.stages])


def fit(bench: dict[str, Any], cluster: Any, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The fitted scalings, the cluster they give, and the median |error| of the predicted step
    time before and after, on the layouts fitted and on the others."""
    from scipy.optimize import least_squares


    model, nproc = bench["model"], bench["nproc"]
    cluster = cluster.with_ranks(nproc)
    measured = {r["name"]: r["measured_step_time_s"] for r in bench["layouts"] if r["name"] != "auto"}
    choices: dict = {}
    if progress:
        progress(f"planning {model}'s layouts on the calibrated cluster")
    batch, precision = bench.get("batch"), bench.get("precision")
    base = {p.name: p for p in candidate_plans(model, nproc, cluster, batch, precision, choices=choices)}
    names = sorted((n for n in measured if n in base), key=measured.get)
    if len(names) < 4:
        raise AutoparError(f"{len(names)} of the bench's layouts are hand-written ones planned here: a fit needs 4 "
                           "(run `autopar bench` on this model and mesh again)")
    f0 = {n: _fields(base[n]) for n in names}
    slopes = {}
    for k in PARAMS:
        if progress:
            progress(f"pricing the same shardings with {k} doubled")
        plans = {p.name: p for p in candidate_plans(model, nproc, scaled(cluster, {k: 2.0}), batch, precision,
                                                    choices=choices, pin=True)}
        slopes[k] = {n: _fields(plans[n]) - f0[n] for n in names}

    def predict(factors: np.ndarray, name: str) -> float:
        fields = f0[name] + sum(slopes[k][name] * (x - 1.0) for k, x in zip(PARAMS, factors))
        stages = [StageTimes(*np.maximum(row[:4], 0.0), optimizer_s=max(row[4], 0.0),
                             weight_s=min(max(row[5], 0.0), max(row[1], 0.0))) for row in fields]
        plan = base[name]
        return simulate(stages, plan.num_microbatches, plan.schedule, hosts(cluster, plan.group_devices),
                        plan.virtual).step_time_s

    seen, unseen = names[0::2], names[1::2]

    def residuals(logs: np.ndarray) -> np.ndarray:
        factors = np.exp(logs)
        return np.array([np.log(predict(factors, n) / measured[n]) for n in seen])

    if progress:
        progress(f"fitting {len(PARAMS)} parameters to {len(seen)} layouts")
    solution = least_squares(residuals, np.zeros(len(PARAMS)), bounds=(-np.log(BOUND), np.log(BOUND)))
    factors = np.exp(solution.x)

    def error(which: list[str], at: np.ndarray) -> float:
        return statistics.median(abs(predict(at, n) - measured[n]) / measured[n] for n in which)

    ones = np.ones(len(PARAMS))
    return {"factors": dict(zip(PARAMS, factors.tolist())), "cluster": scaled(cluster, dict(zip(PARAMS, factors))),
            "fitted_on": seen, "held_out": unseen,
            "error_before": {"fitted": error(seen, ones), "held_out": error(unseen, ones)},
            "error_after": {"fitted": error(seen, factors), "held_out": error(unseen, factors)},
            "layouts": [{"name": n, "measured_step_time_s": measured[n], "calibrated_s": predict(ones, n),
                         "fitted_s": predict(factors, n), "held_out": n in unseen} for n in names]}
