"""Pipeline stages with data parallelism inside each: torch.distributed.pipelining does the stages.

The plan's stage boundaries are layer names (module paths such as `h.3`); `pipeline()` traces the
model and cuts it there, `PipelineStage` + `Schedule1F1B` / `ScheduleGPipe` run the microbatches.
Ranks form a (pp, dp) mesh: pipeline stage s, data-parallel rank d. After the schedule, gradients
are averaged over the stage's data-parallel group (`GradSync`, launched when the schedule is
done: the schedule owns the backward) and weights tied across stages (a GPT's embedding and
output layer) get the sum of their copies' gradients, as Megatron-LM does.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from autopar.capture import _WRAPPER_PREFIX as _INNER, _TensorOutput
from runtime.grad_sync import GradSync
from runtime.parallel import UnsupportedPlan, _split, check_runnable


def split_points(model: nn.Module, plan: Any) -> list[str]:
    """The module path each stage after the first begins with."""
    points = []
    for stage in plan.stages[1:]:
        name = plan.layers[stage.layers[0]]["name"].split("…")[0]
        try:
            model.get_submodule(name)
        except AttributeError:
            name = ""
        if not name:
            raise UnsupportedPlan(f"a stage begins at {plan.layers[stage.layers[0]]['name']!r}, which is not a "
                                  "module the pipeline can be cut at")
        points.append(name)
    return points


class PipelineModel:
    """`step(inputs, target)`: the global batch on every rank; the global mean loss back."""

    def __init__(self, model: nn.Module, plan: Any, loss_fn: Callable, optimizer: Callable,
                 example_inputs: tuple, device: torch.device | None = None) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, SplitPoint, pipeline

        check_runnable(plan)
        self.plan, self.loss_fn = plan, loss_fn
        self.pp, self.dp, self.m = len(plan.stages), plan.stages[0].logical_mesh[0], plan.num_microbatches
        device = device or torch.device("cpu")
        mesh = init_device_mesh(device.type, (self.pp, self.dp), mesh_dim_names=("pp", "dp"))
        self.stage_index, self.dp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
        self.pp_group, self.dp_group = mesh.get_group("pp"), mesh.get_group("dp")
        tied = [[_INNER + n for n in names] for names in _tied(model)]
        micro = _split(_split(example_inputs, self.dp, 0), self.m, 0)
        points = {_INNER + p: SplitPoint.BEGINNING for p in split_points(model, plan)}
        # traced as capture traces it: one tensor out (logits), no KV cache (Hugging Face models)
        pipe = pipeline(_TensorOutput(model), mb_args=tuple(micro), split_spec=points)
        if pipe.num_stages != self.pp:
            raise UnsupportedPlan(f"the model cut into {pipe.num_stages} stages where the plan has {self.pp}")
        self.module = pipe.get_stage_module(self.stage_index).to(device)
        stage = pipe.build_stage(self.stage_index, device, group=self.pp_group)
        kind = ScheduleGPipe if plan.schedule == "gpipe" else Schedule1F1B
        self.schedule = kind(stage, self.m, loss_fn=loss_fn)
        self.sync = GradSync(list(self.module.parameters()), self.dp_group) if self.dp > 1 else None
        if self.sync:
            self.sync.sync = False  # the schedule runs the backward: reduce once it is done
        self.tied = self._tied_groups(tied)
        self.optimizer = optimizer(list(self.module.parameters()))
        self._bytes = {"dp": [0, 0], "tp": [0, 0], "pp": [0, 0]}

    def _tied_groups(self, tied: list[list[str]]) -> list[tuple[nn.Parameter, dist.ProcessGroup]]:
        """For each weight held by several stages: this rank's copy and the group of the copies."""
        names = dict(self.module.named_parameters())
        holders = [None] * self.pp
        dist.all_gather_object(holders, sorted(names), group=self.pp_group)
        out = []
        for aliases in tied:
            stages = sorted({s for s in range(self.pp) if any(a in holders[s] for a in aliases)})
            for d in range(self.dp):  # every rank creates every group, in the same order
                ranks = [s * self.dp + d for s in stages]
                group = dist.new_group(ranks) if len(ranks) > 1 else None
                mine = next((names[a] for a in aliases if a in names), None)
                if group is not None and d == self.dp_rank and mine is not None:
                    out.append((mine, group))
        return out

    def step(self, inputs: Any, target: torch.Tensor) -> float:
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
        for weight, group in self.tied:  # copies of one weight: each gets the sum of their gradients
            if weight.grad is not None:
                dist.all_reduce(weight.grad, group=group)
        if self.sync:
            self.sync.finish()
            stats = self.sync.reset_stats()
            self._bytes["dp"] = [stats.bytes_raw, stats.bytes_sent]
        self.optimizer.step()
        total = torch.stack(losses).detach().double().mean() if losses else torch.zeros((), dtype=torch.float64)
        dist.all_reduce(total)
        return float(total) / self.dp

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        mine = {n.removeprefix(_INNER): p.detach().cpu().clone() for n, p in self.module.named_parameters()}
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


def _tied(model: nn.Module) -> list[list[str]]:
    """Names under which one weight is reachable more than once (tied embedding and output layer)."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [v for v in names.values() if len(v) > 1]
