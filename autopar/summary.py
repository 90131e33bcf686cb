"""What `autopar inspect` reports: per-layer and total FLOPs, parameters and activations."""

from __future__ import annotations

import time
from typing import Any

from autopar.contract.workload import Workload
from autopar.planner.capture import capture


def inspect_workload(workload: Workload) -> dict[str, Any]:
    """Capture the workload and summarise its graph (the JSON of `autopar inspect`)."""
    start = time.perf_counter()
    graph = capture(workload.model, workload.example_inputs)
    elapsed = time.perf_counter() - start
    by_dtype: dict[str, int] = {}
    for t in graph.params.values():
        by_dtype[t.dtype] = by_dtype.get(t.dtype, 0) + t.nbytes
    return {
        "model": workload.name,
        "batch": workload.batch,
        "dtype": max(by_dtype, key=by_dtype.get) if by_dtype else None,  # of most parameter bytes
        "num_nodes": len(graph),
        "num_params": graph.num_params,
        "param_bytes": graph.param_bytes,
        "flops_forward": graph.flops_fwd,
        "flops_backward": graph.flops_bwd,
        "graph_hash": graph.fingerprint(),
        "layers": [
            {
                "index": layer.index,
                "name": layer.name,
                "num_ops": len(layer.nodes),
                "flops_forward": layer.flops_fwd,
                "flops_backward": layer.flops_bwd,
                "param_bytes": layer.param_bytes,
                "activation_bytes": layer.activation_bytes,
            }
            for layer in graph.layers()
        ],
        "warnings": graph.warnings,
        "capture_time_s": round(elapsed, 3),
    }
