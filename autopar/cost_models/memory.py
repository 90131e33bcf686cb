"""Memory per device during training: model states under sharding, and activations in flight.

Model states per parameter: the parameter and its gradient in the training dtype, the optimizer's
fp32 state (Adam: two moments), and an fp32 master copy when training in 16-bit (mixed
precision). Adam: 16 bytes per parameter for fp16/bf16 (2 + 2 + 8 + 4), 16 for fp32 (4 + 4 + 8). Tensor parallelism divides all of it by
the tensor-parallel share; ZeRO stage k over the data axis divides optimizer state (k ≥ 1),
gradients (k ≥ 2) and parameters (k = 3).
"""

from __future__ import annotations

from dataclasses import dataclass

OPTIMIZER_STATE_BYTES = {"adam": 8, "adamw": 8, "sgd-momentum": 4, "sgd": 0}  # fp32 bytes per parameter


@dataclass(frozen=True)
class MemoryBreakdown:
    params: float
    grads: float
    optimizer: float
    activations: float = 0.0

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations


def model_state_memory(
    num_params: float,
    dtype_bytes: int,
    *,
    optimizer: str = "adam",
    shard: int = 1,
    zero_stage: int = 0,
    dp: int = 1,
) -> MemoryBreakdown:
    """Bytes per device for `num_params` parameters, split `shard` ways by tensor parallelism."""
    if optimizer not in OPTIMIZER_STATE_BYTES:
        raise ValueError(f"unknown optimizer {optimizer!r}: one of {', '.join(OPTIMIZER_STATE_BYTES)}")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0-3, got {zero_stage}")
    local = num_params / shard
    master = 4 if dtype_bytes < 4 else 0  # mixed precision steps an fp32 copy, whatever the optimizer
    return MemoryBreakdown(
        params=local * dtype_bytes / (dp if zero_stage >= 3 else 1),
        grads=local * dtype_bytes / (dp if zero_stage >= 2 else 1),
        optimizer=local * (OPTIMIZER_STATE_BYTES[optimizer] + master) / (dp if zero_stage >= 1 else 1),
    )


def training_memory(
    states: MemoryBreakdown, activation_bytes_per_microbatch: float, in_flight: int
) -> MemoryBreakdown:
    return MemoryBreakdown(states.params, states.grads, states.optimizer, activation_bytes_per_microbatch * in_flight)


def fits(memory: MemoryBreakdown, device_memory: float, reserve_fraction: float = 0.1) -> bool:
    """Whether `memory` fits in a device, keeping `reserve_fraction` for the allocator and workspaces."""
    return memory.total <= device_memory * (1 - reserve_fraction)
