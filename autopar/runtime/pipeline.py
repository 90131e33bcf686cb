"""Pipeline stages with data and tensor parallelism inside each: torch.distributed.pipelining
runs the schedule.

The model is exported at the shape one rank runs (a microbatch of its data-parallel slice) and
cut at the plan's stage boundaries: the plan's layers name their nodes, so a stage may begin
anywhere between layers, module boundary or not (`sharded_graph.cut`). Each rank builds only its
own stages (`ShardedGraph`, with the plan's tensor-axis placements when tp > 1) and hands each to
a `PipelineStage`; torch's class for the plan's schedule runs the microbatches (`Schedule1F1B`,
`ScheduleGPipe`; with v stages per rank `ScheduleInterleaved1F1B`, `ScheduleInterleavedZeroBubble`,
`ScheduleZBVZeroBubble`; stages of different device counts: `runtime.fan_out`, the same orders). Each stage splits its devices by its own
logical mesh (`_Groups`; boundaries between different ones are bridged by `runtime.cross_mesh`). After the schedule, gradients are averaged over the stage's data-parallel group
(`GradSync`, its buckets launched during the last microbatch's backward), and weights
used by several stages (a GPT's tied embedding and output layer) get the sum of their copies'
gradients, as Megatron-LM does.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.pipelining as pipelining
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining._backward import stage_backward_weight
from torch.distributed.pipelining._utils import _make_tensor_from_meta
from torch.distributed.pipelining.schedules import PipelineScheduleSingle
from torch.distributed.tensor import DTensor, Replicate

from autopar.contract import schedules
from autopar.contract.compat import plan_refusal
from autopar.contract.errors import AutoparError
from autopar.contract.export import differentiated, first_tensor, trainable_placeholders
from autopar.contract.inputs import as_args
from autopar.contract.plan import Plan
from autopar.contract.precision import retyped
from autopar.runtime import rng
from autopar.runtime.breakdown import phase
from autopar.runtime.buffers import AveragedBuffers
from autopar.runtime.comm_count import CollectiveBytes
from autopar.runtime.cross_mesh import batch_dims
from autopar.runtime.export import export_as_planned, same_on_every_rank
from autopar.runtime.failures import guarded
from autopar.runtime.fan_out import FanOutSchedule, peers, receive, send
from autopar.runtime.grad_sync import GradSync
from autopar.runtime.grad_sync import local as local_part
from autopar.runtime.loop import clip, evaluating, squared_grad_norm
from autopar.runtime.lower import Program, StageBytes, lower, programs, splitting
from autopar.runtime.parallel import (
    UnsupportedPlan,
    _split,
    average_grads,
    build_checked,
    by_model_name,
    check_batch,
    check_optimizer,
    compile_loss,
    data_sharded,
    data_sync,
    on_device,
    refuse_failing,
    shard_data_axis,
)
from autopar.runtime.precision import mixed_precision
from autopar.runtime.sharded_graph import ShardedGraph, cut, defer_partial_grads, reduce_partial_grads


class _Groups:
    """Where this rank sits and the process groups it needs. Device group r (the pipeline's rank r,
    in torch's words) holds the ranks from offsets[r] on, and the plan's stages the schedule puts
    there (`stages`: one, or v of them with an interleaved or V-shaped schedule); position j of a
    group is data-parallel index j // tp and tensor index j % tp of its logical mesh. With one
    logical mesh throughout this is a (pp, dp, tp) DeviceMesh; otherwise the groups are made one by
    one (every rank creates every group, in order) and the boundaries between stages of different
    meshes are bridged (`runtime.cross_mesh`). Groups of equal sizes chain position j of every
    group into a pipeline group; groups of different sizes have none (`runtime.fan_out` sends to
    global ranks)."""

    def __init__(self, plan: Plan, device_type: str) -> None:
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

        self.sizes = plan.group_devices
        self.offsets = list(itertools.accumulate([0, *self.sizes]))
        rank = dist.get_rank()
        self.stage = next(r for r in range(len(self.sizes)) if rank < self.offsets[r + 1])  # this device group
        self.stages = [s for s, r in enumerate(plan.stage_ranks) if r == self.stage]
        j = rank - self.offsets[self.stage]
        dp, tp = plan.stages[self.stage].logical_mesh
        self.dp_rank = j // tp
        meshes = [tuple(s.logical_mesh) for s in plan.stages]
        self.bridged_before = self.stage > 0 and meshes[self.stage - 1] != meshes[self.stage]
        self.bridged_after = self.stage < len(meshes) - 1 and meshes[self.stage + 1] != meshes[self.stage]
        if len(set(meshes)) == 1:
            mesh = init_device_mesh(device_type, (len(self.sizes), dp, tp), mesh_dim_names=("pp", "dp", "tp"))
            self.pp_group, self.dp_group = mesh.get_group("pp"), mesh.get_group("dp")
            self.dp_mesh, self.tp_mesh = mesh["dp"], (mesh["tp"] if tp > 1 else None)
            return
        self.pp_group = None
        if len(set(self.sizes)) == 1:
            for k in range(self.sizes[0]):
                group = dist.new_group([s * self.sizes[0] + k for s in range(len(meshes))])
                if k == j:
                    self.pp_group = group
        for s, (sdp, stp) in enumerate(meshes):
            base = self.offsets[s]
            for t in range(stp):
                group = dist.new_group([base + d * stp + t for d in range(sdp)])
                if s == self.stage and t == j % tp:
                    self.dp_group = group
            for d in range(sdp):
                group = dist.new_group([base + d * stp + t for t in range(stp)])
                if s == self.stage and d == self.dp_rank:
                    tp_group = group
        self.dp_mesh = DeviceMesh.from_group(self.dp_group, device_type)
        self.tp_mesh = DeviceMesh.from_group(tp_group, device_type) if tp > 1 else None


class LocalStages(nn.Module):
    """The stages one rank holds under an interleaved or V-shaped schedule, as one module for the
    optimizer, the gradient synchroniser and checkpoints. They are cut from one model, so a weight
    two of them use (a GPT's tied embedding and output layer on the first rank of a V) is one
    parameter, whose gradient sums both uses."""

    def __init__(self, parts: list[ShardedGraph]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.state_buffers = {k: v for part in parts for k, v in part.state_buffers.items()}

    def model_names(self) -> dict[str, str]:
        return {n: n.rpartition(".")[2].replace("__", ".") for n, _ in self.named_parameters()}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v for part in self.parts for k, v in part.full_state_dict().items()}


class SyncingStage(PipelineStage):
    """A PipelineStage that lets the gradient synchroniser launch its buckets while the rank's last
    backward still runs (the schedule says which backward is a stage's last; of several stages on
    a rank, the first one's comes last)."""

    sync: GradSync | None = None
    launches: bool = True  # whether this stage's last backward is the rank's last
    _outputs: Any = None  # the last stage's outputs of the microbatch a split backward's input pass runs
    _flight: _InFlight | None = None  # this step's sends not yet waited for (`sends_released`)
    _chunk: int = -1  # the microbatch whose backward (or weights' part of it) runs
    _queued: dict | None = None  # microbatch -> the weights' parts its lowered input pass left (`lower.splitting`)

    def forward_one_chunk(self, fwd_chunk_id: int, *args, **kwargs):
        with phase("forward"):
            out = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        _let_go(self.args_recv_info.get(fwd_chunk_id, ()))  # the forward holds its input from here on
        return out

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list:
        _made(self.args_recv_info.get(fwd_chunk_id, ()), self.device)
        return super().get_fwd_recv_ops(fwd_chunk_id)

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list:
        if self.has_backward and not self.is_last:
            _made(self.grad_recv_info.get(bwd_chunk_id, ()), self.device)
        return super().get_bwd_recv_ops(bwd_chunk_id)

    def set_local_bwd_input(self, next_stage_bwd_outputs: Any, mb_index: int) -> None:
        _made(self.grad_recv_info.get(mb_index, ()), self.device)  # (an output without a gradient zeroes it)
        super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)

    def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True, last_backward: bool = False):
        if self.sync is not None:
            self.sync.sync = last_backward and self.launches
        outputs, inputs = self.fwd_cache[bwd_chunk_id]
        self._outputs = outputs if self.is_last and not full_backward else None
        self._chunk = bwd_chunk_id
        with phase("backward"):
            out = super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)
        _let_go(self.grad_recv_info.get(bwd_chunk_id, ()))  # read: a split backward keeps it for its "W"
        for x in inputs:  # torch leaves each input's gradient on it too, where the receive buffers keep
            if isinstance(x, torch.Tensor) and x.grad is not None:  # m of them to the next step: it is
                x.grad = None  # sent from `bwd_cache`, and read nowhere else
        if self._flight is not None:
            self._flight.received(self.stage_index, bwd_chunk_id, [_memory(o) for o in outputs])
            if not self.is_first:  # sent by the schedule next
                self._flight.gradients.setdefault(bwd_chunk_id, []).extend(
                    (self.stage_index, _memory(g)) for g in self.bwd_cache.get(bwd_chunk_id, ()) if g is not None)
        return out

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False):
        self._chunk = bwd_chunk_id
        with phase("backward"):  # the weights' part of a split backward (its gradients are written, not hooked)
            return super().backward_weight_one_chunk(bwd_chunk_id, last_backward)

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        """The weights' part of a split backward keeps the graph until the last group of weights has
        its gradients: groups that share a part of it (DeBERTa's relative-position embeddings, read by
        every layer) would find it freed by the group before (torch frees it after each group). The
        last group frees it, as torch does, rather than leaving it to the microbatch's outputs (which
        may live to the step's end). (FSDP2 under a split backward is refused.)"""
        if backward_type == "input" and self._outputs is not None:
            bwd_kwargs, self._outputs = _loss_freed(bwd_kwargs, self._outputs), None
        if backward_type == "input" and _lowered(self.submod):
            return self._input_pass(bwd_kwargs), None
        if backward_type == "weight" and self._queued and self._chunk in self._queued:
            for finish in self._queued.pop(self._chunk):
                finish()
            return None, None
        if backward_type != "weight":
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        groups = bwd_kwargs["param_groups"]
        if len(groups) > 1:
            stage_backward_weight(self.submod.parameters(), groups[:-1], retain_graph=True)
        return stage_backward_weight(self.submod.parameters(), groups[-1:]), None

    def _input_pass(self, bwd_kwargs: dict) -> tuple:
        """A lowered stage's "B": the inputs' gradients by its backward graph's input part, the
        weight part queued for this microbatch's "W" (`split_backward`). The graph is freed here;
        the weight part holds what it reads. (torch's `stage_backward_input` splits at autograd's
        nodes: a lowered stage is one, and "W" ran its whole backward again.)"""
        outputs, grads, inputs = bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], bwd_kwargs["input_values"]
        pairs = [(o, torch.ones_like(o) if grads is None else grads[i]) for i, o in enumerate(outputs)
                 if isinstance(o, torch.Tensor) and o.requires_grad]
        targets = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
        queue: list = []
        if pairs and targets:
            with splitting(queue):
                got = iter(torch.autograd.grad([o for o, _ in pairs], targets, [g for _, g in pairs], allow_unused=True))
        else:  # no input needs a gradient: "W" runs the whole backward
            got = iter(())
            if pairs:
                queue.append(lambda: torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs]))
        if self._queued is None:
            self._queued = {}
        self._queued[self._chunk] = queue
        return tuple(next(got) if isinstance(x, torch.Tensor) and x.requires_grad else None for x in inputs)


def _lowered(module: Any) -> bool:
    """Whether `module` (a stage) runs as one lowered program, whose backward can be cut in two."""
    program = getattr(module, "program", None)
    return type(program) is Program and program.lowered


def _let_go(infos: Any) -> None:
    """Drop the stage's hold on the buffers a microbatch was received into. torch makes one per
    microbatch, input and output gradient when the schedule starts and keeps all of them (from a
    stage on the same rank: the tensors themselves) from step to step: the whole batch's stage
    inputs and output gradients, on every rank of a pipeline (gpt-small, 2 ranks of 2 stages, 32
    microbatches: 13 MB of a 97 MB peak), where the memory model holds a microbatch's from its
    receipt to its backward, as Megatron's receives do. `_made` makes one again when a receive is
    posted."""
    for info in infos:
        if not info.is_root_arg and info.tensor_meta is not None:
            info.buffer = None


def _made(infos: Any, device: torch.device) -> None:
    """A buffer for each receive of a microbatch whose buffer `_let_go` dropped."""
    for info in infos:
        if not info.is_root_arg and info.tensor_meta is not None and info.buffer is None:
            info.buffer = _make_tensor_from_meta(info.tensor_meta, device)


def _memory(t: Any) -> int:
    return (t._local_tensor if isinstance(t, DTensor) else t).data_ptr() if isinstance(t, torch.Tensor) else -1


class _Sent:
    """A send's work that can let go of it (and of the tensor it holds) before the step ends."""

    __slots__ = ("work",)

    def __init__(self, work: Any) -> None:
        self.work = work

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        if self.work is not None:
            self.work.wait(*args, **kwargs)
            self.work = None
        return True


@dataclass
class _InFlight:
    """A rank's sends not yet waited for (`sends_released`), by the sent tensor's memory, and the
    memory of each microbatch's input gradients by stage (sent once its backward returns)."""

    sends: dict[int, list[_Sent]] = field(default_factory=dict)
    gradients: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # microbatch -> (stage, memory)

    def received(self, stage: int, microbatch: int, outputs: list[int]) -> None:
        """Stage `stage` got `microbatch`'s gradient (`outputs`: the memory of what it sent forward):
        the next stage had its activation, and every later stage's input gradient of that
        microbatch reached the stage before it (the gradient passed through them), so those sends
        are done and their waits return at once."""
        kept = []
        for later, memory in self.gradients.pop(microbatch, []):
            if later > stage:
                outputs = [*outputs, memory]
            else:
                kept.append((later, memory))
        if kept:
            self.gradients[microbatch] = kept
        for memory in outputs:
            for handle in self.sends.pop(memory, []):
                handle.wait()


@contextlib.contextmanager
def sends_released(stages: list[Any]) -> Any:
    """torch's multi-stage schedules (interleaved, zero bubble, ZBV) wait for their sends only at
    the step's end, so each send's work, and the activation or gradient it sends, lived until then:
    m microbatches' outputs and input gradients per stage (gpt-small, interleaved-zb, 32
    microbatches: 94 hidden-state-sized tensors held at rank 0's peak). Here a stage that receives
    a microbatch's gradient waits for the sends that gradient proves received (`_InFlight`), at
    once; the schedule's own wait at the end finds them done. (A work that says it completed could
    be dropped sooner; gloo's sends never say so.)"""
    from torch.distributed.pipelining import schedules as torch_schedules

    original = getattr(torch_schedules, "_batch_p2p", None)
    if original is None:  # (another torch: its schedules as they are)
        yield
        return
    flight = _InFlight()
    for stage in stages:
        stage._flight = flight

    def batch_p2p(ops: list, desc: str | None = None) -> list:
        works = original(ops, desc=desc)
        if not ops or len(works) != len(ops) or any(op.op is not dist.isend for op in ops):
            return works
        sent = [_Sent(w) for w in works]
        for op, handle in zip(ops, sent):
            flight.sends.setdefault(op.tensor.data_ptr(), []).append(handle)
        return sent

    torch_schedules._batch_p2p = batch_p2p
    try:
        yield
    finally:
        torch_schedules._batch_p2p = original
        for stage in stages:
            stage._flight = None


def _loss_freed(bwd_kwargs: dict, outputs: Any) -> dict:
    """The last stage's split backward from its outputs, as the other stages' runs: torch's input
    pass keeps the graph from the loss for the weights' pass (`retain_graph`), and the schedule keeps
    each microbatch's loss to the step's end, so the loss's saved tensors (a cross entropy's
    log-probabilities, logits-sized) lived until then: m of them. Here the loss's part of the
    graph runs first, once, and is freed; measured on gpt-small under interleaved-zb (2 ranks,
    8 microbatches) the last rank's peak held 8 log-probabilities where 1F1B holds one."""
    outs = [o for o in (outputs if isinstance(outputs, tuple) else (outputs,))
            if isinstance(o, torch.Tensor) and o.requires_grad]
    if not outs:
        return bwd_kwargs
    grads = torch.autograd.grad(bwd_kwargs["stage_output"], outs, allow_unused=True)
    kept = [(o, g) for o, g in zip(outs, grads) if g is not None]
    return {**bwd_kwargs, "stage_output": tuple(o for o, _ in kept), "output_grads": [g for _, g in kept]}


class PipelineModel:
    """`step(inputs, target)`: the global batch on every rank; the global mean loss back."""

    def __init__(self, model: nn.Module, plan: Plan, loss_fn: Callable, optimizer: Callable,
                 example_inputs: tuple, device: torch.device | None = None,
                 max_grad_norm: float | None = None, compile: bool = False) -> None:
        why = plan_refusal(plan)  # which features combine (a plan built in memory is not validated as a file is)
        if why:
            raise UnsupportedPlan(why)
        loss_fn = compile_loss(loss_fn) if compile else loss_fn
        self.plan, self.loss_fn, self.forward = plan, loss_fn, model.forward
        self.max_grad_norm, self.last_grad_norm = max_grad_norm, None
        self.pp, self.m = len(plan.stages), plan.num_microbatches
        device = self.device = device or torch.device("cpu")
        g = _Groups(plan, device.type)
        self.stage_index, self.dp_rank, self.pp_group, self.dp_group = g.stage, g.dp_rank, g.pp_group, g.dp_group
        self.local = g.stages  # the plan's stages this rank runs
        self.dp, self.tp = plan.stages[self.stage_index].logical_mesh
        self.data_parallel_rank, self.data_parallel_size = self.dp_rank, self.dp  # this stage's
        micro = tuple(_split(_split(example_inputs, self.dp, 0), self.m, 0))
        ep = export_as_planned(model.to(device), micro, tuple(example_inputs))
        same_on_every_rank(ep.graph, model)
        user = [n.name for n in ep.graph.nodes if n.op == "placeholder" and n.name in ep.graph_signature.user_inputs]
        parts = cut(ep.graph, plan, user, ep.graph_signature.user_outputs[0])
        part = parts[self.stage_index]
        if g.bridged_before or g.bridged_after:  # a second export (before sharding) tells batch dimensions
            twice = export_as_planned(model, tuple(torch.cat([x, x]) if isinstance(x, torch.Tensor) else x
                                                   for x in micro), tuple(example_inputs))
        # the stages shard their parameters over the data axis (FSDP2: ZeRO-3, ZeRO-1)
        kinds = {data_sharded(plan.stages[s], self.dp) for s in self.local}
        if len(kinds) > 1:
            raise UnsupportedPlan(f"stages {', '.join(map(str, self.local))} share device group {g.stage}, and only some "
                                  "shard their parameters over the data axis (ZeRO): re-plan them alike")
        sharded = kinds == {True}
        self.precision = mixed_precision(plan.precision, device)
        modules = []
        # a parameter the first stage keeps but another of this rank's stages uses is placed as that one's plan says
        local_params = {f: p for t in self.local for f, p in plan.stages[t].params.items()}
        for s in self.local:  # one model: a weight two local stages use is one parameter
            module = ShardedGraph(model, plan.stages[s], g.tp_mesh, ep, parts[s],
                                  layers=plan.stage_units(plan.stages[s]), units=sharded,
                                  keep_unused=s == 0, kept_params=local_params)
            lower(module, {"dp": g.dp_group, **({"tp": g.tp_mesh.get_group()} if g.tp_mesh is not None else {})},
                  compile, plan.priced_collectives(plan.stages[s]))
            module.forward = self.precision.autocasting(module.forward)
            module.copy_views = schedules.splits_backward(plan.schedule) and s < self.pp - 1
            modules.append(module)
        self.modules = modules
        self.module = modules[0] if len(modules) == 1 else LocalStages(modules)
        self.trained = self.module  # what the optimizer steps (and checkpoints save), by model names
        if plan.precision is not None:  # what crosses a boundary has the dtype autocast gives it

            values = {n.name: n.meta.get("val") for n in retyped(ep.graph, plan.precision, device.type).nodes}
        else:
            values = {n.name: n.meta.get("val") for n in ep.graph.nodes}
        example = {**values, **dict(zip(user, [x for x in micro if isinstance(x, torch.Tensor)]))}
        dims: dict[str, int | None] = {}
        if g.bridged_before or g.bridged_after:  # values cross whole: find their batch dimension
            dims = batch_dims(ep.graph, twice.graph, part.inputs + part.outputs)
        if g.bridged_before:
            self.module.slice_inputs = {i: (dims.get(n), self.dp_group) for i, n in enumerate(part.inputs)}
        if g.bridged_after:
            self.module.gather_outputs = {i: (dims.get(n), self.dp_group) for i, n in enumerate(part.outputs)}

        differentiable = differentiated(ep.graph, trainable_placeholders(ep, model))

        def like(names: list[str], grad: bool, whole: bool) -> tuple[torch.Tensor, ...]:
            """Zero tensors of what crosses the boundary (activations carry gradients; a value no
            trainable parameter feeds, such as a rotary table, does not)."""
            out = []
            for n in names:
                shape = list(getattr(example[n], "shape", ()))
                if whole and dims.get(n) is not None:
                    shape[dims[n]] *= self.dp
                out.append(torch.zeros(shape, dtype=example[n].dtype, device=device)
                           .requires_grad_(grad and n in differentiable))
            return tuple(out)

        kind = schedule_class(plan.schedule, plan.groups, self.m, plan.virtual)
        # the loss, not the gradients, carries the 1/m of the microbatch mean: the synchroniser reads
        # the gradients during the last backward, before the schedule could scale them
        def loss_m(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            with self.precision.autocast():
                loss = loss_fn(out, target) / self.m
            return self.precision.scale(loss)  # fp16: the schedule's backward starts from the scaled loss

        received = [like(parts[s].inputs, s > 0, g.bridged_before) for s in self.local]
        sent = [like(parts[s].outputs, True, g.bridged_after) for s in self.local]
        for s, module, inputs in zip(self.local, modules, received):
            with self.precision.autocast():  # as the steps run it
                refuse_failing(module, tuple(micro) if s == 0 else inputs)
        fan = (1, 1)  # ranks this one sends activations to, and input gradients to
        if g.pp_group is None:  # stages of different sizes: a rank may send to several
            stage = FanOutSchedule(self.module, self.stage_index, g.sizes, self.m, loss_m, plan.schedule,
                                   received[0], sent[0])
            self.schedule, stages = stage, [stage]
            fan = (len(stage.peers.act_to), len(stage.peers.grad_to))
        else:
            stages = [SyncingStage(module, s, self.pp, device, input_args=inputs, output_args=outputs,
                                   group=self.pp_group) for s, module, inputs, outputs in zip(self.local, modules, received, sent)]
            for stage in stages[1:]:
                stage.launches = False  # the rank's last backward is its first stage's
            if issubclass(kind, PipelineScheduleSingle):
                self.schedule = kind(stages[0], self.m, loss_fn=loss_m, scale_grads=False)
            else:
                self.schedule = kind(stages, self.m, loss_fn=loss_m, scale_grads=False)
        self.torch_stages = [stage for stage in stages if isinstance(stage, SyncingStage)]
        self.sync = None
        self.whole: list[nn.Parameter] = []  # kept whole under FSDP2: their gradients averaged by the step
        if sharded:
            for s, module in zip(self.local, modules):
                self.whole += [p for p in shard_data_axis(module, g.dp_mesh, plan.precision, plan.stages[s].zero,
                                                          plan.stages[s].offload) if all(p is not q for q in self.whole)]
        elif self.dp > 1:
            self.sync = data_sync(by_model_name(self.module), self.dp_group, plan)
        if self.tp > 1 and not sharded and not plan.dp_gradient.get("compression"):
            defer_partial_grads(list(self.module.parameters()))
        for s, module, inputs in zip(self.local, modules, received):
            with self.precision.autocast():  # traced as the steps run it (partial gradients deferred)
                build_checked(module, tuple(micro) if s == 0 else inputs)
        for stage in stages:
            stage.sync = self.sync  # buckets launch during the rank's last backward
        self.state_buffers = self.module.state_buffers
        self.buffer_sync = AveragedBuffers(self.state_buffers, self.dp_group) if self.dp > 1 else None
        self.tied = self._tied_groups(g)
        self._offsets, self._sizes, self._received = g.offsets, g.sizes, received
        self.optimizer = optimizer(list(self.module.parameters()))
        check_optimizer(self.optimizer, plan)
        where = plan.stage_ranks  # values between two stages of this rank do not cross the network
        nbytes = [sum(t.numel() * t.element_size() for ts in group for t in ts if t.is_floating_point() or not grad)
                  for group, grad in (([o for s, o in zip(self.local, sent)
                                        if s < self.pp - 1 and where[s + 1] != g.stage], False),
                                      ([i for s, i in zip(self.local, received) if s > 0 and where[s - 1] != g.stage],
                                       True))]
        pp = self.m * (fan[0] * nbytes[0] + fan[1] * nbytes[1])
        self._bytes = {"dp": [0, 0], "tp": [0, 0], "pp": [pp, pp]}  # pp: activations out, their gradients back
        self.overlapped = 0  # gradient buckets of the last step launched during backward
        if g.tp_mesh is not None:  # replicated values draw one dropout mask on every rank of the tensor axis
            rng.share(g.tp_mesh, device)

    def _tied_groups(self, g: _Groups) -> list[tuple[nn.Parameter, dist.ProcessGroup | None, int | None]]:
        """For each weight stages of several device groups use: this rank's copy, the group that
        sums the copies' gradients (every rank creates every group, in order), and None when every
        copy is placed alike on stages of one logical mesh (a group per position: local shards add
        up as they are), else this stage's size (one group of all their ranks, each adding its whole
        gradient / size). Stages of one rank share the parameter itself (`LocalStages`)."""
        where = self.plan.stage_ranks
        held = {s: {} for s in self.local}
        for s, module in zip(self.local, self.modules):
            names = module.model_names()
            held[s] = {names[n]: str(getattr(p, "placements", "")) for n, p in module.named_parameters()}
        per_rank: list[dict[int, dict[str, str]]] = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, held)
        holders = [per_rank[g.offsets[where[s]]][s] for s in range(self.pp)]
        # weights a lower stage of another rank holds too: checkpoints save them from that stage alone
        lowest = {}
        for s in self.local:
            for n in holders[s]:
                lowest.setdefault(n, s)
        self.copies = {n for n, s in lowest.items() if any(n in holders[k] and where[k] != g.stage for k in range(s))}
        names = self.module.model_names()
        by_model = {model: here for here, model in names.items()}
        out = []
        for name in sorted({n for h in holders for n in h}):
            stages = [s for s in range(self.pp) if name in holders[s]]
            ranks = sorted({where[s] for s in stages})
            if len(ranks) < 2:
                continue
            if len({holders[s][name] for s in stages}) == 1 and len({self.plan.stages[s].logical_mesh for s in stages}) == 1:
                groups = [[g.offsets[r] + j for r in ranks] for j in range(g.sizes[ranks[0]])]
                share = None
            else:
                groups = [[k for r in ranks for k in range(g.offsets[r], g.offsets[r + 1])]]
                share = g.sizes[self.stage_index]
            for members in groups:
                group = dist.new_group(members)
                if dist.get_rank() in members:
                    out.append((self.module.get_parameter(by_model[name]), group, share))
        return out

    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        raise AutoparError(f"this plan is a pipeline of {len(self.plan.stages)} stages: torch's pipeline schedules run "
                           "forward, loss and backward together, so it trains with pm.step(inputs, target) and "
                           "predicts with pm.predict(inputs); a one-stage plan is a module you call")

    @guarded
    def step(self, inputs: Any, target: torch.Tensor, local: bool = False) -> float:
        inputs, target = on_device(as_args(self.forward, inputs), self.device), target.to(self.device)
        if local and len({s.logical_mesh[0] for s in self.plan.stages}) > 1:
            raise AutoparError("step(local=True) needs the same data-parallel size on every stage; this plan's "
                                  f"are {[s.logical_mesh[0] for s in self.plan.stages]}: pass the global batch")
        check_batch(inputs, self.plan, self.dp if local else None)
        # the first stage uses the inputs, the last the target; a local slice is cut into microbatches as it is
        local_in, local_target = (inputs, target) if local else (self._local(inputs), self._local(target))
        args = tuple(x for x in local_in if isinstance(x, torch.Tensor))  # the graph's inputs (None: a constant)
        if self.sync is not None:  # zeroes its buckets in place where it can
            self.sync.zero_grad(self.optimizer)
        else:
            self.optimizer.zero_grad(set_to_none=True)
        if self.buffer_sync is not None:
            self.buffer_sync.before_step()
        losses: list[torch.Tensor] = []
        first, last = 0 in self.local, self.pp - 1 in self.local
        if self.pp == 1:
            raise UnsupportedPlan("a one-stage plan runs without the pipeline")
        counter = StageBytes(self.modules) if self.tp > 1 else contextlib.nullcontext()
        with counter, phase("schedule"):  # the tensor axis's collectives
            ends = {}  # the first stage takes the inputs, the last the target (one rank of a V holds both)
            if last:  # the outputs (logits of every microbatch) are not kept: only the losses
                kept = {"return_outputs": False} if not isinstance(self.schedule, FanOutSchedule) else {}
                ends = {"target": local_target, "losses": losses, **kept}
            with sends_released(self.torch_stages):
                self.schedule.step(*(args if first else ()), **ends)
        if self.sync:  # before the tied sum: finish() writes the averages back
            with phase("dp_sync"):
                self.sync.finish()
            stats = self.sync.reset_stats()
            self._bytes["dp"] = [stats.bytes_raw, stats.bytes_sent]
            self.overlapped = stats.overlapped
        average_grads(self.whole, self.dp_group)
        if self.tp > 1:  # the partial gradients left to the end of the step (after the data axis: sums commute)
            with CollectiveBytes() as after:  # issued by DTensor
                reduce_partial_grads(list(self.module.parameters()))
            self._bytes["tp"] = [counter.nbytes + after.nbytes] * 2
        for weight, group, share in self.tied:  # copies of one weight: each gets the sum of their gradients
            if weight.grad is None:  # a copy no microbatch reached still joins the sum (all ranks call it)
                weight.grad = torch.zeros_like(weight)
            grad = weight.grad
            if share is None:
                dist.all_reduce(local_part(grad), group=group)
                continue
            # placed differently in another stage: add up whole gradients, keep this copy's part
            whole = (grad.full_tensor() if isinstance(grad, DTensor) else grad) / share
            dist.all_reduce(whole, group=group)
            weight.grad = whole if not isinstance(grad, DTensor) else DTensor.from_local(
                whole, grad.device_mesh, [Replicate()] * grad.device_mesh.ndim, run_check=False,
            ).redistribute(grad.device_mesh, grad.placements)
        with phase("optimizer"):
            if self.max_grad_norm is not None:  # a weight several stages hold counts once, in the lowest
                self.precision.unscale(self.optimizer)
                names = self.module.model_names()
                own = [p for n, p in self.module.named_parameters() if names[n] not in self.copies]
                self.last_grad_norm = clip(list(self.module.parameters()), squared_grad_norm(own),
                                           self._sizes[self.stage_index], self.max_grad_norm, self.device)
            scale = self.precision.loss_scale  # the losses the schedule kept are scaled by it
            self.precision.step(self.optimizer)
        if self.sync:
            self.sync.after_step()
        if self.buffer_sync is not None:
            self.buffer_sync.after_step()
        total = (torch.stack(losses).detach().double().sum() if losses
                 else torch.zeros((), dtype=torch.float64, device=self.device))  # NCCL reduces device tensors only
        dist.all_reduce(total)
        dp, tp = self.plan.stages[-1].logical_mesh
        return float(total) / (dp * tp * scale)  # every rank of the last stage holds the loss

    def _local(self, batch: Any) -> Any:
        """This rank's samples, microbatch by microbatch: microbatch i is the i-th m-th of the global
        batch on every stage, whatever each stage's data-parallel size (the schedule cuts the
        result into m equal chunks)."""
        chunks = [_split(_split(batch, self.m, i), self.dp, self.dp_rank) for i in range(self.m)]
        if isinstance(batch, torch.Tensor):
            return torch.cat(chunks)
        return type(batch)(torch.cat([c[k] for c in chunks]) if isinstance(batch[k], torch.Tensor) else batch[k]
                           for k in range(len(batch)))

    @guarded
    def predict(self, inputs: Any) -> torch.Tensor:
        """The model's output for the global batch without gradients, on every rank: the stages
        run the microbatches forward (activations to the next stage's peers, as the schedule
        sends them) and the last stage's slices are shared. Training is left as it was."""
        inputs = on_device(as_args(self.forward, inputs), self.device)
        check_batch(inputs, self.plan)
        args = tuple(x for x in self._local(inputs) if isinstance(x, torch.Tensor))
        where, here = self.plan.stage_ranks, self.stage_index
        to = peers(self._sizes, dist.get_rank())  # one stage per group (of any sizes)
        j = dist.get_rank() - self._offsets[here]  # several: equal groups, position j talks to position j
        outs, sends = [], []
        with evaluating(self.state_buffers, self.device):
            for i in range(self.m):
                for s, module, like in zip(self.local, self.modules, self._received):
                    if s == 0:
                        xs = tuple(a.tensor_split(self.m)[i] for a in args)
                    elif where[s - 1] != here:
                        xs = receive(like, to.act_from if self.plan.virtual == 1 else self._offsets[where[s - 1]] + j)
                    out = module(*xs)  # in the plan's precision
                    if s == self.pp - 1:
                        outs.append(first_tensor(out).cpu())
                    elif where[s + 1] == here:
                        xs = out if isinstance(out, tuple) else (out,)
                    else:
                        sends += send(out if isinstance(out, tuple) else (out,),
                                      to.act_to if self.plan.virtual == 1 else [self._offsets[where[s + 1]] + j])
            for work, _ in sends:
                work.wait()
        last = self.pp - 1 in self.local
        held: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(held, (self.dp_rank, outs) if last else None)  # tensor-parallel ranks: the same
        by_slice = dict(h for h in held if h is not None)
        return torch.cat([by_slice[r][i] for i in range(self.m) for r in sorted(by_slice)]).to(self.device)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        mine = self.module.full_state_dict()  # a collective within the stage; one rank per stage shares it
        parts: list[dict] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, mine if dist.get_rank() in self._offsets else {})
        out: dict[str, torch.Tensor] = {}
        for part in parts:
            out.update(part)
        return out

    def comm_stats(self) -> dict[str, dict[str, int]]:
        return {axis: {"bytes_raw": raw, "bytes_sent": sent} for axis, (raw, sent) in self._bytes.items()}

    def programs(self) -> list[dict[str, Any]]:
        """How this rank's stages run: lowered (their collectives) or interpreted (why)."""
        return programs(self.modules, list(self.local))

    def issued(self) -> list[dict[str, Any]]:
        return []


def schedule_class(name: str, groups: int, num_microbatches: int, virtual: int = 1) -> type:
    """torch's class for the registry's schedule, or for its fallback where torch's refuses the
    microbatch count (Schedule1F1B: fewer microbatches than stages)."""
    return getattr(pipelining, schedules.runs(name, groups, num_microbatches, virtual).torch_class)
