"""Bytes a rank hands to the tensor axis's collectives: DTensor issues them itself (functional
collectives inside redistributions, forward and backward), so they are counted where they are
dispatched rather than predicted."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

_NAMESPACES = {"_c10d_functional", "c10d_functional", "_c10d_functional_autograd"}
_COLLECTIVES = {"all_reduce", "all_reduce_", "all_reduce_coalesced", "all_gather_into_tensor", "all_gather_into_tensor_coalesced",
                "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced", "all_to_all_single", "broadcast"}


def nbytes_of(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(nbytes_of(v) for v in value)
    return 0


class CollectiveBytes(TorchDispatchMode):
    """Within the block, `nbytes` grows by the input of every functional collective issued."""

    supports_higher_order_operators = True  # `cond` and others pass through (they run replicated)

    def __init__(self) -> None:
        super().__init__()
        self.nbytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **(kwargs or {}))
        if any(t is DTensor for t in types):
            return NotImplemented  # let DTensor lower to plain ops first; they come back through here
        packet = getattr(func, "_overloadpacket", None)
        if packet is not None and getattr(func, "namespace", None) in _NAMESPACES and packet.__name__ in _COLLECTIVES:
            self.nbytes += nbytes_of(args[0] if args else None)
        return func(*args, **(kwargs or {}))
