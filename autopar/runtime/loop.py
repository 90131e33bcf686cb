"""What a training loop needs besides the step, on any layout: the global gradient norm and
clipping by it, and evaluation that leaves training as it was.

No rank holds the whole gradient under a tensor or pipeline axis or ZeRO-3: each stage adds up
the squares of its gradients as DTensor reduces them over its meshes (torch's `get_total_norm`,
as torchtitan clips), and the stages' sums are added over the job. Weights several stages hold
count once.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


def squared_grad_norm(params: Iterable[nn.Parameter]) -> torch.Tensor:
    """Sum of the squares of the gradients' entries, whole over every mesh they are split on
    (float64, on the gradients' device)."""
    by_mesh: dict[object, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p.grad)
    total = None
    for grads in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        total = norm.double() ** 2 if total is None else total + norm.double() ** 2
    return total if total is not None else torch.zeros((), dtype=torch.float64)


def clip(params: list[nn.Parameter], squared: torch.Tensor, ranks_alike: int, max_norm: float | None,
         device: torch.device) -> float:
    """The global norm from this rank's stage's `squared` sum (every one of the `ranks_alike` ranks
    holding the same stage adds its share; one-stage plans: no collective), and the gradients
    scaled by `max_norm / norm` when that is below 1 (the coefficient of torch's
    `clip_grad_norm_`). Returns the norm before clipping."""
    total = squared.to(device)
    if ranks_alike != dist.get_world_size():
        total = total / ranks_alike
        dist.all_reduce(total)
    norm = float(total.sqrt())
    if max_norm is not None:
        coefficient = max_norm / (norm + 1e-6)
        if coefficient < 1.0:
            with torch.no_grad():
                for p in params:
                    if p.grad is not None:
                        p.grad.mul_(coefficient)
    return norm


@contextlib.contextmanager
def evaluating(buffers: dict[str, torch.Tensor], device: torch.device) -> Iterator[None]:
    """No gradients, and the buffers (running statistics) and random states as they were: a
    prediction between steps changes nothing the next step sees."""
    kept = [(b, b.detach().clone()) for b in buffers.values()]
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    try:
        with torch.no_grad():
            yield
    finally:
        with torch.no_grad():
            for b, value in kept:
                b.copy_(value)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)


def gather_batch_dim(value: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Equal slices of a batch, one per rank of `group`, joined in rank order."""
    if group is None or dist.get_world_size(group) == 1:
        return value
    parts = [torch.empty_like(value) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, value.contiguous(), group=group)
    return torch.cat(parts)


def time_steps(pm: Any, batches: Callable[[], tuple], warmup: int, steps: int) -> float:
    """The median over `steps` timed steps (after `warmup`) of the slowest rank's step time: every
    rank of the job calls it. `batches()` gives the next (inputs, target)."""
    measured = []
    for i in range(warmup + steps):
        inputs, target = batches()
        dist.barrier()
        start = time.perf_counter()
        pm.step(inputs, target)
        slowest = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        if i >= warmup:
            measured.append(float(slowest))
    return statistics.median(measured)
