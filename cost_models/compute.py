"""Roofline compute time: an op is bound by its FLOPs or by the bytes it moves."""

from __future__ import annotations

from cost_models.cluster import DeviceSpec


def compute_time(flops: float, bytes_moved: float, device: DeviceSpec, dtype: str = "float32") -> float:
    """`max(flops / (peak × efficiency), bytes / memory bandwidth)`."""
    return max(flops / (device.flops_for(dtype) * device.efficiency), bytes_moved / device.memory_bandwidth)
