"""A pipeline schedule for stages of different device counts (e.g. 2 + 1 + 1 devices).

torch.distributed.pipelining pairs the ranks of neighbouring stages one to one (one peer per
direction), so it runs stages of equal sizes only. Between stages of different sizes values cross
whole (`runtime.cross_mesh`: the sender all-gathers over its data-parallel group, the receiver
keeps its slice), which makes any rank of the sending stage a valid source: position j of stage
s + 1 takes its activations from position j mod n_s of stage s, and position i of stage s takes
its gradients from position i mod n_{s+1} of stage s + 1. A rank may thus send to several ranks,
and some send to none. This module runs the same orders as `ScheduleGPipe` / `Schedule1F1B`
with those peers (`autopar.contract.schedules`, the orders the simulator replays): blocking receives,
asynchronous sends.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from autopar.contract import schedules
from autopar.runtime.breakdown import phase


@dataclass(frozen=True)
class Peers:
    """Global ranks this rank exchanges with (None / [] at the ends of the pipeline)."""

    act_from: int | None
    act_to: list[int]
    grad_from: int | None
    grad_to: list[int]


def peers(sizes: list[int], rank: int) -> Peers:
    offsets = list(itertools.accumulate([0, *sizes]))
    s = next(i for i in range(len(sizes)) if rank < offsets[i + 1])
    j = rank - offsets[s]
    prev = range(offsets[s - 1], offsets[s]) if s > 0 else range(0)
    nxt = range(offsets[s + 1], offsets[s + 2]) if s + 1 < len(sizes) else range(0)
    return Peers(act_from=prev[j % len(prev)] if prev else None,
                 act_to=[r for k, r in enumerate(nxt) if k % sizes[s] == j],
                 grad_from=nxt[j % len(nxt)] if nxt else None,
                 grad_to=[r for k, r in enumerate(prev) if k % sizes[s] == j])


class FanOutSchedule:
    """Runs `module` (this rank's stage) over `m` microbatches. `inputs`/`outputs`: zero tensors of
    the shapes this stage receives and sends (whole values on a boundary between sizes)."""

    def __init__(self, module: torch.nn.Module, stage: int, sizes: list[int], m: int, loss_fn: Callable,
                 schedule: str, inputs: tuple[torch.Tensor, ...], outputs: tuple[torch.Tensor, ...]) -> None:
        self.module, self.stage, self.m, self.loss_fn = module, stage, m, loss_fn
        self.first, self.last = stage == 0, stage == len(sizes) - 1
        self.peers = peers(sizes, dist.get_rank())
        self.order = [(kind == "F", i) for kind, _, i in schedules.order(schedule, len(sizes), stage, m)]
        self.inputs, self.outputs = inputs, outputs
        self.sync: Any = None  # GradSync: its buckets launch during the last backward

    def step(self, *args: Any, target: torch.Tensor | None = None, losses: list | None = None) -> None:
        chunks = [tuple(a.tensor_split(self.m)[i] if isinstance(a, torch.Tensor) else a for a in args)
                  for i in range(self.m)]
        targets = target.tensor_split(self.m) if target is not None else None
        saved: dict[int, tuple[tuple, tuple]] = {}
        sends: list[Any] = []  # tensors stay referenced until their sends finish
        for forward, i in self.order:
            if forward:
                inputs = chunks[i] if self.first else receive(self.inputs, self.peers.act_from)
                with phase("forward"):
                    out = self.module(*inputs)
                    outs = out if isinstance(out, tuple) else (out,)
                    if self.last:
                        loss = self.loss_fn(out, targets[i])
                        outs = (loss,)
                if self.last:
                    if losses is not None:
                        losses.append(loss.detach())
                else:
                    sends += send(outs, self.peers.act_to)
                saved[i] = (inputs, outs)
                continue
            inputs, outs = saved.pop(i)
            if self.sync is not None:
                self.sync.sync = i == self.m - 1
            if hasattr(self.module, "set_requires_gradient_sync"):  # FSDP2 (ZeRO-3): reduce with the last only
                self.module.set_requires_gradient_sync(i == self.m - 1)
            if self.last:
                grads: tuple = (None,)
            else:
                grads = receive(self.outputs, self.peers.grad_from, grad=False)
            pairs = [(o, g) for o, g in zip(outs, grads) if o.requires_grad]
            if pairs:
                with phase("backward"):
                    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            if not self.first:
                sends += send(tuple(x.grad if x.grad is not None else torch.zeros_like(x)
                                    for x in inputs if x.is_floating_point()), self.peers.grad_to)
        for work, _ in sends:
            work.wait()


def receive(like: tuple[torch.Tensor, ...], src: int | None, grad: bool = True) -> tuple[torch.Tensor, ...]:
    """Tensors shaped like `like` from rank `src`: activations (`grad`) require gradients where
    `like` does; gradients come for every floating-point value (zeros where it had none)."""
    out = []
    for x in like:
        if not grad and not x.is_floating_point():
            out.append(None)  # integer values carry no gradient back
            continue
        buf = torch.empty_like(x)
        dist.recv(buf, src)
        out.append(buf.requires_grad_(grad and x.requires_grad))
    return tuple(out)


def send(values: tuple[torch.Tensor, ...], dsts: list[int]) -> list[tuple[Any, torch.Tensor]]:
    """Asynchronous sends to every rank of `dsts`; wait on the works (they hold the tensors)."""
    out = []
    for value in values:
        value = value.detach().contiguous()
        out += [(dist.isend(value, dst), value) for dst in dsts]
    return out
