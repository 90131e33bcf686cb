"""autopar: an Alpa-style auto-parallelization planner and compiler for PyTorch.

The names below load on first use (PEP 562), so that `import autopar.contract` or
`import autopar.cost_models` does not import torch and the whole runtime with them.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "parallelize": "autopar.api",
    "capture": "autopar.planner.capture",
    "first_tensor": "autopar.contract.export",
    "AutoparError": "autopar.contract.errors",
    "CaptureError": "autopar.contract.errors",
    "ClusterSpecError": "autopar.contract.errors",
    "ModelSpecError": "autopar.contract.errors",
    "Plan": "autopar.contract.plan",
    "Layer": "autopar.planner.graph",
    "OpGraph": "autopar.planner.graph",
    "OpNode": "autopar.planner.graph",
    "TensorInfo": "autopar.planner.graph",
    "Workload": "autopar.contract.workload",
    "load_workload": "autopar.models",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'autopar' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__() -> list[str]:
    return __all__
