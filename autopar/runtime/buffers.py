"""The model's persistent buffers (BatchNorm's running statistics) under any plan.

Checkpoints save the buffers each rank's part of the model holds, by the model's names, beside
the parameters. Data-parallel replicas normalise with their own samples' statistics, as DDP
without SyncBatchNorm and gradient accumulation do (torch's SyncBatchNorm runs on GPUs only);
the running statistics each step updated are then averaged over the data axis, so the replicas
keep one value: the running mean equals one process's on the global batch (the mean of equal
slices' means), the running variance leaves out the spread between the slices' means.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


def persistent(model: nn.Module, names: set[str] | None = None) -> dict[str, torch.Tensor]:
    """The buffers a state dict holds (running statistics; not rotary caches), by the model's
    names; only those in `names` when given (a pipeline stage's)."""
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    buffers = dict(model.named_buffers(remove_duplicate=False))
    return {n: buffers[n] for n in model.state_dict(keep_vars=True)
            if n not in params and n in buffers and (names is None or n in names)}


class AveragedBuffers:
    """Averages over `group` what a step changed in the floating-point buffers: each replica's
    change from the step's (common) start, so a buffer no replica wrote stays bit for bit (BatchNorm
    writes its statistics in place without moving the version counter, so changes are not seen)."""

    def __init__(self, buffers: dict[str, torch.Tensor], group: dist.ProcessGroup) -> None:
        self.buffers = [b for b in buffers.values() if b.is_floating_point()]
        self.group = group
        self.start: list[torch.Tensor] = []

    def before_step(self) -> None:
        self.start = [b.detach().clone() for b in self.buffers]

    def after_step(self) -> None:
        for dtype in sorted({b.dtype for b in self.buffers}, key=str):  # one all-reduce per dtype, in one order
            pairs = [(b, s) for b, s in zip(self.buffers, self.start) if b.dtype == dtype]
            change = _flatten_dense_tensors([b.detach() - s for b, s in pairs])
            dist.all_reduce(change, group=self.group)
            change /= dist.get_world_size(self.group)
            with torch.no_grad():
                for (b, s), mean in zip(pairs, _unflatten_dense_tensors(change, [s for _, s in pairs])):
                    b.copy_(s + mean)
