"""`autopar plan`: capture a model and plan it on a cluster (for now one stage: the intra-op pass)."""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any, Callable

from autopar.capture import capture
from autopar.errors import AutoparError
from autopar.intra_op import StageSharding, best_sharding
from autopar.ilp import InfeasibleError
from autopar.models import Workload
from cost_models import ClusterSpec


def parse_mesh(text: str) -> tuple[int, int]:
    """'HxD' -> (hosts, devices per host)."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise AutoparError(f"malformed mesh {text!r}: write HOSTSxDEVICES, e.g. --mesh 1x8 or --mesh 8x8")
    return int(parts[0]), int(parts[1])


def plan_single_stage(
    workload: Workload,
    cluster: ClusterSpec,
    mesh: tuple[int, int],
    *,
    memory_limit: float | None = None,
    time_limit_s: float = 30.0,
    progress: Callable[[tuple[int, int]], None] | None = None,
) -> dict[str, Any]:
    """Solve every logical mesh of `mesh` and return the plan (JSON-ready) of the fastest that fits."""
    start = time.perf_counter()
    cluster = cluster.with_mesh(*mesh)
    graph = capture(workload.model, workload.example_inputs)
    capture_s = time.perf_counter() - start
    try:
        best, results, rejected = best_sharding(graph, cluster, mesh, memory_limit, time_limit_s, progress)
    except InfeasibleError as exc:
        raise InfeasibleError(f"{workload.name} (batch {workload.batch}) {exc}", exc.least_memory) from None
    stage = {"layers": [0, len(graph.layers())], "submesh": list(mesh), **_stage_json(best)}
    return {
        "model": workload.name,
        "batch": workload.batch,
        "cluster": cluster.name,
        "mesh": list(mesh),
        "graph_hash": graph.fingerprint(),
        "stages": [stage],
        "num_microbatches": 1,
        "estimate": {"step_time_s": best.time, "peak_memory_bytes": best.memory["total"]},
        "candidates": [{"logical_mesh": list(r.logical_mesh), "step_time_s": r.time,
                        "peak_memory_bytes": r.memory["total"], "solver_status": r.solver["status"],
                        "solve_time_s": r.solver["time_s"]}
                       for r in results]
                      + [{"logical_mesh": list(logical), "rejected": why} for logical, why in rejected.items()],
        "capture_time_s": round(capture_s, 3),
        "planning_time_s": round(time.perf_counter() - start, 3),
    }


def _stage_json(s: StageSharding) -> dict[str, Any]:
    data = asdict(s)
    data["logical_mesh"] = list(s.logical_mesh)
    return data
