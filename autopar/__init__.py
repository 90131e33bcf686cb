"""autopar: an Alpa-style auto-parallelization planner and compiler for PyTorch."""

from autopar.api import parallelize
from autopar.contract.errors import AutoparError, CaptureError, ClusterSpecError, ModelSpecError
from autopar.models import Workload, load_workload
from autopar.planner.capture import capture, first_tensor
from autopar.planner.graph import Layer, OpGraph, OpNode, TensorInfo

__all__ = [
    "AutoparError",
    "CaptureError",
    "ClusterSpecError",
    "Layer",
    "ModelSpecError",
    "OpGraph",
    "OpNode",
    "TensorInfo",
    "Workload",
    "capture",
    "first_tensor",
    "load_workload",
    "parallelize",
]
