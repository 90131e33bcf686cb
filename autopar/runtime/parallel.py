"""Run a one-stage Plan's training step on torch.distributed (pipelines: `runtime.pipeline`).

Ranks form a (dp, tp) mesh, tp innermost (a tensor-parallel group shares a host, as the planner
assumes). The global batch is cut into this rank's data-parallel slice and into the plan's
microbatches; gradients are averaged over the data axis by `GradSync` (plans with `R` parameters
on it) or by FSDP2's `fully_shard` (`S(0)`: ZeRO-3; a stage's `zero` 1 or 2: ZeRO-1/2). With a tensor axis the model runs as its
exported graph with the plan's placements (`runtime.sharded_graph`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map_only

from autopar.contract.compat import plan_refusal
from autopar.contract.compression import carries_momentum, parse, runs_dense
from autopar.contract.errors import AutoparError
from autopar.contract.export import first_tensor
from autopar.contract.inputs import as_args
from autopar.contract.placements import Shard
from autopar.contract.plan import Plan, StagePlan
from autopar.contract.precision import PRECISIONS
from autopar.runtime import rng
from autopar.runtime.breakdown import phase
from autopar.runtime.buffers import AveragedBuffers, persistent
from autopar.runtime.comm_count import CollectiveBytes
from autopar.runtime.compression import Compressed, momentum_memory
from autopar.runtime.delayed import DelayedSync
from autopar.runtime.export import export_as_planned, export_standing_in, same_on_every_rank
from autopar.runtime.failures import guarded
from autopar.runtime.grad_sync import EmulatedLink, GradSync
from autopar.runtime.loop import clip, evaluating, gather_batch_dim, squared_grad_norm
from autopar.runtime.lower import NotAsPlanned, Segmented, StageBytes, lower, lower_now, programs
from autopar.runtime.precision import fsdp_policy, mixed_precision
from autopar.runtime.sharded_graph import (
    OpFailed,
    ShardedGraph,
    defer_partial_grads,
    first_failure,
    reduce_partial_grads,
)

log = logging.getLogger(__name__)


class UnsupportedPlan(ValueError):
    """A plan this runtime cannot execute yet (the message says which part)."""


def refuse_failing(module: ShardedGraph, inputs: tuple) -> None:
    """A model the runtime cannot run under this plan is refused when it is built, on every rank,
    naming the op and the model's line, rather than at the first step. A stage lowered layer by
    layer (ZeRO), traced only at its first step, runs its forward interpreted now, before FSDP2
    wraps it (`first_failure`); the others are checked by `build_checked`. A collective: every rank
    calls it, once per stage it holds."""
    failed = first_failure(module, inputs, run=isinstance(module.program, Segmented))
    if failed is not None:
        raise UnsupportedPlan(f"the runtime cannot run this model under the plan: {failed}")


def build_checked(module: ShardedGraph, inputs: tuple) -> None:
    """Trace the stage's training program now (`lower_now`: its forward run once and checked against
    the plan) and refuse, on every rank, a model whose op fails under the plan (the trace falls
    back to the interpreter, where the op fails again), or whose program is not the plan that was
    priced. A collective, as `refuse_failing`."""
    failed = None
    try:
        lower_now(module, inputs)
    except OpFailed as exc:
        failed = f"the runtime cannot run this model under the plan: {exc}"
    except NotAsPlanned as exc:
        first, end = module.stage.layers
        failed = (f"the stage of layers {first}–{end - 1}: {exc}. The program that would run is not the one the planner "
                  "priced, autopar's error, not the model's: please report it with the model; another layout "
                  "(plan=...) may avoid it")
    said: list = [None] * dist.get_world_size()
    dist.all_gather_object(said, failed)
    failed = next((f for f in said if f is not None), None)
    if failed is not None:
        raise UnsupportedPlan(failed)


def data_sharded(stage: StagePlan, dp: int) -> bool:
    """Whether FSDP2 shards the stage's parameters over its data axis: ZeRO-3 (S(0) there) or the
    stage's ZeRO-1/2."""
    return dp > 1 and (bool(stage.zero) or any(p[0] == Shard(0) for p in stage.params.values()))


def shard_data_axis(module: nn.Module, mesh: Any, precision: str | None, zero: int | None = None,
                    offload: bool | None = None) -> list[nn.Parameter]:
    """ZeRO-3 through FSDP2: each layer's unit (`ShardedGraph.units`) gathered for its forward and
    again for its backward, then freed, so a step holds about one layer's whole parameters; the
    rest (weights several layers share) in the root unit. Units take their inputs as they come
    (autocast decides the dtypes), the root casts the stage's inputs as FSDP2 does. `zero` 1 or 2
    (ZeRO-1/2): the units are not freed after forward, and the step keeps them gathered until its
    last backward (`keep_gathered`): one all-gather per step; each unit's gradients are still
    reduce-scattered as its backward ends, overlapping the layers before it. `offload`: the
    sharded parameters, gradients and optimizer states in host memory (`CPUOffloadPolicy`, pinned
    where there is an accelerator to copy to; on a CPU the copies are to itself). Scalar parameters
    (CLIP's logit scale), which FSDP2 cannot shard, stay whole on every rank: returned, for the
    step to average their gradients (`average_grads`)."""
    import warnings

    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    # the graph's values are never changed in place (export is functional): a view returned from a
    # unit keeps FSDP2's pre-backward hook
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    reshard = not zero
    host = {"offload_policy": CPUOffloadPolicy(pin_memory=torch.cuda.is_available())} if offload else {}
    scalars = [p for p in module.parameters() if p.dim() == 0]
    host["ignored_params"] = set(scalars)
    for unit in getattr(module, "units", ()):
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard, **fsdp_policy(precision, cast_inputs=False), **host)
    fully_shard(module, mesh=mesh, reshard_after_forward=reshard, **fsdp_policy(precision), **host)
    return scalars


@contextlib.contextmanager
def model_holds_shards(model: nn.Module, trained: nn.Module) -> Any:
    """Around `fully_shard(trained ...)`: the model's parameters afterwards are the shards FSDP2
    registered in their place (what its state dict, `parameters()` and an optimizer see), as
    they are where the model itself is the module FSDP2 shards."""
    where: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                where.setdefault(id(p), []).append((module, name))
    homes = [(module, name, p) for module in trained.modules() for name, p in module._parameters.items()
             if p is not None]
    yield
    for module, name, before in homes:
        after = module._parameters[name]
        for owner, attr in where.get(id(before), []):
            owner._parameters[attr] = after


def compile_blocks(model: nn.Module) -> int:
    """`torch.compile` each repeated block (the elements of the model's outermost `ModuleList`s,
    as torchtitan compiles each transformer block), in place; the whole model where it has none.
    One compiled backward per block lets the data axis's gradient buckets launch as each block's
    backward ends: compiling the whole model makes one backward node, and every bucket waits for
    it (measured 1.03x DDP's step on gpt-small). Identical blocks share one compiled graph.
    Returns how many modules were compiled."""
    lists = [name for name, m in model.named_modules() if isinstance(m, nn.ModuleList)]
    outer = [name for name in lists if not any(name.startswith(o + ".") for o in lists if o)]
    blocks = [block for name in outer for block in model.get_submodule(name)] or [model]
    for block in blocks:
        block.compile()
    return len(blocks)


def compile_loss(loss_fn: Callable) -> Callable:
    """The step's loss under `torch.compile`, as torchtitan compiles its loss beside its blocks:
    inductor fuses a cross entropy's log-softmax, gather and their gradients into a pass or two
    over the logits (on gpt-small's 8192-word vocabulary, 5 % of a step on one CPU core:
    measured). A loss dynamo cannot trace runs op by op where it cannot (graph breaks)."""
    return torch.compile(loss_fn)


def average_grads(params: list[nn.Parameter], group: dist.ProcessGroup) -> None:
    """Each gradient averaged over `group` (the data axis), in place: a rank without one adds zeros,
    and a parameter no rank has a gradient for keeps none, as on one process (the optimizer skips it)."""
    if not params:
        return
    have = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=params[0].device)
    dist.all_reduce(have, group=group)
    for p, any_rank in zip(params, have.tolist()):
        if not any_rank:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        dist.all_reduce(grad, group=group)
        grad /= dist.get_world_size(group)


def keep_gathered(module: nn.Module, zero: int | None, last: bool) -> None:
    """Before a microbatch of a ZeRO-1/2 stage (FSDP2, one-stage plans: torch's pipeline schedules
    do this themselves): keep the parameters gathered after its backward unless it is the step's
    last; ZeRO-1 also keeps its whole gradients and reduce-scatters them after the last only
    (fewer collectives), ZeRO-2 reduce-scatters every microbatch's (less memory)."""
    if zero in (1, 2):
        module.set_reshard_after_backward(last)
        if zero == 1:
            module.set_requires_gradient_sync(last)


def check_batch(inputs: Any, plan: Plan, dp: int | None = None) -> None:
    """The batch a step gets must be the one the plan was made for (it fixes the shapes): the
    global batch, or with `dp` a data-parallel slice of it (`step(..., local=True)`)."""
    first = next((t for t in (inputs if isinstance(inputs, (tuple, list)) else (inputs,))
                  if isinstance(t, torch.Tensor)), None)
    if first is None:
        return
    if dp is None and first.shape[0] != plan.batch:
        raise AutoparError(f"step got a batch of {first.shape[0]} samples, the plan was made for {plan.batch}: "
                           f"pass batches of {plan.batch}, or re-plan for this batch")
    if dp is not None and first.shape[0] != plan.batch // dp:
        raise AutoparError(f"step(local=True) got {first.shape[0]} samples, this rank's data-parallel slice of the "
                           f"plan's batch {plan.batch} is {plan.batch // dp}: pass that many, or the global batch")


def by_model_name(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """`module`'s parameters under the model's names (a lowered graph's own spell them otherwise:
    `model_names`), as plans name them."""
    names = module.model_names() if hasattr(module, "model_names") else {}
    return [(names.get(n, n), p) for n, p in module.named_parameters()]


def data_sync(named: list[tuple[str, nn.Parameter]], group: dist.ProcessGroup, plan: Plan) -> Any:
    """The data-parallel synchroniser the plan's `dp_gradient` asks for: bucketed all-reduce,
    through a compressor (the gradients it names in `compressed`: the others dense), or delayed
    averaging. `AUTOPAR_EMULATE_LINK="latency_s[,bytes_per_s]"`
    makes its results wait as on a slower link (benchmarks; `EmulatedLink`)."""
    import os


    gradient = plan.dp_gradient or {}
    link = None
    if os.environ.get("AUTOPAR_EMULATE_LINK"):
        text = os.environ["AUTOPAR_EMULATE_LINK"]
        try:
            values = [float(v) for v in text.split(",")]
        except ValueError:
            values = []
        if not 1 <= len(values) <= 2 or not all(0 <= v < float("inf") for v in values) or 0 in values[1:]:
            raise UnsupportedPlan(f"AUTOPAR_EMULATE_LINK={text[:40]!r}: write latency_s[,bytes_per_s], finite "
                                  "non-negative numbers, e.g. 0.1 or 0.05,1e9")
        link = EmulatedLink(*values)
    why = plan_refusal(plan)  # (a plan built in memory, not validated as a file is)
    if why:
        raise UnsupportedPlan(why)
    params = [p for _, p in named]
    if gradient.get("delay"):
        return DelayedSync(params, group, int(gradient["delay"]), link=link)
    compressed = travels = momentum = None
    spec = parse(gradient["compression"]) if gradient.get("compression") else None
    if spec is not None and runs_dense(spec, gradient.get("compressed") != []):
        momentum = momentum_memory(spec, dist.get_world_size(group)) if carries_momentum(spec) else None
    elif spec is not None:
        compressed = Compressed(gradient["compression"], group)
        if gradient.get("compressed") is not None:
            listed = set(gradient["compressed"])
            travels = {p: name in listed for name, p in named}
    return GradSync(params, group, compressed=compressed, link=link, travels=travels, momentum=momentum)


def check_optimizer(optimizer: torch.optim.Optimizer, plan: Plan) -> None:
    """A compressor that carries the momentum (DGC's momentum correction, 1-bit SGD's compressed
    momentum) and an optimizer with its own would apply it twice."""
    text = (plan.dp_gradient or {}).get("compression")
    if not text or not any(g.get("momentum", 0) for g in optimizer.param_groups):
        return

    spec = parse(str(text))
    if carries_momentum(spec):
        raise AutoparError(
            f"compression {spec.canonical()} carries the momentum itself: build the optimizer without momentum "
            "(set the compressor's with ,momentum=M)" + ("; onebit,momentum=0 is Seide's 1-bit SGD on the gradient "
                                                        "beside the optimizer's momentum, which diverges at large steps"
                                                        if spec.method == "onebit" else ""))


def on_device(batch: Any, device: torch.device) -> Any:
    """Every tensor of `batch` on the rank's device (as DDP moves a single-device module's inputs):
    data loaders and `make_batch` produce CPU tensors."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (tuple, list)):
        return type(batch)(on_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: on_device(v, device) for k, v in batch.items()}
    return batch


def _split(batch: Any, parts: int, index: int) -> Any:
    """Slice `index` of `parts` along dim 0 of every tensor in `batch` (tuples and dicts kept)."""
    if isinstance(batch, torch.Tensor):
        return batch.tensor_split(parts)[index]
    if isinstance(batch, (tuple, list)):
        return type(batch)(_split(b, parts, index) for b in batch)
    if isinstance(batch, dict):
        return {k: _split(v, parts, index) for k, v in batch.items()}
    return batch


def device_mesh(device_type: str, ranks: list[int] | None, dp: int, tp: int) -> Any:
    """The ("dp", "tp") mesh of a one-stage plan: the plan's devices are `ranks` in order (the
    caller's mesh; None: the job's ranks in order), so its data and tensor groups are the ranks
    that mesh groups together. torch's process groups hold their ranks in ascending order, and
    DTensor places shards by mesh coordinate: within each group the ranks are laid out ascending,
    which every grid of ranks allows unless its rows and columns cross (refused: DTensor would
    join shards out of order)."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if ranks is None or ranks == list(range(dp * tp)):
        return init_device_mesh(device_type, (dp, tp), mesh_dim_names=("dp", "tp"))
    grid = torch.tensor(ranks).reshape(dp, tp)
    rows = sorted((set(r) for r in grid.tolist()), key=min)  # the tensor groups
    columns = sorted((set(c) for c in grid.t().tolist()), key=min)  # the data-parallel groups
    laid = [[(row & column).pop() for column in columns] for row in rows]
    if any(r != sorted(r) for r in laid) or any(list(c) != sorted(c) for c in zip(*laid)):
        raise UnsupportedPlan(f"the mesh groups ranks {[sorted(r) for r in rows]} on the tensor axis and "
                              f"{[sorted(c) for c in columns]} on the data axis; torch orders each process group's "
                              "ranks ascending, and no grid keeps these groups in that order on both axes: regroup "
                              "the mesh's ranks")
    if laid == torch.arange(dp * tp).reshape(dp, tp).tolist():  # the same groups as the job's order
        return init_device_mesh(device_type, (dp, tp), mesh_dim_names=("dp", "tp"))
    return DeviceMesh(device_type, laid, mesh_dim_names=("dp", "tp"))


def _batch_size(args: tuple) -> int | None:
    return next((x.shape[0] for x in args if isinstance(x, torch.Tensor) and x.dim() > 0), None)


class _AtBackwardEnd(torch.autograd.Function):
    """The identity, whose backward hands `then` to autograd to run once the whole backward has
    ended (DDP's final callback): every gradient of the step is accumulated by then."""

    @staticmethod
    def forward(ctx: Any, then: Callable[[], None], x: torch.Tensor) -> torch.Tensor:
        ctx.then = then
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        ctx.then()
        return None, grad


class _GatheredRows(torch.autograd.Function):
    """Each tensor-parallel rank's rows of a batch, joined in rank order on every rank; backward
    keeps this rank's rows of the gradient: every rank of the group computes the same loss on the
    joined batch, so each gradient row is already whole (no sum over the ranks)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, rows: list[int]) -> torch.Tensor:
        rank, widest = dist.get_rank(group), max(rows)
        ctx.start, ctx.rows = sum(rows[:rank]), rows[rank]
        padded = torch.zeros((widest, *x.shape[1:]), dtype=x.dtype, device=x.device)
        padded[: x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in rows]
        dist.all_gather(parts, padded, group=group)
        return torch.cat([part[:n] for part, n in zip(parts, rows)])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return grad[ctx.start: ctx.start + ctx.rows], None, None


class ParallelModel(nn.Module):
    """The model under a one-stage plan, as a module a training loop calls (as it would DDP):
    `out = pm(*inputs)` on this rank's data-parallel slice (or with `batch="global"` the global
    batch), `loss.backward()` synchronising the gradients as the plan says once the backward ends,
    `pm.parameters()` (the model's own names in `named_parameters`) for any optimizer, `no_sync()`
    for gradient accumulation. `step(inputs, target)` runs a whole step on the global batch (with
    the `loss_fn` and `optimizer` given to `parallelize`).

    Attributes a training loop uses: `optimizer` (with `optimizer=`: the torch optimizer over this
    rank's parameters, schedulers work on it), `plan`, `data_parallel_rank` and
    `data_parallel_size` (for a `DistributedSampler`), `last_grad_norm` (with `max_grad_norm`)."""

    def __init__(self, model: nn.Module, plan: Plan, loss_fn: Callable | None = None,
                 optimizer: Callable | None = None, example_inputs: tuple = (), device: torch.device | None = None,
                 max_grad_norm: float | None = None, compile: bool = False, batch: str = "local",
                 ranks: list[int] | None = None) -> None:
        super().__init__()
        if batch not in ("local", "global"):
            raise UnsupportedPlan(f'batch must be "local" (this rank\'s data-parallel slice) or "global", got {batch!r}')
        self.plan, self.max_grad_norm, self.batch = plan, max_grad_norm, batch
        self.loss_fn = compile_loss(loss_fn) if compile and loss_fn is not None else loss_fn
        self.last_grad_norm: float | None = None
        self.dp, self.tp = plan.stages[0].logical_mesh
        if dist.get_world_size() != self.dp * self.tp:
            raise UnsupportedPlan(f"the plan needs {self.dp * self.tp} ranks, the job has {dist.get_world_size()}")
        device = self.device = device or torch.device("cpu")
        mesh = device_mesh(device.type, ranks, self.dp, self.tp)
        self.group, self.tp_group = mesh.get_group("dp"), mesh.get_group("tp")
        self.rank, self.tp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
        self.data_parallel_rank, self.data_parallel_size = self.rank, self.dp  # for a DistributedSampler
        self.model = model.to(device)
        self.precision = mixed_precision(plan.precision, device)
        # the graph and what trains are not submodules: the module's state is the model's (`state_dict`)
        graph: ShardedGraph | None = None
        sharded = data_sharded(plan.stages[0], self.dp)
        if self.tp > 1 or plan.stages[0].recompute or sharded:  # the graph: placements, layers (to recompute, to shard)
            micro = _split(_split(example_inputs, self.dp, 0), plan.num_microbatches, 0)
            ep = export_as_planned(self.model, tuple(micro), tuple(example_inputs))  # before sharding: plain tensors
            same_on_every_rank(ep.graph, self.model)
            self._form, self._constants = ep.output_form, ep.constants
            self._shapes = tuple(tuple(x.shape) for x in micro if isinstance(x, torch.Tensor))
            graph = ShardedGraph(self.model, plan.stages[0], mesh["tp"] if self.tp > 1 else None, ep,
                                 layers=plan.stage_units(plan.stages[0]), units=sharded)
            lower(graph, {"tp": self.tp_group}, compile, plan.priced_collectives(plan.stages[0]))
            with self.precision.autocast():  # as the steps will run it
                refuse_failing(graph, tuple(micro))
        object.__setattr__(self, "graph", graph)
        # what trains: the model, or the graph holding its parameters (DTensors with a tensor axis)
        object.__setattr__(self, "trained", graph if graph is not None else self.model)
        if compile and self.graph is None:  # plain data parallelism: no graph to lower, the module compiles
            compile_blocks(self.model)
        self.sync: GradSync | None = None
        self.whole: list[nn.Parameter] = []  # kept whole under FSDP2: their gradients averaged by the step
        if sharded:
            with model_holds_shards(self.model, self.trained):
                self.whole = shard_data_axis(self.trained, mesh["dp"], plan.precision, plan.stages[0].zero,
                                             plan.stages[0].offload)
        elif self.dp > 1:
            self.sync = data_sync(by_model_name(self.trained), self.group, plan)
        if self.tp > 1 and not sharded and not plan.dp_gradient.get("compression"):
            defer_partial_grads(list(self.trained.parameters()))
        if self.graph is not None:
            with self.precision.autocast():  # traced as the steps will run it (partial gradients deferred)
                build_checked(self.graph, tuple(micro))
        self.state_buffers = self.graph.state_buffers if self.graph is not None else persistent(self.model)
        self.buffer_sync = AveragedBuffers(self.state_buffers, self.group) if self.dp > 1 else None
        self.optimizer = optimizer(list(self.trained.parameters())) if optimizer is not None else None
        if self.optimizer is not None:
            check_optimizer(self.optimizer, plan)
        self._micro = plan.batch // (self.dp * plan.num_microbatches)  # the samples a graph call takes
        self._compile = compile
        # the programs of other shapes and of eval mode, built at their first call (`_graph_for`)
        self._others: dict[tuple, ShardedGraph] = {}
        self._sync_next = True  # the next forward's backward synchronises (`no_sync` clears it)
        self._accumulating = False  # a forward ran since the last synchronised backward (buffers' start)
        self._queued = False  # this backward's end is queued (`_AtBackwardEnd`)
        self._said_form = False  # warned that the program returns one of the model's tensors
        self._said_precision = False  # warned that the caller's autocast is not the plan's precision
        self._bytes = {"dp": [0, 0], "tp": [0, 0], "pp": [0, 0]}
        self._issued: list[dict[str, Any]] = []
        self._carried = False  # the step's loss rode with the gradients (`GradSync.carry`)
        self._loss_sum: Any = None  # or its own collective, in flight (`_sum_loss`)
        if self.tp > 1:  # replicated values draw one dropout mask on every rank of the tensor axis
            rng.share(mesh["tp"], device)

    def _syncs(self, sync: bool) -> None:
        """Whether the coming backward synchronises the data axis: the bucketed averaging launches,
        FSDP2 reduce-scatters (ZeRO-1/2 keep the layers gathered until it does, ZeRO-2 reduces
        every backward's gradients: `keep_gathered`)."""
        if self.sync is not None:
            self.sync.sync = sync
        elif self.dp > 1 and data_sharded(self.plan.stages[0], self.dp):
            keep_gathered(self.trained, self.plan.stages[0].zero, sync)
            if not self.plan.stages[0].zero:  # ZeRO-3 (ZeRO-1/2: `keep_gathered` decides)
                self.trained.set_requires_gradient_sync(sync)

    def _synchronise(self) -> int:
        """What the gradients are owed once the step's last backward ended: the data axis's
        averages (buckets launched during backward waited for; the kept-whole scalars under FSDP2),
        then the tensor axis's partial sums left to the end (sums commute). Returns the bytes those
        partial sums handed to the tensor axis."""
        if self.sync is not None:
            with phase("dp_sync"):
                self.sync.finish()
            stats = self.sync.reset_stats()
            self._bytes["dp"] = [stats.bytes_raw, stats.bytes_sent]
            self._issued = [{"axis": "dp", "kind": kind, "bytes": nbytes} for kind, nbytes in stats.collectives]
        average_grads(self.whole, self.group)
        if self.tp == 1:
            return 0
        with CollectiveBytes() as after:  # issued by DTensor
            reduce_partial_grads(list(self.trained.parameters()))
        return after.nbytes

    # ---- the module a training loop calls ---------------------------------------------------------

    @guarded
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """The plan's forward on this rank's data-parallel slice (all of a tensor-parallel group
        pass the same one), or with `batch="global"` on the global batch; returns the model's
        output. The backward that follows synchronises the gradients as the plan says, unless the
        forward ran under `no_sync()`. Ranks call it together (it may issue collectives)."""
        if self.plan.dp_gradient.get("delay"):
            raise AutoparError("delayed averaging re-synchronises the replicas after the optimizer's step, which "
                               "only pm.step() runs: train with pm.step(inputs, target), or without delay")
        args = on_device(self._args(inputs, kwargs), self.device)
        if self.batch == "global":
            size = _batch_size(args)
            if size is not None and size % self.dp:
                raise AutoparError(f"a global batch of {size} samples does not split over the plan's {self.dp} "
                                   f"data-parallel ranks: pass a multiple of {self.dp}")
            args = _split(args, self.dp, self.rank)
        grad = torch.is_grad_enabled()
        if grad:
            self._syncs(self._sync_next)
            if self.buffer_sync is not None and not self._accumulating:
                self.buffer_sync.before_step()
            self._accumulating = True
        with self._autocast():
            out = self._run(args)
        if not grad:
            return out
        then = partial(self._at_backward_end, self._sync_next)
        return tree_map_only(torch.Tensor, lambda t: _AtBackwardEnd.apply(then, t) if t.requires_grad else t, out)

    def _autocast(self) -> contextlib.AbstractContextManager:
        """The caller's `torch.autocast` where one is on (warned once where the plan was priced for
        another precision), else the plan's."""
        kind = self.device.type
        if not torch.is_autocast_enabled(kind):
            return self.precision.autocast()
        theirs, priced = torch.get_autocast_dtype(kind), PRECISIONS.get(self.plan.precision)
        if theirs != priced and not self._said_precision:
            self._said_precision = True
            log.warning("the plan was priced for %s, and pm(...) runs under autocast(%s): its memory and time "
                        "predictions assume the other; plan with mixed_precision=%r", self.plan.precision or "fp32",
                        str(theirs).removeprefix("torch."), {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(theirs))
        return contextlib.nullcontext()

    def _args(self, inputs: tuple, kwargs: dict) -> tuple:
        """The call's inputs as positional arguments of the model's forward (`contract.inputs`)."""
        if not kwargs:
            return as_args(self.model.forward, inputs[0] if len(inputs) == 1 and isinstance(inputs[0], dict)
                           else tuple(inputs))
        import inspect

        try:
            named = inspect.signature(self.model.forward).bind_partial(*inputs, **kwargs).arguments
        except TypeError as exc:
            raise AutoparError(f"inputs: {exc}") from None
        return as_args(self.model.forward, dict(named))

    def _run(self, args: tuple) -> Any:
        """The model's forward on this rank's slice: the module itself, or the stage's program in
        the plan's microbatches, the rows split over the tensor axis joined again."""
        if self.graph is None:
            return self.model(*args)
        m, size = self.plan.num_microbatches, _batch_size(args)
        whole = self.training and size == self._micro * m and m > 1  # the plan's batch: in its microbatches
        outs = []
        for chunk in [_split(args, m, i) for i in range(m)] if whole else [args]:
            graph = self._graph_for(chunk)
            out = self._run_graph(graph, chunk)
            if graph.output_shard:  # each tensor-parallel rank computed some samples
                rows = [len(r) for r in torch.arange(_batch_size(chunk)).tensor_split(self.tp)]
                out = _GatheredRows.apply(out, self.tp_group, rows)
            outs.append(out)
        if self._form.tensors > 1 and not self._said_form:
            self._said_form = True
            log.warning("the model returns %d tensors; the plan's program computes one of them (the loss's input, "
                        "`first_tensor`), which pm(...) returns", self._form.tensors)
        return self._form.rebuild(outs[0] if len(outs) == 1 else torch.cat(outs))

    def _graph_for(self, args: tuple) -> ShardedGraph:
        """The program for these inputs' shapes and the module's mode: the plan's (built with the
        model, at its microbatch, training), or one exported again at first use, where the model
        stands in as fake tensors of its whole parameters (`export_standing_in`), with the stage's
        placements by op name. Several are kept, one per shape and mode (a last partial batch, an
        evaluation batch, another sequence length)."""
        shapes = tuple(tuple(x.shape) for x in args if isinstance(x, torch.Tensor))
        if self.training and shapes == self._shapes:
            return self.graph
        key = (shapes, self.training)
        if self.graph.units and torch.is_grad_enabled():
            raise AutoparError(
                f"under ZeRO the program trains at the plan's shape only ({self._shapes}); got {shapes}: pass "
                "batches of the plan's shape, evaluate under torch.no_grad(), or re-plan for this batch")
        if key not in self._others:
            self._others[key] = self._another_graph(args)
        return self._others[key]

    def _run_graph(self, graph: ShardedGraph, args: tuple) -> Any:
        if graph is self.graph or not self.graph.units:
            return graph(*args)
        fsdp = [self.trained, *self.trained.units]  # ZeRO, without gradients: every layer gathered for the call
        for module in fsdp:
            module.unshard()
        try:
            return graph(*args)
        finally:
            for module in fsdp:
                module.reshard()

    def _another_graph(self, args: tuple) -> ShardedGraph:
        ep = export_standing_in(self.model, args, self.graph.graph)
        for name, value in list(ep.constants.items()):  # what the model's code creates: the real export's
            if name not in self._constants or self._constants[name].shape != value.shape:
                raise AutoparError(f"{type(self.model).__name__} creates a tensor constant ({name}, shape "
                                   f"{tuple(value.shape)}) that depends on its inputs' shape: pass batches of the "
                                   f"plan's shape, or re-plan for this one")
            ep.constants[name] = self._constants[name]
        stage = self.plan.stages[0]
        graph = ShardedGraph(self.model, stage, self.graph.mesh, ep, layers=self.plan.stage_units(stage))
        graph.train(self.training)
        if self.graph.units:  # ZeRO: it reads the parameters FSDP2 gathers into the stage's units (`_run_graph`)
            where = {name: home for home, name in self.graph.param_of.values()}
            graph.param_of = {node: (where[name], name) for node, (_, name) in graph.param_of.items()}
        lower(graph, {"tp": self.tp_group}, self._compile)
        return graph

    def _at_backward_end(self, sync: bool) -> None:
        if not self._queued:
            self._queued = True
            if self.sync is not None:  # gradients your `zero_grad()` set to None: accumulated in their buckets
                self.sync.before_backward()
            torch.autograd.Variable._execution_engine.queue_callback(partial(self._after_backward, sync))

    def _after_backward(self, sync: bool) -> None:
        self._queued = False
        if not sync:
            return
        self._synchronise()
        if self.buffer_sync is not None:
            self.buffer_sync.after_step()
        self._accumulating = False

    @contextlib.contextmanager
    def no_sync(self) -> Any:
        """Backwards of forwards run inside accumulate gradients on this rank only; the first one
        outside synchronises the sum (DDP's `no_sync`, FSDP2's `set_requires_gradient_sync`)."""
        before, self._sync_next = self._sync_next, False
        try:
            yield
        finally:
            self._sync_next = before

    # the module's state is the model's, by its own names: the trained parameters (DTensors where
    # the plan splits them) are the model's (`shard_parameters`, `model_holds_shards`), and
    # torch.distributed.checkpoint's state-dict functions see through this wrapper (`_fqn_modifiers`)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Any:
        """This rank's parameters (DTensors where the plan splits them) by the model's own names."""
        return self.model.named_parameters(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        """The model's state dict: its names, this rank's shards as DTensors (full tensors through
        `get_model_state_dict(pm, options=StateDictOptions(full_state_dict=True))`)."""
        return self.model.state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """The model's state dict loaded: sharded (DTensors as `state_dict` gives them) or full
        (every rank keeps its own shard of each tensor)."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        mine = self.model.state_dict(keep_vars=True)
        state_dict = {k: distribute_tensor(v.to(mine[k].device), mine[k].device_mesh, mine[k].placements,
                                           src_data_rank=None)
                      if isinstance(mine.get(k), DTensor) and not isinstance(v, DTensor) else v
                      for k, v in state_dict.items()}
        return self.model.load_state_dict(state_dict, strict=strict, assign=assign)

    def _fqn_modifiers(self) -> dict[str, str]:
        """For torch.distributed.checkpoint.state_dict: the model's names have no "model." prefix."""
        return {name.split(".")[0]: "model" for name in self.model.state_dict(keep_vars=True)}

    def train(self, mode: bool = True) -> ParallelModel:
        super().train(mode)
        if self.graph is not None:
            self.graph.train(mode)
        return self

    # ---- a whole step ------------------------------------------------------------------------------

    @guarded
    def step(self, inputs: Any, target: torch.Tensor, local: bool = False) -> float:
        """One training step on the global batch, or with `local` on this rank's data-parallel slice
        of it (slice `data_parallel_rank` of `data_parallel_size` equal ones); returns the global
        mean loss (same on every rank)."""
        if self.loss_fn is None or self.optimizer is None:
            raise AutoparError("step() runs the loss and the optimizer given to parallelize (loss_fn=, optimizer=); "
                               "without them call the model: loss_fn(pm(inputs), target).backward(), then your "
                               "optimizer's step()")
        inputs, target = on_device(as_args(self.model.forward, inputs), self.device), target.to(self.device)
        check_batch(inputs, self.plan, self.dp if local else None)
        m = self.plan.num_microbatches
        local_in, local_target = (inputs, target) if local else (_split(inputs, self.dp, self.rank),
                                                                 _split(target, self.dp, self.rank))
        micro_in = [_split(local_in, m, i) for i in range(m)]
        micro_target = [_split(local_target, m, i) for i in range(m)]
        total = torch.zeros((), dtype=torch.float64, device=self.device)  # NCCL reduces device tensors only
        if self.sync is not None:  # zeroes its buckets in place where it can
            self.sync.zero_grad(self.optimizer)
        else:
            self.optimizer.zero_grad(set_to_none=True)
        if self.buffer_sync is not None:
            self.buffer_sync.before_step()
        counter = StageBytes([self.graph]) if self.tp > 1 else contextlib.nullcontext()
        with counter:  # the tensor axis's collectives
            self._microbatches(micro_in, micro_target, total)
        after = self._synchronise()
        if self.tp > 1:
            self._bytes["tp"] = [counter.nbytes + after] * 2
        if self.sync is None and data_sharded(self.plan.stages[0], self.dp):  # FSDP2's collectives
            def whole(params: Any) -> int:
                return sum(p.to_local().numel() * p.to_local().element_size() * self.dp for p in params
                           if hasattr(p, "to_local"))  # scalars stay whole (`shard_data_axis`)

            root = whole(self.trained.parameters(recurse=False))
            layers = whole(p for unit in self.trained.units for p in unit.parameters())
            zero = self.plan.stages[0].zero
            # ZeRO-3, per microbatch: a reduce-scatter of each gradient, an all-gather of each layer's
            # parameters for its forward and its backward, one of the root's. ZeRO-1/2: one all-gather
            # per step, a reduce-scatter after the last microbatch (1) or every one (2)
            nbytes = m * (2 * root + 3 * layers) if not zero else (root + layers) * (1 + (m if zero == 2 else 1))
            self._bytes["dp"] = [nbytes, nbytes]
        with phase("optimizer"):
            if self.max_grad_norm is not None:
                self.precision.unscale(self.optimizer)
                params = list(self.trained.parameters())
                self.last_grad_norm = clip(params, squared_grad_norm(params), dist.get_world_size(),
                                           self.max_grad_norm, self.device)
            self.precision.step(self.optimizer)
        if self.sync is not None:
            self.sync.after_step()
        if self.buffer_sync is not None:
            self.buffer_sync.after_step()
        if self._carried:
            total, self.sync.carried = self.sync.carried, None
        elif self._loss_sum is not None:
            self._loss_sum.wait()
        return float(total) / self.dp

    def _sum_loss(self, total: torch.Tensor) -> Any:
        """Launch the sum of the step's loss over the ranks holding different samples (None: no
        collective needed); `step` waits on it."""
        if self.graph is not None and self.graph.output_shard:  # the tensor axis's ranks hold different samples
            return dist.all_reduce(total, async_op=True)
        if self.dp > 1:  # the tensor axis's ranks hold the same loss: no collective over it
            return dist.all_reduce(total, group=self.group, async_op=True)
        return None

    def _microbatches(self, micro_in: list, micro_target: list, total: torch.Tensor) -> None:
        """Forward and backward of every microbatch (the synchroniser launches with the last)."""
        m = len(micro_in)
        for i in range(m):
            last = i == m - 1
            # ZeRO-3 reduce-scatters every microbatch's gradients (FSDP2's default): skipping it would
            # keep every layer's whole gradient between microbatches, the memory ZeRO-3 is there to save
            self._syncs(last or (self.sync is None and not self.plan.stages[0].zero))
            args = micro_in[i] if isinstance(micro_in[i], (tuple, list)) else (micro_in[i],)
            with phase("forward"), self.precision.autocast():  # forward and loss (the model's dtype: nothing)
                if self.graph is None:
                    loss = self.loss_fn(first_tensor(self.model(*args)), micro_target[i]) / m
                    reported = loss
                elif self.graph.output_shard:  # each tensor-parallel rank holds some samples
                    target = micro_target[i].tensor_split(self.tp)[self.tp_rank]
                    loss = reported = self.loss_fn(self.graph(*args), target) / (m * self.tp)
                else:  # every rank of the tensor axis holds the same loss
                    loss = reported = self.loss_fn(self.graph(*args), micro_target[i]) / m
            total += reported.detach().double()
            # the step's loss summed with the last gradient bucket, not in a collective of its own;
            # else summed by one launched now, which the last backward hides
            self._carried = last and self.tp == 1 and self.sync is not None and self.sync.carry(total)
            self._loss_sum = self._sum_loss(total) if last and not self._carried else None
            with phase("backward"):
                self.precision.scale(loss).backward()

    @guarded
    def predict(self, inputs: Any) -> torch.Tensor:
        """The model's output (reduced as the loss gets it) for the global batch, without gradients,
        the same on every rank; run in the plan's microbatches. Training is left as it was
        (buffers, random state). A collective: every rank calls it."""
        inputs = on_device(as_args(self.model.forward, inputs), self.device)
        check_batch(inputs, self.plan)
        m = self.plan.num_microbatches
        mine = _split(inputs, self.dp, self.rank)
        outs = []
        with evaluating(self.state_buffers, self.device):
            for i in range(m):
                args = _split(mine, m, i)
                with self.precision.autocast():
                    out = first_tensor(self.trained(*args))
                if self.graph is not None and self.graph.output_shard:  # each tensor-parallel rank: some samples
                    out = gather_batch_dim(out, self.tp_group)
                outs.append(out)
        return gather_batch_dim(torch.cat(outs), self.group)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded parameters, as single-process training would hold them."""
        if self.graph is not None:
            return self.graph.full_state_dict()
        return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu().clone()
                for name, p in self.model.named_parameters()}

    def programs(self) -> list[dict[str, Any]]:
        """How the stage runs: lowered (its collectives), interpreted (why) or the user's module
        (`runtime.lower.programs`)."""
        return programs([self.graph], [0])

    def issued(self) -> list[dict[str, Any]]:
        """The collectives the synchronizer issued in the last step ({axis, kind, bytes}), to check
        against the plan's prediction (FSDP2 issues its own: not listed)."""
        return list(self._issued)

    def comm_stats(self) -> dict[str, dict[str, int]]:
        """Bytes this rank handed to collectives in the last step, per axis, before and after compression."""
        return {axis: {"bytes_raw": raw, "bytes_sent": sent} for axis, (raw, sent) in self._bytes.items()}
