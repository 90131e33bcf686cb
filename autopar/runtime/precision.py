"""Mixed-precision training the way the plan priced it (`autopar.planner.precision`): torch's AMP.

Parameters, gradients and optimizer state stay fp32 (the parameters are the master copy the
optimizer steps); the forward and the loss run under `torch.autocast`, which computes in 16 bits
what its op lists allow. Gradients therefore arrive, and are averaged, in fp32. ZeRO-3 stages
gather their parameters in 16 bits and reduce-scatter gradients in fp32 (FSDP2's
`MixedPrecisionPolicy`). fp16 scales the loss (dynamic loss scaling) with one scale for the whole
job: `ShardedGradScaler` over every rank agrees whether any rank's gradients overflowed, so all
ranks skip the same steps; bf16 has fp32's range and needs no scaling.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from autopar.contract.precision import PRECISIONS


@dataclass
class MixedPrecision:
    """The run's precision: `autocast()` around forward and loss, `scale` the loss before backward,
    `unscale` before reading gradients (clipping), `step` instead of `optimizer.step()`."""

    name: str | None
    device_type: str
    scaler: Any = None  # ShardedGradScaler for fp16

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.name is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=PRECISIONS[self.name])

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler is not None else loss

    @property
    def loss_scale(self) -> float:
        return float(self.scaler.get_scale()) if self.scaler is not None else 1.0

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """The true gradients (before clipping reads them); `step` unscales if nobody did."""
        if self.scaler is not None:
            with _quiet():
                self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Step unless fp16 gradients overflowed on some rank (then every rank skips it and the
        scale halves)."""
        if self.scaler is None:
            optimizer.step()
            return
        with _quiet():
            self.scaler.step(optimizer)
        self.scaler.update()

    def autocasting(self, forward: Callable) -> Callable:
        """`forward` under autocast (the model's own dtype: `forward` itself)."""
        if self.name is None:
            return forward

        def run(*args: Any, **kwargs: Any) -> Any:
            with self.autocast():
                return forward(*args, **kwargs)

        return run


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """DTensor gradients: the scaler's found-inf flag is replicated implicitly, as meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Found a non-scalar tensor")
        yield


def mixed_precision(name: str | None, device: torch.device) -> MixedPrecision:
    scaler = None
    if name == "fp16":
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        scaler = ShardedGradScaler(device.type, process_group=dist.group.WORLD)
        scaler.scale(torch.zeros((), device=device))  # the scale exists on stages that never see the loss
    return MixedPrecision(name, device.type, scaler)


def fsdp_policy(name: str | None, cast_inputs: bool = True) -> dict[str, Any]:
    """`fully_shard` keyword arguments: 16-bit gathered parameters, fp32 gradient reduction."""
    if name is None:
        return {}
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return {"mp_policy": MixedPrecisionPolicy(param_dtype=PRECISIONS[name], reduce_dtype=torch.float32,
                                              cast_forward_inputs=cast_inputs)}
