"""Run a one-stage Plan's training step on torch.distributed (pipelines: runtime/pipeline.py).

A one-stage plan without tensor parallelism runs here: the global batch is cut into this rank's
slice and into the plan's microbatches; gradients are averaged by `GradSync` (plans with `R`
parameters on the data axis) or by FSDP2's `fully_shard` (plans whose parameters are `S(0)`:
ZeRO-3). Plans with a tensor axis are refused with the reason (`check_runnable`), before any
collective is issued; the runtime depends on the Plan alone.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from runtime.grad_sync import GradSync


class UnsupportedPlan(ValueError):
    """A plan this runtime cannot execute yet (the message says which part)."""


def check_runnable(plan: Any) -> None:
    meshes = {tuple(s.logical_mesh) for s in plan.stages}
    if len(meshes) > 1:
        raise UnsupportedPlan(f"the plan's stages use different logical meshes {sorted(meshes)}; this runtime runs "
                              "stages of one shape so far (cross-mesh resharding is not built): use a layout DP,1,PP")
    dp, tp = plan.stages[0].logical_mesh
    if tp != 1:
        raise UnsupportedPlan(f"the plan splits a tensor axis of {tp} devices; this runtime runs data and pipeline "
                              "parallelism so far: use a layout DP,1,PP")
    if len(plan.stages) > 1 and _zero3(plan):
        raise UnsupportedPlan("the plan combines pipeline stages with ZeRO-3, which this runtime does not run yet")


def _zero3(plan: Any) -> bool:
    return any(p[0] == "S(0)" for s in plan.stages for p in s.params.values())


def _split(batch: Any, parts: int, index: int) -> Any:
    """Slice `index` of `parts` along dim 0 of every tensor in `batch` (tuples and dicts kept)."""
    if isinstance(batch, torch.Tensor):
        return batch.tensor_split(parts)[index]
    if isinstance(batch, (tuple, list)):
        return type(batch)(_split(b, parts, index) for b in batch)
    if isinstance(batch, dict):
        return {k: _split(v, parts, index) for k, v in batch.items()}
    return batch


class ParallelModel:
    """The model under a plan: `step(inputs, target)` takes the global batch on every rank."""

    def __init__(self, model: nn.Module, plan: Any, loss_fn: Callable, optimizer: Callable,
                 group: dist.ProcessGroup | None = None, device: torch.device | None = None) -> None:
        check_runnable(plan)
        self.plan, self.loss_fn, self.group = plan, loss_fn, group
        self.dp = plan.stages[0].logical_mesh[0]
        self.rank = dist.get_rank(group)
        if dist.get_world_size(group) != self.dp:
            raise UnsupportedPlan(f"the plan needs {self.dp} ranks, the process group has {dist.get_world_size(group)}")
        self.model = model.to(device) if device is not None else model
        self.sync: GradSync | None = None
        if _zero3(plan):
            from torch.distributed.fsdp import fully_shard
            from torch.distributed.device_mesh import DeviceMesh

            mesh = DeviceMesh.from_group(group or dist.group.WORLD, device_type=(device or torch.device("cpu")).type)
            fully_shard(self.model, mesh=mesh)
        else:
            self.sync = GradSync(list(self.model.parameters()), group)
        self.optimizer = optimizer(list(self.model.parameters()))
        self._bytes = {"dp": [0, 0], "tp": [0, 0], "pp": [0, 0]}
        self._issued: list[dict[str, Any]] = []

    def step(self, inputs: Any, target: torch.Tensor) -> float:
        """One training step on the global batch; returns the global mean loss (same on every rank)."""
        m = self.plan.num_microbatches
        local_in, local_target = _split(inputs, self.dp, self.rank), _split(target, self.dp, self.rank)
        micro_in = [_split(local_in, m, i) for i in range(m)]
        micro_target = [_split(local_target, m, i) for i in range(m)]
        total = torch.zeros((), dtype=torch.float64)
        self.optimizer.zero_grad(set_to_none=True)
        for i in range(m):
            last = i == m - 1
            if self.sync is not None:
                self.sync.sync = last
            else:
                self.model.set_requires_gradient_sync(last)
            args = micro_in[i] if isinstance(micro_in[i], (tuple, list)) else (micro_in[i],)
            loss = self.loss_fn(self.model(*args), micro_target[i]) / m
            loss.backward()
            total += loss.detach().double().cpu()
        if self.sync is not None:
            self.sync.finish()
            stats = self.sync.reset_stats()
            self._bytes["dp"] = [stats.bytes_raw, stats.bytes_sent]
            self._issued = [{"axis": "dp", "kind": kind, "bytes": nbytes} for kind, nbytes in stats.collectives]
        else:  # FSDP2: reduce-scatter of each gradient, all-gather of each parameter, per microbatch
            nbytes = sum(p.to_local().numel() * p.to_local().element_size() * self.dp for p in self.model.parameters())
            self._bytes["dp"] = [nbytes * (2 * m + 1), nbytes * (2 * m + 1)]
        self.optimizer.step()
        dist.all_reduce(total, group=self.group)
        return float(total) / self.dp

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded parameters, as single-process training would hold them."""
        out = {}
        for name, p in self.model.named_parameters():
            out[name] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu().clone()
        return out

    def issued(self) -> list[dict[str, Any]]:
        """The collectives the synchronizer issued in the last step ({axis, kind, bytes}), to check
        against the plan's prediction (FSDP2 issues its own: not listed)."""
        return list(self._issued)

    def comm_stats(self) -> dict[str, dict[str, int]]:
        """Bytes this rank handed to collectives in the last step, per axis, before and after compression."""
        return {axis: {"bytes_raw": raw, "bytes_sent": sent} for axis, (raw, sent) in self._bytes.items()}
