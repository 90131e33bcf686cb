"""Compute time of an op: a roofline (bound by its FLOPs or by the bytes it moves), and a fixed
part that does not shrink with the op's size: the host's cost of issuing it, and what a small
matmul falls short of the peak."""

from __future__ import annotations

import numpy as np

from autopar.cost_models.cluster import DeviceSpec

LOSS_PASSES, LOSS_OPS = 5, 6  # cross-entropy's passes over its input's size, and its ops (forward and backward)


def fixed_time(device: DeviceSpec, dtype: str = "float32", ops: int = 0, matmuls: int = 0,
               sharded: bool = False) -> float:
    """`ops` dispatches of host time (more in a sharded stage: `sharded`, at its lowered program's
    cost), and `matmuls` matmuls' shortfall: a matmul of f FLOPs reaches `f / (f + f½)` of the
    peak, i.e. takes `f½ / peak` longer."""
    host = ops * (device.op_overhead_s + (device.lowered_op_overhead_s if sharded else 0.0))
    return host + matmuls * device.half_flops_for(dtype) / (device.flops_for(dtype) * device.efficiency)


def compute_time(flops: float, bytes_moved: float, device: DeviceSpec, dtype: str = "float32", ops: int = 0,
                 matmuls: int = 0, sharded: bool = False) -> float:
    """`max(flops / (peak × efficiency), bytes / memory bandwidth)` plus `fixed_time`, or on an
    asynchronous device (a GPU, whose host issues kernels ahead) at least `fixed_time`."""
    roofline = max(flops / (device.flops_for(dtype) * device.efficiency), bytes_moved / device.memory_bandwidth)
    fixed = fixed_time(device, dtype, ops, matmuls, sharded)
    return max(roofline, fixed) if device.asynchronous else roofline + fixed


def optimizer_time(elements: float, tensors: float, device: DeviceSpec, dtensors: float = 0.0) -> float:
    """An Adam step over `elements` fp32 parameters in `tensors` tensors (`dtensors` of them
    DTensors, each op on them at DTensor's cost): the bytes it moves (`device.optimizer_bytes`
    per element: fused, it reads parameter, gradient and both moments and writes three) and
    `device.optimizer_ops` dispatches per tensor (torch's single-tensor loop on CPU; 0 when fused),
    and per DTensor what DTensor adds (`device.optimizer_dtensor_s`, measured, or its ops at DTensor's
    per-op cost)."""
    per_dtensor = device.optimizer_dtensor_s or device.optimizer_ops * device.sharded_op_overhead_s
    return (elements * device.optimizer_bytes / device.memory_bandwidth
            + device.optimizer_ops * tensors * device.op_overhead_s + dtensors * per_dtensor)


def loss_time(loss_bytes: float | np.ndarray, device: DeviceSpec) -> float | np.ndarray:
    """The loss on one microbatch's output (its fp32 bytes on this rank, 0 off the last stage),
    forward and backward: at the device's calibrated `loss_bandwidth`, or as cross-entropy's passes
    over logits-sized tensors (log-softmax read and written, the gradient's softmax read and
    written, the incoming logits read) at its memory bandwidth; and its few ops.
    The captured graph ends at the model's output: the planner prices the loss with this alone."""
    rate = device.loss_bandwidth or device.memory_bandwidth / LOSS_PASSES
    return loss_bytes / rate \
        + np.where(np.asarray(loss_bytes) > 0, fixed_time(device, ops=LOSS_OPS), 0.0)
