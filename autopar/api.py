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
from autopar.cost_models.compression import compressed_params
from autopar.planner.auto import plan_auto
from autopar.planner.capture import capture
from autopar.planner.manual import Layout, manual_plan, manual_search, uncaptured_plan
from autopar.planner.plan_cache import asked, cached
from autopar.planner.search import Search, plan_compressed, warn_unmeasured
from autopar.planner.strategy_costs import REPLICATED_GRADIENTS
from autopar.planner.tune import candidates, choose
from autopar.planner.unruled import warn_replicated
from autopar.runtime import default_backend, local_device
from autopar.runtime.backend import group_backend, keep_to_loopback
from autopar.runtime.failures import PeerFailed, agreed, collective_failures, set_timeouts, told
from autopar.runtime.loop import time_steps
from autopar.runtime.memory import hold_to
from autopar.runtime.parallel import ParallelModel, UnsupportedPlan
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
    - `mesh`: the devices to run on, in the order the plan takes them (its process groups are
      made of the mesh's ranks in that order): a DeviceMesh over the job, unnamed (2-D: hosts ×
      devices; 1-D: split into hosts by torchrun's LOCAL_WORLD_SIZE) or with axes named from
      ("pp", "dp", "tp"), which pins those sizes (absent axes are 1) as the layout "dp,tp,pp"
      would; a `(hosts, devices)` tuple; or None: the job's hosts × local ranks.
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
      `torch.compile` each, as torchtitan does, so gradient buckets overlap the backward. `step`
      runs `loss_fn` compiled too (torchtitan's loss component: the cross entropy's passes over
      the logits fused).

    Returns a `ParallelModel` (one stage: an `nn.Module`) or a `PipelineModel` (several: `step` only).

    Raises `AutoparError` (on every rank, with one message) for input it cannot take: a malformed
    argument, a layout the model or the ranks cannot run, a plan for another model, world size or
    precision, a model `torch.export` cannot capture under a layout other than data parallelism;
    `PeerFailed` when another rank failed while planning or building (naming it and its message).
    """
    request = _Request(model, example_inputs, plan, cluster, compression, delay, timeout, max_grad_norm,
                       parse_precision(mixed_precision), mixed_precision, memory_limit, tune, example_target,
                       compile, batch, loss_fn, optimizer)
    request.check()
    world, device = _join_job()
    job = _job_mesh(mesh, world)
    request.plan = job.pinned(request.plan)
    args = as_args(model.forward, example_inputs, "example_inputs")
    resolved, scope, graph = _plan_on_rank0(request, args, job, world)
    with collective_failures("building the model", scope):  # one rank's error is every rank's
        if tune:
            resolved = _tuned(resolved, request, args, job.ranks)
            if graph is not None:
                warn_replicated(graph, resolved)
        resolved = agreed("checking the plan", lambda: _checked(resolved, request, world))
        pm = _build(resolved, request, args, device, job.ranks)
        pm.failure_scope = scope
        if timeout is not None:
            set_timeouts(timeout)  # every group, the model's too; not before: rank 0 may plan for minutes
        if memory_limit is not None:
            hold_to(pm, memory_limit)
    _BUILT.add(pm)
    return pm


@dataclasses.dataclass
class _Request:
    """What the caller of `parallelize` asked for, besides the mesh."""

    model: nn.Module
    example_inputs: Any
    plan: Plan | str | Path | None
    cluster: str | None
    compression: str | None
    delay: int
    timeout: float | None
    max_grad_norm: float | None
    precision: str  # parsed: the planner's
    mixed_precision: str | None  # as given: None leaves the plan's
    memory_limit: float | None
    tune: int
    example_target: torch.Tensor | None
    compile: bool
    batch: str
    loss_fn: Callable | None
    optimizer: Callable | None

    def check(self) -> None:
        """Arguments refused before any process group exists (every rank refuses alike)."""
        if self.compression not in (None, "auto"):
            parse(self.compression)  # a misspelt method fails here
        if self.delay < 0:
            raise AutoparError(f"delay must be a number of steps ≥ 0, got {self.delay}")
        if self.timeout is not None and not self.timeout > 0:
            raise AutoparError(f"timeout must be a positive number of seconds, got {self.timeout}")
        if self.memory_limit is not None and not self.memory_limit > 0:
            raise AutoparError(f"memory_limit must be a positive number of bytes, got {self.memory_limit}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise AutoparError("max_grad_norm must be a positive number (math.inf: measure the norm only), got "
                               f"{self.max_grad_norm}")
        if self.batch not in ("local", "global"):
            raise AutoparError(f'batch must be "local" (this rank\'s data-parallel slice) or "global", got {self.batch!r}')
        if self.tune and (self.loss_fn is None or self.optimizer is None):
            raise AutoparError("tune=K times steps of its candidates: pass loss_fn and optimizer")
        if self.tune and (self.plan is not None or self.compression or self.delay or self.example_target is None):
            raise AutoparError("tune=K measures the free search's best layouts on a real batch: pass example_target, "
                               "and no plan, compression or delay")
        if self.loss_fn is None and _is_layout(self.plan) and Layout.parse(self.plan).pp > 1:
            raise AutoparError(f"plan {self.plan!r} is a pipeline, whose schedule runs the loss between its stages: "
                               "pass loss_fn (and optimizer) and train with pm.step(inputs, target), or choose a "
                               "layout with PP 1")


def _join_job() -> tuple[int, torch.device]:
    """The job's world size and this rank's device (the process group joined or made)."""
    _init_process_group(default_backend())  # torch's timeout while rank 0 plans; `timeout` once built
    device = local_device(int(os.environ.get("LOCAL_RANK", dist.get_rank())))
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL's object collectives and new groups use the current device
    return dist.get_world_size(), device


_AXES = ("pp", "dp", "tp")


@dataclasses.dataclass(frozen=True)
class _JobMesh:
    """The mesh the caller gave: the (hosts, devices per host) the planner prices, the ranks in
    the order the plan's devices take them (None: 0, 1, ...), and the sizes a named mesh pins."""

    shape: tuple[int, int]
    ranks: list[int] | None = None
    sizes: dict[str, int] | None = None

    def pinned(self, plan: Any) -> Any:
        """The plan a named mesh asks for: its layout (searched plans keep within its sizes), or
        the caller's plan checked against it."""
        if self.sizes is None:
            return plan
        dp, tp, pp = (self.sizes.get(a, 1) for a in ("dp", "tp", "pp"))
        if plan is None:
            return f"{dp},{tp},{pp}"
        layout = Layout.parse(plan) if _is_layout(plan) else None
        if layout is not None and (layout.dp, layout.tp, layout.pp) != (dp, tp, pp):
            raise AutoparError(f"plan {plan!r} is {layout.dp},{layout.tp},{layout.pp} (dp,tp,pp); the mesh's named "
                               f"axes pin {dp},{tp},{pp}: pass a plan of those sizes, or an unnamed mesh")
        return plan


def _job_mesh(mesh: DeviceMesh | tuple[int, int] | None, world: int) -> _JobMesh:
    """The caller's mesh read (see `parallelize`'s `mesh`), checked against the job."""
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))  # torchrun's ranks per host

    def by_hosts() -> tuple[int, int]:
        return (world // per_node, per_node) if per_node and world % per_node == 0 else (1, world)

    if mesh is None:
        return _JobMesh(by_hosts())
    if isinstance(mesh, DeviceMesh):
        if mesh.size() != world:
            raise AutoparError(f"the mesh has {mesh.size()} devices, the job has {world} ranks: give a DeviceMesh over "
                               f"every rank, e.g. init_device_mesh(device, ({world},))")
        names = mesh.mesh_dim_names
        if names is None:
            if mesh.ndim > 2:
                raise AutoparError(f"an unnamed {mesh.ndim}-D mesh: name its axes from {_AXES} "
                                   "(init_device_mesh(..., mesh_dim_names=...)), or give hosts × devices")
            shape = tuple(mesh.shape) if mesh.ndim == 2 else by_hosts()
            return _JobMesh(shape, mesh.mesh.flatten().tolist())
        unknown = [n for n in names if n not in _AXES]
        if unknown or len(set(names)) < len(names):
            raise AutoparError(f"mesh axes {list(names)}: name each of them once, from {_AXES} (absent axes are 1), "
                               "or give an unnamed mesh (hosts × devices) for the search to lay out")
        order = [names.index(a) for a in _AXES if a in names]  # the plan takes devices pp-major, then dp, tp
        return _JobMesh(by_hosts(), mesh.mesh.permute(order).flatten().tolist(), dict(zip(names, mesh.shape)))
    if (not isinstance(mesh, (tuple, list)) or len(mesh) != 2
            or not all(isinstance(x, int) and x > 0 for x in mesh)):
        raise AutoparError(f"mesh must be a DeviceMesh, a (hosts, devices per host) pair of positive ints or None, "
                           f"got {mesh!r}")
    if mesh[0] * mesh[1] != world:
        raise AutoparError(f"mesh {mesh[0]}x{mesh[1]} has {mesh[0] * mesh[1]} devices, the job has {world} ranks: "
                           f"launch with torchrun --nproc-per-node {mesh[0] * mesh[1]}, or pass mesh=(1, {world})")
    return _JobMesh(tuple(mesh))


def _plan_on_rank0(request: _Request, args: tuple, job: _JobMesh, world: int) -> tuple[Any, str, Any]:
    """Rank 0 captures the model and plans (or loads, or makes the candidates to tune), checking
    the plan against the graph; every rank gets its plan and the scope of this model's failures,
    rank 0 the graph too (None elsewhere). The other ranks do not capture: each exports the model
    again at the shape it runs, and the runtime checks those exports are rank 0's
    (`runtime.export.same_on_every_rank`)."""
    model, plan, precision = request.model, request.plan, request.precision
    size = next(a.shape[0] for a in args if isinstance(a, torch.Tensor))
    chosen: list[Any] = [None, uuid.uuid4().hex[:12]]
    failed: BaseException | None = None
    graph = None
    if dist.get_rank() == 0:
        try:
            graph, uncaptured = _capture_or_why(model, args, plan, request.tune)
            if uncaptured is not None:
                chosen[0] = uncaptured_plan(type(model).__name__, [n for n, _ in model.named_parameters()], size,
                                            world, job.shape, request.cluster or "cpu-local",
                                            Layout.parse(plan) if _is_layout(plan) else None, str(uncaptured),
                                            precision)
                log.warning("%s trains data-parallel without its graph (every rank runs the whole model on its "
                            "samples, as DDP does), because %s", type(model).__name__, uncaptured)
            elif request.tune:
                chosen[0] = _candidates(model, args, size, graph, request.cluster, job.shape, precision,
                                        request.memory_limit, request.tune)
            else:
                chosen[0] = _resolve(plan, model, args, size, graph, request.cluster, job.shape, request.compression,
                                     request.delay, precision, request.memory_limit,
                                     one_stage=request.loss_fn is None)
            if graph is not None:
                for p in chosen[0] if isinstance(chosen[0], list) else [chosen[0]]:
                    _fits_graph(p, model, graph)
            if isinstance(chosen[0], Plan) and graph is not None:
                warn_replicated(graph, chosen[0])
        except Exception as exc:  # every rank reports it, none waits for a plan that never comes
            failed, chosen[0] = exc, PeerFailed(0, "planning", *told(exc))
    dist.broadcast_object_list(chosen, src=0)
    if failed is not None:
        raise failed
    if isinstance(chosen[0], PeerFailed):
        raise AutoparError(chosen[0].message) if chosen[0].user else chosen[0]  # a user's error: the same words
    return chosen[0], chosen[1], graph


def _fits_graph(plan: Plan, model: nn.Module, graph: Any) -> None:
    """The plan is for this graph, and its parameters' placements fit the model's parameters."""
    plan.check_graph(graph.fingerprint())
    plan.check_placements(graph, {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)})


def _checked(resolved: Plan, request: _Request, world: int) -> Plan:
    """The plan checked against the job, with the caller's gradient choices (against the graph:
    `_fits_graph`, on rank 0)."""
    compression, delay, memory_limit = request.compression, request.delay, request.memory_limit
    if request.mixed_precision is not None:
        resolved.check_precision(request.precision)
    if memory_limit is not None and resolved.estimate is not None and resolved.estimate.peak_memory_bytes > memory_limit:
        raise AutoparError(f"the plan {resolved.name} predicts {human_bytes(resolved.estimate.peak_memory_bytes)} per "
                           f"device, over the memory limit of {human_bytes(memory_limit)}: plan with the limit "
                           "(autopar plan --memory-limit), or pass no plan and let the search keep to it")
    if resolved.num_devices != world:
        raise AutoparError(f"the plan runs on {resolved.num_devices} devices, the job has {world} ranks")
    if request.loss_fn is None and len(resolved.stages) > 1:
        raise AutoparError(f"the plan {resolved.name} is a pipeline of {len(resolved.stages)} stages, whose schedule "
                           "runs the loss between them: pass loss_fn (and optimizer) and train with pm.step(inputs, "
                           "target), or use a one-stage plan")
    if compression not in (None, "auto") or delay:  # the caller's choice overrides the plan's, validated as a
        # plan file is: which features combine is the rule book's (`contract.compat`)
        resolved = resolved.with_gradient(
            compression=resolved.dp_gradient.get("compression") if compression == "auto"
            else parse(compression).canonical() if compression else None, delay=delay)
        text = resolved.dp_gradient.get("compression")
        if text and resolved.dp_gradient.get("compressed") is None:  # a compressor the plan was not priced with
            shapes = {n: tuple(p.shape) for n, p in request.model.named_parameters() if p.requires_grad}
            resolved = resolved.with_gradient(compressed=compressed_params(
                parse(text), resolved.stages, shapes, get_cluster(request.cluster or "cpu-local")))
    warn_unmeasured(resolved, sum(p.numel() for p in request.model.parameters() if p.requires_grad))
    return resolved


def _build(resolved: Plan, request: _Request, args: tuple, device: torch.device, ranks: list[int] | None) -> Any:
    """The model built under the plan on this rank (every rank together)."""
    model = request.model
    _start_equal(model.to(device))
    try:
        if len(resolved.stages) > 1:
            if ranks is not None and ranks != list(range(len(ranks))):
                raise UnsupportedPlan("a pipeline runs its stages on the job's ranks in order; this mesh orders them "
                                      "otherwise: pass a mesh in rank order, or None")
            pm = PipelineModel(model, resolved, request.loss_fn, request.optimizer, args, device=device,
                               max_grad_norm=request.max_grad_norm, compile=request.compile)
        else:
            pm = ParallelModel(model, resolved, request.loss_fn, request.optimizer, args, device=device,
                               max_grad_norm=request.max_grad_norm, compile=request.compile, batch=request.batch,
                               ranks=ranks)
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


def _resolve(plan, model, args, batch, graph, cluster, mesh, compression, delay, precision, memory_limit,
             one_stage: bool = False) -> Plan:
    """The plan given, loaded or searched (`one_stage`: without a loss to run between stages)."""
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, Path) or isinstance(plan, str) and not _is_layout(plan):
        return Plan.load(plan)
    search = _search(model, args, batch, graph, cluster, mesh, delay, precision, memory_limit)

    if plan is not None:
        layout = Layout.parse(str(plan))
        return cached(search, asked(layout, None, compression),
                      lambda: plan_compressed(search, compression, lambda s: manual_plan(manual_search(s), layout)))
    return cached(search, asked(None, 1 if one_stage else None, compression),
                  lambda: plan_compressed(search, compression, partial(plan_auto, stages=1) if one_stage else plan_auto))


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


def _tuned(plans: list[Plan], request: _Request, args: tuple, ranks: list[int] | None) -> Plan:
    """Each candidate built on a copy of the model and timed for a few steps on every rank (the
    slowest rank's median); the measured fastest, with every measurement recorded."""
    import copy

    device = local_device(int(os.environ.get("LOCAL_RANK", dist.get_rank())))
    measured = []
    for candidate in plans:
        trial = copy.deepcopy(request.model).to(device)
        _start_equal(trial)
        kind, extra = (PipelineModel, {}) if len(candidate.stages) > 1 else (ParallelModel, {"ranks": ranks})
        pm = kind(trial, candidate, request.loss_fn, request.optimizer, args, device=device,
                  max_grad_norm=request.max_grad_norm, **extra)
        measured.append(time_steps(pm, lambda: (args, request.example_target), warmup=1, steps=3))
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
