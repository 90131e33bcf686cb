"""Delayed gradient averaging (Zhu et al. 2021): the average of step i's gradients arrives D steps
later, so the all-reduce of a slow, high-latency link overlaps D steps of compute.

Step t applies `g_t − g_{t−D} + avg_{t−D}`: this rank's fresh gradient, corrected by the average
that has just arrived for the gradient it stood in for D steps ago (during the first D steps, the
local gradient alone). Summed over steps, every replica applies the same averages plus its own
last D local gradients: with plain SGD replicas differ by at most those D steps of local
gradient; momentum stretches that over its horizon, and adaptive optimizers (Adam) scale it
differently per replica, so the difference is bounded but not by this simple sum. Every `resync`
steps the replicas average their parameters (optimizer states are not averaged).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import torch
import torch.distributed as dist

from autopar.runtime.grad_sync import EmulatedLink, SyncStats, local, write_grad


class DelayedSync:
    """Same protocol as `GradSync` (`sync`, `finish()`, `reset_stats()`, `after_step()`)."""

    replicas_differ = True  # between resyncs each replica applies its own recent gradients

    def __init__(self, params: list[torch.nn.Parameter], group: dist.ProcessGroup | None, delay: int,
                 resync: int = 100, link: EmulatedLink | None = None) -> None:
        if delay < 1:
            raise ValueError("delayed averaging needs a delay of at least one step")
        self.params = [p for p in params if p.requires_grad]
        self.group, self.delay, self.resync, self.link = group, delay, resync, link
        self.world = dist.get_world_size(group)
        self.sync = True
        self.buckets = [self.params]  # one flat buffer
        self.stats = SyncStats()
        self.pending: deque[tuple[Any, torch.Tensor, torch.Tensor, float]] = deque()
        self.steps = 0

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)

    @torch.no_grad()
    def carry(self, value: torch.Tensor) -> bool:
        """Delayed averaging reduces no gradients in most steps: the loss goes on its own."""
        return False

    def finish(self) -> None:
        grads = [local(p.grad) if p.grad is not None else torch.zeros_like(local(p)) for p in self.params]
        now = torch.cat([g.reshape(-1) for g in grads])
        summed = now.clone()
        nbytes = summed.numel() * summed.element_size()
        self.stats.bytes_raw += nbytes
        self.stats.bytes_sent += nbytes
        self.stats.collectives.append(("all_reduce", nbytes))
        self.pending.append((dist.all_reduce(summed, group=self.group, async_op=True), summed, now,
                             time.perf_counter()))
        applied = now
        if len(self.pending) > self.delay:
            work, total, then, launched = self.pending.popleft()
            if work is not None:  # None: restored from a checkpoint, already complete
                work.wait()
            if self.link is not None:
                self.link.wait(launched, nbytes)
            applied = now - then + total / self.world
        for p, value in zip(self.params, applied.split([g.numel() for g in grads])):
            write_grad(p, value.view_as(local(p)))

    @torch.no_grad()
    def after_step(self) -> None:
        """Called after the optimizer's step: every `resync` steps the replicas average their parameters."""
        self.steps += 1
        if self.resync and self.steps % self.resync == 0:
            for p in self.params:
                dist.all_reduce(local(p.data), group=self.group)
                local(p.data).div_(self.world)

    def state_dict(self) -> dict[str, Any]:
        """The averages still in flight (waited for) and this rank's gradients they replace."""
        for work, *_ in self.pending:
            if work is not None:
                work.wait()
        return {"steps": self.steps, "pending": [(total, then) for _, total, then, _ in self.pending]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = state["steps"]
        self.pending = deque((None, total, then, 0.0) for total, then in state["pending"])

    def reset_stats(self) -> SyncStats:
        stats, self.stats = self.stats, SyncStats()
        return stats
