"""What `autopar inspect` reports: per-layer and total FLOPs, parameters and activations."""

from __future__ import annotations

import time
from typing import Any

from autopar.capture import capture
from autopar.models import Workload


def inspect_workload(workload: Workload) -> dict[str, Any]:
    """Capture the workload and summarise its graph (the JSON of `autopar inspect`)."""
    start = time.perf_counter()
    graph = capture(workload.model, workload.example_inputs)
    elapsed = time.perf_counter() - start
    dtypes = sorted({t.dtype for t in graph.params.values()})
    return {
        "model": workload.name,
        "batch": workload.batch,
        "dtype": dtypes[0] if len(dtypes) == 1 else dtypes,
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
