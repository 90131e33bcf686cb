"""autopar: an Alpa-style auto-parallelization planner and compiler for PyTorch."""

from autopar.api import parallelize
from autopar.capture import capture, first_tensor
from autopar.errors import AutoparError, CaptureError, ClusterSpecError, ModelSpecError
from autopar.graph import Layer, OpGraph, OpNode, TensorInfo
from autopar.models import Workload, load_workload

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
