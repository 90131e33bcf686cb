"""Pipeline stages with data and tensor parallelism inside each: torch.distributed.pipelining
runs the schedule.

The model is exported at the shape one rank runs (a microbatch of its data-parallel slice) and
cut at the plan's stage boundaries: the plan's layers name their nodes, so a stage may begin
anywhere between layers, module boundary or not (`sharded_graph.cut`). Each rank builds only its
own stage (`ShardedGraph`, with the plan's tensor-axis placements when tp > 1) and hands it to a
`PipelineStage`; `Schedule1F1B` / `ScheduleGPipe` run the microbatches. Ranks form a
(pp, dp, tp) mesh. After the schedule, gradients are averaged over the stage's data-parallel group
(`GradSync`, its buckets launched during the last microbatch's backward), and weights
used by several stages (a GPT's tied embedding and output layer) get the sum of their copies'
gradients, as Megatron-LM does.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from autopar.capture import _export
from runtime.grad_sync import GradSync, local
from runtime.parallel import UnsupportedPlan, _split, check_batch, check_runnable, zero3
from runtime.sharded_graph import ShardedGraph, cut


class SyncingStage(PipelineStage):
    """A PipelineStage that lets the gradient synchroniser launch its buckets while the last
    microbatch's backward still runs (the schedule says which backward is the last)."""

    sync: GradSync | None = None

    def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True, last_backward: bool = False):
        if self.sync is not None:
            self.sync.sync = last_backward
        return super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)


class PipelineModel:
    """`step(inputs, target)`: the global batch on every rank; the global mean loss back."""

    def __init__(self, model: nn.Module, plan: Any, loss_fn: Callable, optimizer: Callable,
                 example_inputs: tuple, device: torch.device | None = None) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        check_runnable(plan)
        self.plan, self.loss_fn = plan, loss_fn
        self.pp, self.m = len(plan.stages), plan.num_microbatches
        self.dp, self.tp = plan.stages[0].logical_mesh
        device = device or torch.device("cpu")
        mesh = init_device_mesh(device.type, (self.pp, self.dp, self.tp), mesh_dim_names=("pp", "dp", "tp"))
        self.stage_index, self.dp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
        self.pp_group, self.dp_group = mesh.get_group("pp"), mesh.get_group("dp")
        micro = tuple(_split(_split(example_inputs, self.dp, 0), self.m, 0))
        ep = _export(model.to(device), micro, {})
        user = [n.name for n in ep.graph.nodes if n.op == "placeholder" and n.name in ep.graph_signature.user_inputs]
        parts = cut(ep.graph, plan, user)
        part = parts[self.stage_index]
        self.module = ShardedGraph(model, plan.stages[self.stage_index], mesh["tp"] if self.tp > 1 else None, ep, part)
        values = {n.name: n.meta.get("val") for n in ep.graph.nodes}
        example = {**values, **dict(zip(user, micro))}

        def like(names: list[str], grad: bool) -> tuple[torch.Tensor, ...]:  # activations carry gradients
            return tuple(torch.zeros(example[n].shape, dtype=example[n].dtype, device=device)
                         .requires_grad_(grad and example[n].is_floating_point()) for n in names)

        stage = SyncingStage(self.module, self.stage_index, self.pp, device,
                              input_args=like(part.inputs, self.stage_index > 0),
                              output_args=like(part.outputs, True), group=self.pp_group)
        kind = ScheduleGPipe if plan.schedule == "gpipe" else Schedule1F1B
        # the loss, not the gradients, carries the 1/m of the microbatch mean: the synchroniser reads
        # the gradients during the last backward, before the schedule could scale them
        self.schedule = kind(stage, self.m, loss_fn=lambda out, target: loss_fn(out, target) / self.m,
                             scale_grads=False)
        self.sync = None
        if zero3(plan) and self.dp > 1:  # the stage shards its parameters over the data axis (FSDP2)
            from torch.distributed.fsdp import fully_shard

            fully_shard(self.module, mesh=mesh["dp"])
        elif self.dp > 1:
            self.sync = GradSync(list(self.module.parameters()), self.dp_group)
        stage.sync = self.sync  # buckets launch during the last microbatch's backward
        self.tied = self._tied_groups(mesh)
        self.optimizer = optimizer(list(self.module.parameters()))
        self._bytes = {"dp": [0, 0], "tp": [0, 0], "pp": [0, 0]}
        self.overlapped = 0  # gradient buckets of the last step launched during backward

    def _tied_groups(self, mesh: Any) -> list[tuple[nn.Parameter, dist.ProcessGroup]]:
        """For each weight several stages use: this rank's copy and the group of the copies (one
        group per data- and tensor-parallel position; every rank creates every group, in order)."""
        mine = {n: str(getattr(p, "placements", "")) for n, p in self.module.named_parameters()}
        holders: list[dict[str, str]] = [None] * self.pp
        dist.all_gather_object(holders, mine, group=self.pp_group)
        out = []
        ranks = mesh.mesh  # [pp, dp, tp] -> global rank
        for name in sorted({n for h in holders for n in h}):
            stages = [s for s in range(self.pp) if name in holders[s]]
            if len(stages) < 2:
                continue
            if len({holders[s][name] for s in stages}) > 1:
                raise UnsupportedPlan(f"stages {stages} place their copies of {name} differently on the tensor axis")
            for d in range(self.dp):
                for t in range(self.tp):
                    group = dist.new_group([int(ranks[s, d, t]) for s in stages])
                    if dist.get_rank() in [int(ranks[s, d, t]) for s in stages]:
                        out.append((self.module.get_parameter(name), group))
        return out

    def step(self, inputs: Any, target: torch.Tensor) -> float:
        check_batch(inputs, self.plan)
        local_in = _split(inputs, self.dp, self.dp_rank)
        local_target = _split(target, self.dp, self.dp_rank)
        args = local_in if isinstance(local_in, (tuple, list)) else (local_in,)
        self.optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        first, last = self.stage_index == 0, self.stage_index == self.pp - 1
        if first and last:
            raise UnsupportedPlan("a one-stage plan runs without the pipeline")
        if first:
            self.schedule.step(*args)
        elif last:
            self.schedule.step(target=local_target, losses=losses)
        else:
            self.schedule.step()
        if self.sync:  # before the tied sum: finish() writes the averages back
            self.sync.finish()
            stats = self.sync.reset_stats()
            self._bytes["dp"] = [stats.bytes_raw, stats.bytes_sent]
            self.overlapped = stats.overlapped
        for weight, group in self.tied:  # copies of one weight: each gets the sum of their gradients
            if weight.grad is not None:
                dist.all_reduce(local(weight.grad), group=group)
        self.optimizer.step()
        total = torch.stack(losses).detach().double().sum() if losses else torch.zeros((), dtype=torch.float64)
        dist.all_reduce(total)
        return float(total) / (self.dp * self.tp)  # every rank of the last stage holds the loss

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        mine = self.module.full_state_dict()
        parts: list[dict] = [None] * self.pp
        dist.all_gather_object(parts, mine, group=self.pp_group)
        out: dict[str, torch.Tensor] = {}
        for part in parts:
            out.update(part)
        return out

    def comm_stats(self) -> dict[str, dict[str, int]]:
        return {axis: {"bytes_raw": raw, "bytes_sent": sent} for axis, (raw, sent) in self._bytes.items()}

    def issued(self) -> list[dict[str, Any]]:
        return []

