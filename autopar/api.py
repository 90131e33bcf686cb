"""`autopar.parallelize`: capture, plan (or load a plan), check it against this model and world, run it."""

from __future__ import annotations

import atexit
import dataclasses
import gc
import logging
import os
import uuid
import weakref
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from autopar.contract.compression import parse
from autopar.contract.errors import AutoparError, CaptureError
from autopar.contract.inputs import as_args
from autopar.contract.plan import Plan
from autopar.contract.precision import parse_precision
from autopar.contract.units import human_bytes
from autopar.contract.workload import Workload
from autopar.cost_models import get_cluster
from autopar.planner.capture import capture
from autopar.planner.manual import Layout, manual_plan, manual_search, uncaptured_plan
from autopar.planner.search import Search, plan_auto, plan_compressed
from autopar.planner.strategy_costs import REPLICATED_GRADIENTS
from autopar.planner.tune import candidates, choose
from autopar.planner.unruled import warn_replicated
from autopar.runtime import default_backend, local_device
from autopar.runtime.backend import group_backend, keep_to_loopback
from autopar.runtime.failures import PeerFailed, agreed, collective_failures, set_timeouts, told
from autopar.runtime.loop import time_steps
from autopar.runtime.memory import hold_to
from autopar.runtime.parallel import ParallelModel, UnsupportedPlan, zero3
from autopar.runtime.pipeline import PipelineModel

log = logging.getLogger(__name__)


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh | tuple[int, int] | None = None,
    example_inputs: Any = (),
    *,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None,
    plan: Plan | str | Path | None = None,
    cluster: str | None = None,
    compression: str | None = None,
    delay: int = 0,
    timeout: float | None = None,
    max_grad_norm: float | None = None,
    mixed_precision: str | None = None,
    memory_limit: float | None = None,
    tune: int = 0,
    example_target: torch.Tensor | None = None,
    compile: bool = False,
    batch: str = "local",
):
    """The model under a plan: a module the user's loop calls (one-stage plans), and `step(inputs,
    target)`, a whole training step on the global batch with `loss_fn` and `optimizer`.

    Every rank calls this with the same arguments (under torchrun, or alone for one process); rank
    0 plans and the others receive its plan, then each rank builds its part of the model.

    - `model`: the `nn.Module` to train, built on every rank (rank 0's parameters and buffers are
      broadcast before anything trains, as DDP does).
    - `mesh`: a 2-D DeviceMesh (hosts × devices), a `(hosts, devices)` tuple, or None: the job's
      hosts × local ranks (torchrun's LOCAL_WORLD_SIZE).
    - `example_inputs`: one global batch of the model's inputs: a tuple of positional inputs, a
      dict of keyword inputs or one tensor, every tensor with the batch first (the shapes the
      plan is made for; each `step` takes the same shapes).
    - `loss_fn(output, target)` (for `step`): the mean loss of the samples given; `output` is the
      model's output reduced to one tensor (itself, its `.logits`, or the first tensor inside).
      Without it the plan has one stage (pipelines run a loss inside their schedule).
    - `optimizer(params)` (for `step`): builds the torch optimizer over this rank's parameters.
      Without it, pass `pm.parameters()` to your own.
    - `batch`: what `pm(*inputs)` takes: "local", this rank's data-parallel slice (as DDP; the
      ranks of one tensor-parallel group pass the same slice), or "global", the whole batch.
    - `plan`: None (search), a Plan, a path to plan JSON, or a layout "DP,TP,PP[,MB]".
    - `cluster`: a preset name or cluster file to plan for (default `cpu-local`, this machine).
    - `compression` ("dgc:0.999", "powersgd:2", ... see `runtime.compression`; "auto": the planner
      weighs a few) and `delay` (delayed gradient averaging, in steps) replace the plan's
      `dp_gradient` choices; a searched or hand-written layout is planned with them priced in.
    - `timeout` (seconds): a collective of any of the job's process groups waiting longer fails,
      and `step` raises `PeerLost`: a rank died or hangs (default: torch's, 30 minutes on gloo).
    - `max_grad_norm`: each step clips the gradients by their global norm over every axis
      (`math.inf`: measure only); the norm before clipping is `pm.last_grad_norm`.
    - `mixed_precision` ("bf16", "fp16" with loss scaling, or "fp32"): forward and loss under
      autocast, fp32 master weights, gradients and optimizer state; None: the plan's precision
      (fp32 when planning here). A plan priced for another is refused.
    - `memory_limit` (bytes of tensors per rank): the search plans within it, a plan predicted to
      exceed it is refused, and the run is held to it (`runtime.memory.hold_to`).
    - `tune` (K > 0, searching only): the K best predicted plans of distinct layouts each run a
      few steps on this job's ranks, on `example_inputs` and `example_target` (a real batch), and
      the measured fastest is kept; `plan.search["tuned"]` holds every candidate's predicted and
      measured step time. The model's weights are left as they were.
    - `compile`: inductor compiles each stage's lowered forward and backward graphs (at the first
      step of each input shape: seconds to minutes); without it they run as traced, on the same
      kernels as eager torch. Either way a stage runs as the program lowered from the plan
      (`runtime.lower`): local tensors and the collectives the plan priced. Under plain data
      parallelism (no graph to lower) it compiles the module's repeated blocks in place, one
      `torch.compile` each, as torchtitan does, so gradient buckets overlap the backward.

    Returns a `ParallelModel` (one stage: an `nn.Module`) or a `PipelineModel` (several: `step` only).

    Raises `AutoparError` (on every rank, with one message) for input it cannot take: a malformed
    argument, a layout the model or the ranks cannot run, a plan for another model, world size or
    precision, a model `torch.export` cannot capture under a layout other than data parallelism;
    `PeerFailed` when another rank failed while planning or building (naming it and its message).
    """
    precision = parse_precision(mixed_precision)

    if compression not in (None, "auto"):
        parse(compression)  # a misspelt method fails here, on every rank, before any process group
    if delay < 0:
        raise AutoparError(f"delay must be a number of steps ≥ 0, got {delay}")
    if timeout is not None and not timeout > 0:
        raise AutoparError(f"timeout must be a positive number of seconds, got {timeout}")
    if memory_limit is not None and not memory_limit > 0:
        raise AutoparError(f"memory_limit must be a positive number of bytes, got {memory_limit}")
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise AutoparError(f"max_grad_norm must be a positive number (math.inf: measure the norm only), got {max_grad_norm}")
    if batch not in ("local", "global"):
        raise AutoparError(f'batch must be "local" (this rank\'s data-parallel slice) or "global", got {batch!r}')
    if tune and (loss_fn is None or optimizer is None):
        raise AutoparError("tune=K times steps of its candidates: pass loss_fn and optimizer")
    if loss_fn is None and _is_layout(plan) and Layout.parse(plan).pp > 1:
        raise AutoparError(f"plan {plan!r} is a pipeline, whose schedule runs the loss between its stages: pass "
                           "loss_fn (and optimizer) and train with pm.step(inputs, target), or choose a layout with PP 1")
    _init_process_group(default_backend())  # torch's timeout while rank 0 plans; `timeout` once built
    world, rank = dist.get_world_size(), dist.get_rank()
    device = local_device(int(os.environ.get("LOCAL_RANK", rank)))
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL's object collectives and new groups use the current device
    hosts, per_host = _mesh_shape(mesh, world)
    if hosts * per_host != world:
        raise AutoparError(f"mesh {hosts}x{per_host} has {hosts * per_host} devices, the job has {world} ranks: "
                           f"launch with torchrun --nproc-per-node {hosts * per_host}, or pass mesh=(1, {world})")
    args = as_args(model.forward, example_inputs, "example_inputs")
    size = next(a.shape[0] for a in args if isinstance(a, torch.Tensor))
    graph, uncaptured = agreed("capturing the model", lambda: _capture_or_why(model, args, plan, tune))
    # the plan, the scope of this model's failures, the graph rank 0 captured
    chosen: list[Any] = [None, uuid.uuid4().hex[:12], graph.fingerprint() if graph is not None else None]
    if tune and (plan is not None or compression or delay or example_target is None):
        raise AutoparError("tune=K measures the free search's best layouts on a real batch: pass example_target, "
                           "and no plan, compression or delay")
    failed: BaseException | None = None
    if rank == 0:
        try:
            if uncaptured is not None:
                chosen[0] = uncaptured_plan(type(model).__name__, [n for n, _ in model.named_parameters()], size,
                                            world, (hosts, per_host), cluster or "cpu-local",
                                            Layout.parse(plan) if _is_layout(plan) else None, str(uncaptured),
                                            precision)
                log.warning("%s trains data-parallel without its graph (every rank runs the whole model on its "
                            "samples, as DDP does), because %s", type(model).__name__, uncaptured)
            elif tune:
                chosen[0] = _candidates(model, args, size, graph, cluster, (hosts, per_host), precision,
                                        memory_limit, tune)
            else:
                chosen[0] = _resolve(plan, model, args, size, graph, cluster, (hosts, per_host), compression, delay,
                                     precision, memory_limit, one_stage=loss_fn is None)
            if isinstance(chosen[0], Plan) and graph is not None:
                warn_replicated(graph, chosen[0])
        except Exception as exc:  # every rank reports it, none waits for a plan that never comes
            failed, chosen[0] = exc, PeerFailed(0, "planning", *told(exc))
    dist.broadcast_object_list(chosen, src=0)
    if failed is not None:
        raise failed
    if isinstance(chosen[0], PeerFailed):
        raise AutoparError(chosen[0].message) if chosen[0].user else chosen[0]  # a user's error: the same words
    resolved, scope, captured = chosen
    with collective_failures("building the model", scope):  # one rank's error is every rank's
        agreed("checking the graph", lambda: _same_graph(model, graph, captured))
        if tune:
            resolved = _tuned(resolved, model, args, example_target, loss_fn, optimizer, max_grad_norm)
            if dist.get_rank() == 0 and graph is not None:
                warn_replicated(graph, resolved)
        resolved = agreed("checking the plan", lambda: _checked(resolved, model, graph, world, precision,
                                                                mixed_precision, memory_limit, compression, delay))
        pm = _build(resolved, model, args, loss_fn, optimizer, max_grad_norm, device, compile, batch)
        pm.failure_scope = scope
        if timeout is not None:
            set_timeouts(timeout)  # every group, the model's too; not before: rank 0 may plan for minutes
        if memory_limit is not None:
            hold_to(pm, memory_limit)
    _BUILT.add(pm)
    return pm


def _same_graph(model: nn.Module, graph: Any, captured: str | None) -> None:
    """This rank captured the graph rank 0 planned with (or, as it, none)."""
    mine = graph.fingerprint() if graph is not None else None
    if mine != captured:
        raise AutoparError(
            f"this rank captured another graph of {type(model).__name__} than rank 0 did ({mine} against "
            f"{captured}): its forward depends on something that differs between processes, most often Python's "
            "hash order (a set iterated in forward, as transformers' ModernBERT does with its layer types); start "
            "every rank with the same PYTHONHASHSEED, e.g. PYTHONHASHSEED=0 torchrun ...")


def _checked(resolved: Plan, model: nn.Module, graph: Any, world: int, precision: str,
             mixed_precision: str | None, memory_limit: float | None, compression: str | None, delay: int) -> Plan:
    """The plan checked against this rank's model and the job, with the caller's gradient choices
    (a model that could not be captured has no graph to check it against)."""
    if graph is not None:
        resolved.check_graph(graph.fingerprint())
        resolved.check_placements(graph, {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)})
    if mixed_precision is not None:
        resolved.check_precision(precision)
    if memory_limit is not None and resolved.estimate is not None and resolved.estimate.peak_memory_bytes > memory_limit:
        raise AutoparError(f"the plan {resolved.name} predicts {human_bytes(resolved.estimate.peak_memory_bytes)} per "
                           f"device, over the memory limit of {human_bytes(memory_limit)}: plan with the limit "
                           "(autopar plan --memory-limit), or pass no plan and let the search keep to it")
    if resolved.num_devices != world:
        raise AutoparError(f"the plan runs on {resolved.num_devices} devices, the job has {world} ranks")
    if compression not in (None, "auto") or delay:  # the caller's choice overrides the plan's
        resolved = dataclasses.replace(resolved, dp_gradient={
            **resolved.dp_gradient, "compression": resolved.dp_gradient.get("compression") if compression == "auto"
            else parse(compression).canonical() if compression else None, "delay": delay})
    if (resolved.dp_gradient.get("compression") or resolved.dp_gradient.get("delay")) and resolved.precision == "fp16":
        raise AutoparError("fp16 scales the loss, and compressors and delayed averaging keep gradients across steps "
                           "(error feedback, averages in flight), where a scaled or overflowed one would stay: use bf16 "
                           "mixed precision with compression or delayed averaging")
    if (resolved.dp_gradient.get("compression") or resolved.dp_gradient.get("delay")) and (
            zero3(resolved) or any(s.zero for s in resolved.stages)):
        raise AutoparError("compression and delayed averaging work on replicated gradients; this plan shards them "
                           "over the data axis (ZeRO): use a plan without S(0) parameters or stage zero levels")
    return resolved


def _build(resolved: Plan, model: nn.Module, args: tuple, loss_fn: Callable | None, optimizer: Callable | None,
           max_grad_norm: float | None, device: torch.device, compile: bool = False, batch: str = "local") -> Any:
    """The model built under the plan on this rank (every rank together)."""
    _start_equal(model.to(device))
    try:
        if len(resolved.stages) > 1:
            pm = PipelineModel(model, resolved, loss_fn, optimizer, args, device=device, max_grad_norm=max_grad_norm,
                               compile=compile)
        else:
            pm = ParallelModel(model, resolved, loss_fn, optimizer, args, device=device, max_grad_norm=max_grad_norm,
                               compile=compile, batch=batch)
    except UnsupportedPlan as exc:
        raise AutoparError(str(exc)) from None
    return pm


def _is_layout(plan: Any) -> bool:
    """A layout "DP,TP,PP[,MB][+...]" (else a Plan, or a path to plan JSON)."""
    return isinstance(plan, str) and not plan.endswith(".json")


def _capture_or_why(model: nn.Module, args: tuple, plan: Any, tune: int) -> tuple[Any, CaptureError | None]:
    """The model's graph; or, where `torch.export` cannot capture it and the caller asked for no
    plan or a data-parallel layout, None and why (`uncaptured_plan` then runs it without one)."""
    try:
        return capture(model, args), None
    except CaptureError as exc:
        if tune or not (plan is None or _is_layout(plan)):
            raise
        return None, exc


def _mesh_shape(mesh: DeviceMesh | tuple[int, int] | None, world: int) -> tuple[int, int]:
    """(hosts, devices per host) of the mesh the caller gave, checked against the job."""
    if isinstance(mesh, DeviceMesh):
        if mesh.ndim != 2 or mesh.size() != world:
            raise AutoparError(f"mesh must be a 2-D DeviceMesh (hosts × devices) over all {world} ranks, got "
                               f"shape {tuple(mesh.shape)}: init_device_mesh(device, (hosts, devices per host))")
        return tuple(mesh.shape)
    if mesh is None:
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))  # torchrun's ranks per host
        return max(1, world // per_node), min(per_node, world)
    return mesh


def _resolve(plan, model, args, batch, graph, cluster, mesh, compression, delay, precision, memory_limit,
             one_stage: bool = False) -> Plan:
    """The plan given, loaded or searched (`one_stage`: without a loss to run between stages)."""
    if isinstance(plan, Plan) or isinstance(plan, Path) or isinstance(plan, str) and not _is_layout(plan):
        given = plan if isinstance(plan, Plan) else Plan.load(plan)
        if one_stage and len(given.stages) > 1:
            raise AutoparError(f"the plan {given.name} is a pipeline of {len(given.stages)} stages, whose schedule runs "
                               "the loss between them: pass loss_fn (and optimizer) and train with pm.step(inputs, "
                               "target), or use a one-stage plan")
        return given
    search = _search(model, args, batch, graph, cluster, mesh, delay, precision, memory_limit)

    if plan is not None:
        layout = Layout.parse(str(plan))
        return plan_compressed(search, compression, lambda s: manual_plan(manual_search(s), layout))
    return plan_compressed(search, compression, partial(plan_auto, stages=1) if one_stage else plan_auto)


def _search(model, args, batch, graph, cluster, mesh, delay, precision, memory_limit):
    spec = get_cluster(cluster or "cpu-local")
    if cluster is None:  # more local ranks than cores: they share them
        spec = spec.with_ranks(mesh[1])
    workload = Workload(type(model).__name__, model, args, batch)
    # delayed averaging, like compression, needs gradients replicated on the data axis (no ZeRO-3)
    return Search.start(workload, spec, mesh, graph=graph, rule=REPLICATED_GRADIENTS if delay else None,
                        precision=precision, memory_limit=memory_limit, schedule="auto")  # as `autopar plan` searches


def _candidates(model, args, batch, graph, cluster, mesh, precision, memory_limit, k: int) -> list[Plan]:
    search = _search(model, args, batch, graph, cluster, mesh, None, precision, memory_limit)
    return candidates(search, k)


def _tuned(plans: list[Plan], model: nn.Module, args: tuple, target: torch.Tensor, loss_fn: Callable,
           optimizer: Callable, max_grad_norm: float | None) -> Plan:
    """Each candidate built on a copy of the model and timed for a few steps on every rank (the
    slowest rank's median); the measured fastest, with every measurement recorded."""
    import copy


    device = local_device(int(os.environ.get("LOCAL_RANK", dist.get_rank())))
    measured = []
    for candidate in plans:
        trial = copy.deepcopy(model).to(device)
        _start_equal(trial)
        kind = PipelineModel if len(candidate.stages) > 1 else ParallelModel
        pm = kind(trial, candidate, loss_fn, optimizer, args, device=device, max_grad_norm=max_grad_norm)
        measured.append(time_steps(pm, lambda: (args, target), warmup=1, steps=3))
        del pm, trial
        gc.collect()
    return choose(plans, measured)


def _start_equal(model: nn.Module) -> None:
    """Every rank starts from rank 0's parameters and buffers, as DDP does at construction: scripts
    build the model on every rank, and without a shared seed the replicas would train apart."""
    if dist.get_world_size() == 1:
        return
    from torch.distributed.utils import _sync_module_states

    _sync_module_states(model, dist.group.WORLD, 250 * 1024 * 1024, 0, set())


def _init_process_group(backend: str) -> None:
    """Join the torchrun job, or become a job of one when launched as a plain script."""
    atexit.unregister(_destroy_at_exit)  # once, however often parallelize is called
    atexit.register(_destroy_at_exit)
    if dist.is_initialized():
        return
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group(group_backend(backend))
        return

    keep_to_loopback()  # one process: a store in memory, no listening port
    dist.init_process_group(group_backend(backend), store=dist.HashStore(), rank=0, world_size=1)


_BUILT: weakref.WeakSet = weakref.WeakSet()  # the models parallelize returned, emptied at exit


def _destroy_at_exit() -> None:
    """A script that ends without `destroy_process_group` leaves gloo's worker threads holding work
    (and its tensors) while the interpreter tears down, which aborts the process now and then with
    `terminate called without an active exception` (pytorch/pytorch#190489; a 4-rank gloo job doing
    that crashed in 59 of 200 runs, none of 100 with the groups destroyed: benchmarks/repeat_jobs.py).
    The groups are destroyed, and the models `parallelize` built (which hold them) emptied, while
    the interpreter is whole, also where the script destroyed the groups itself (a model in a
    reference cycle, as a lowered program's, outlives its function and still holds them). gloo
    only: NCCL's teardown may wait for peers that are already gone."""
    if dist.is_initialized():
        if dist.get_backend() != "gloo":
            return
        dist.destroy_process_group()
    for pm in list(_BUILT):  # their process groups, meshes and DTensors: freed while the interpreter is whole
        vars(pm).clear()
    gc.collect()
