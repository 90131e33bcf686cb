"""The exported graph, op by op, as a stage of the plan runs it: the tensor axis through DTensor,
pipeline stages as parts of the graph (`cut`). `ShardedGraph.interpret` is what the lowering traces
(`runtime.lower`): a step runs the program traced from it, and the interpreter itself runs only
where the lowering falls back, and for the build-time check (`first_failure`).

The model is exported again at the shape one rank runs (its microbatch), so node names are the
plan's. Parameters become DTensors with the plan's tensor-axis placements; before each op its
inputs are redistributed to the placements the plan says it needs (`StagePlan.needs`), and after
it the output is brought to the plan's placement when DTensor chose another. Values replicated on
the tensor axis stay plain tensors between ops (no DTensor dispatch where nothing is split), and
each is wrapped once, so the partial gradients of all its split consumers add up before the one
all-reduce that makes them whole; a value is redistributed once to each placement its consumers
need, and their gradients add up before the one collective back (the planner's assumptions,
`planner.intra_op.distinct`). Ops DTensor has no sharding rule for
(CPU attention, DESIGN.md §6) run on the local shards when the plan splits a dimension they treat
independently; the plan only splits such ops along letters present in all their inputs and outputs.
"""

from __future__ import annotations

import logging
import operator
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_tensor,
)

from autopar.contract import placements as planned
from autopar.contract.attention import attention_cores, is_view
from autopar.contract.export import WRAPPER_PREFIX, source_line
from autopar.contract.plan import SELECTIVE, Plan, StagePlan
from autopar.runtime import rng
from autopar.runtime.buffers import persistent
from autopar.runtime.cross_mesh import gather_batch, slice_batch
from autopar.runtime.experts import local_experts
from autopar.runtime.lower import traced_as
from autopar.runtime.recompute import Segment, recomputed, segments

log = logging.getLogger(__name__)

_CHECKS = {torch.ops.aten._assert_tensor_metadata.default}
# attention on CPU: no DTensor rule (DTensor would try propagating through its decomposition, which
# takes minutes for a masked attention); the plan splits it by batch or heads, so it runs locally
_LOCAL = {torch.ops.aten.scaled_dot_product_attention.default,
          torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}
# convolutions: DTensor's rule follows the input's placement and ignores a split weight (torch 2.13)
_CONV = {torch.ops.aten.conv1d.default, torch.ops.aten.conv2d.default, torch.ops.aten.conv3d.default,
         torch.ops.aten.convolution.default}
_LOCAL |= _CONV
_EMBEDDING = torch.ops.aten.embedding.default
# layout-only ops: on a partial sum DTensor reduces first (an all-reduce the plan did not price;
# `reshape` of a non-contiguous value copies, and DTensor's copy reduces); each rank's part can be
# laid out on its own
_LAYOUT = {torch.ops.aten.contiguous.default, torch.ops.aten.clone.default, torch.ops.aten.reshape.default}


def mutates(node: fx.Node) -> bool:
    """An op that writes into its first argument (`add_`, `copy_`, `index_put_`)."""
    schema = getattr(node.target, "_schema", None)
    first = schema.arguments[0] if schema is not None and schema.arguments else None
    return first is not None and first.alias_info is not None and first.alias_info.is_write


def written(nodes: list[fx.Node]) -> set[fx.Node]:
    """The values an op writes into in place, and the values they are views of (`x[..., :4].copy_(y)`
    writes into x): their tensors must be the model's own, not a view `to_local` returned."""
    out = set()
    for node in nodes:
        if mutates(node) and isinstance(node.args[0], fx.Node):
            value = node.args[0]
            out.add(value)
            while is_view(value) and value.all_input_nodes:
                value = value.all_input_nodes[0]
                out.add(value)
    return out


class _ContiguousGrad(torch.autograd.Function):
    """The identity, whose gradient leaves contiguous."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


class _PartialLayout(torch.autograd.Function):
    """A layout-only op (`_LAYOUT`) on each rank's part of a partial sum, which DTensor would
    reduce first: the identity on the values, so its gradient passes as it comes, in the input's shape."""

    @staticmethod
    def forward(ctx: Any, x: DTensor, op: Any, args: tuple, kwargs: dict) -> DTensor:
        ctx.shape = x.shape
        return DTensor.from_local(op(x._local_tensor, *args, **kwargs), x.device_mesh, x.placements, run_check=False)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return (grad if grad.shape == ctx.shape else grad.reshape(ctx.shape)), None, None, None


class _FromPartial(torch.autograd.Function):
    """A partial sum redistributed (reduced, or reduce-scattered) where the plan says, its gradient
    made whole on the way back, as the plan prices it (`edge_costs`): DTensor leaves a partial
    gradient partial there, and the ops before then reduce it with collectives no plan priced."""

    @staticmethod
    def forward(ctx: Any, x: DTensor, placement: Placement) -> DTensor:
        return x.redistribute(x.device_mesh, [placement])

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple:
        if isinstance(grad, DTensor) and not grad.placements[0].is_replicate():
            grad = grad.redistribute(grad.device_mesh, [Replicate()])
        return grad, None


def _grouped(target: Any) -> bool:
    """A grouped matmul (aten's, or the fallback custom op transformers runs experts through)."""
    return "grouped_mm" in str(target)


def _split_rows(value: Any) -> bool:
    return isinstance(value, DTensor) and value.placements[0] == Shard(0)


def dtensor_placement(p: planned.Placement) -> Placement:
    """The plan's placement as DTensor's own class."""
    if isinstance(p, planned.Shard):
        return Shard(p.dim)
    if isinstance(p, planned.Partial):
        return Partial()
    if isinstance(p, planned.Replicate):
        return Replicate()
    raise TypeError(f"not a plan placement: {p!r} (Plan.check_placements types placements written as text)")


def _reduced(value: DTensor, want: Placement) -> bool:
    """A partial sum the plan expects that DTensor already reduced (its `contiguous` does): the value
    is right as it is, and DTensor refuses to turn it back into partial sums."""
    return isinstance(want, Partial) and isinstance(value.placements[0], Replicate)


def _partial(value: Any) -> bool:
    return isinstance(value, DTensor) and value.placements[0].is_partial()


def _same(have: Placement, want: Placement) -> bool:
    if isinstance(want, Partial):
        return isinstance(have, Partial)  # the embedding's masked partial sum is a partial sum too
    return have == want


def shard_parameters(model: nn.Module, params: dict[str, list[planned.Placement]], mesh: DeviceMesh,
                     only: set[str]) -> None:
    """Replace the parameters of `model` named in `only` by DTensors with their plan placement on
    the tensor axis (every alias of a tied weight points to the one new parameter). One placed for
    another stage of this rank already is left as it is: both stages use that parameter."""
    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    for names in aliases.values():
        if not only.intersection(names):
            continue
        p = model.get_parameter(names[0])
        if isinstance(p, DTensor):
            continue
        spec = next((params[n][1] for n in names if n in params), planned.Replicate())
        new = nn.Parameter(distribute_tensor(p.detach(), mesh, [dtensor_placement(spec)]), requires_grad=p.requires_grad)
        if new.requires_grad:  # registered first: the gradient synchroniser's hooks see the fixed gradient
            new.register_post_accumulate_grad_hook(_grad_like_param)
        for name in names:
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner), leaf, new)


def _grad_like_param(p: torch.Tensor) -> None:
    """DTensor leaves a gradient where its backward rule put it (an embedding's can come back
    replicated); the optimizer and the synchroniser need it placed like the parameter. A partial
    sum of a replicated weight (a norm's under a sequence split) may instead stay partial over the
    step's microbatches (`defer_partial_grads`): reduced once, after the last backward (Megatron-LM
    all-reduces its sequence-parallel norms' gradients once per step too). A split weight's partial
    gradient (a tied embedding's, from its use as the output layer) is reduced now: it holds whole
    rows, more than the weight's shard."""
    if p.grad is None or p.grad.placements == p.placements:
        return
    if getattr(p, "partial_until_step", False) and all(g == q or g.is_partial() and q.is_replicate() for g, q in
                                                       zip(p.grad.placements, p.placements)):
        return  # a partial sum of a replicated weight: the parameter's shape, the data axis averages it alike
    p.grad = p.grad.redistribute(p.device_mesh, p.placements)


def defer_partial_grads(params: list[nn.Parameter]) -> None:
    """Let tensor-axis partial gradients add up over the microbatches (`_grad_like_param`), to be
    reduced by `reduce_partial_grads`. Sums commute: the data axis may average them first, as long
    as it averages linearly (not a compressor) and does not shard them (not ZeRO-3)."""
    for p in params:
        if isinstance(p, DTensor):
            p.partial_until_step = True


def reduce_partial_grads(params: list[nn.Parameter]) -> None:
    """The gradients left partial during the step, all-reduced on the tensor axis (one each)."""
    for p in params:
        if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
            p.grad = p.grad.redistribute(p.device_mesh, p.placements)


class CannotLower(RuntimeError):
    """A construct the lowering cannot trace yet: the stage runs interpreted (`runtime.lower`)."""


class OpFailed(RuntimeError):
    """An op of the exported graph failed under the plan: names the op and the user's line."""


def first_failure(module: ShardedGraph, inputs: tuple, group: Any = None, run: bool = True) -> str | None:
    """Run `module` forward once on `inputs` (no gradients; random state and buffers kept) and agree over
    `group` (all ranks: every rank must take the same decision) on the first op that failed.
    A collective: every rank of the group calls it (one not asked to `run` only agrees)."""
    import torch.distributed as dist

    failed = _fails(module, inputs) if run else None
    said: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(said, failed, group=group)
    return next((s for s in said if s is not None), None)


def _fails(module: ShardedGraph, inputs: tuple) -> str | None:
    """The op of `module`'s forward on `inputs` that fails, interpreted, if one does."""
    kept = [(t, t.clone()) for t in module.fixed.values() if isinstance(t, torch.Tensor)]  # BatchNorm's statistics
    program, module.program = module.program, None  # interpreted: the check needs the op that fails
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            module(*inputs)
    except OpFailed as exc:
        return str(exc)
    finally:
        module.program = program
        with torch.no_grad():
            for tensor, value in kept:
                tensor.copy_(value)
    return None


@dataclass
class Part:
    """The nodes one pipeline stage runs, the values it receives and the values it sends on."""

    nodes: set[str]
    inputs: list[str]
    outputs: list[str]


def cut(graph: fx.Graph, plan: Plan, user_inputs: list[str], output: str) -> list[Part]:
    """Split the exported graph at the plan's stage boundaries (its layers name their nodes).

    Nodes no layer lists (getitem, export's checks) join the stage of their latest input, or of
    their first user. A value a later stage needs travels through every stage in between."""
    listed = {}
    for i, stage in enumerate(plan.stages):
        for k in range(*stage.layers):
            listed.update({name: i for name in plan.layers[k]["nodes"]})
    ops = [n for n in graph.nodes if n.op == "call_function"]
    where: dict[str, int] = {name: 0 for name in user_inputs}
    for node in ops:
        made = [where[i.name] for i in node.all_input_nodes if i.name in where]
        where[node.name] = listed.get(node.name, max(made, default=-1))
    for node in reversed(ops):  # sources no layer lists (constants, aranges): with their first user
        if where[node.name] < 0:
            where[node.name] = min((where[u.name] for u in node.users if u.op == "call_function"), default=0)
    last = len(plan.stages) - 1
    needed = {name: where[name] for name in where}  # the last stage that uses each value
    for node in ops:
        for i in node.all_input_nodes:
            if i.name in needed:
                needed[i.name] = max(needed[i.name], where[node.name])
    needed[output] = last
    order = list(where)
    carried = [[v for v in order if where[v] <= s < needed[v]] for s in range(last)]
    return [Part({n.name for n in ops if where[n.name] == s}, user_inputs if s == 0 else carried[s - 1],
                 carried[s] if s < last else [output]) for s in range(last + 1)]


class Layer(nn.Module):
    """One layer's parameters, and a forward that runs its segment of the graph: the module FSDP2's
    hooks gather the parameters around (ZeRO-3 per layer, as torchtitan shards each block)."""

    def __init__(self, graph: ShardedGraph, index: int) -> None:
        super().__init__()
        self.index = index
        self._graph = weakref.ref(graph)  # not a submodule: the graph holds this one

    def forward(self, *values: Any) -> tuple:
        return self._graph()._part(self.index, *values)


class ShardedGraph(nn.Module):
    """Runs (part of) `model`'s exported graph with the tensor-axis placements of one plan stage.

    `ep` is the model exported at the shape this rank runs (one microbatch of its data-parallel
    slice). Called with the part's inputs, it returns its outputs as plain tensors replicated on
    the tensor axis — or, for a whole graph whose plan leaves the output split by batch, this
    rank's samples of it (`output_shard`; the loss is then computed per shard). Without a mesh
    (tp = 1) the ops run on plain tensors. `layers`: the node names of each of the stage's layers,
    the units it recomputes when the plan says so (`runtime.recompute`); with `units` each layer's
    own parameters live in a submodule of `units`, the unit of FSDP2 under ZeRO-3 (`_homes`).
    Parameters no op uses (a mask token for inputs this model is not given) are kept by the whole
    graph or `keep_unused` (the first stage): checkpoints and state dicts hold every parameter;
    one that another stage of the rank uses is placed as `kept_params` (those stages' plans) says."""

    def __init__(self, model: nn.Module, stage: StagePlan, mesh: DeviceMesh | None, ep: Any, part: Part | None = None,
                 layers: list[list[str]] | None = None, units: bool = False, keep_unused: bool = False,
                 kept_params: dict[str, list[planned.Placement]] | None = None) -> None:
        super().__init__()
        self.mesh, self.stage = mesh, stage
        self.graph = ep.graph_module.graph
        sig = ep.graph_signature
        user = [n.name for n in self.graph.nodes if n.op == "placeholder" and n.name in sig.user_inputs]
        by_name = {n.name: n for n in self.graph.nodes}
        output = by_name[sig.user_outputs[0]]  # the outputs before it are buffers the model updates
        self.part = part or Part({n.name for n in self.graph.nodes if n.op == "call_function"}, user, [output.name])
        self.nodes = [n for n in self.graph.nodes if n.op == "call_function" and n.name in self.part.nodes]
        self.inputs = [by_name[n] for n in self.part.inputs]
        self.outputs = [by_name[n] for n in self.part.outputs]
        inputs_used = {i for n in self.nodes for i in n.all_input_nodes if i.op == "placeholder"}
        if part is None or keep_unused:
            inputs_used |= {n for n in self.graph.nodes if n.op == "placeholder" and not n.users
                            and n.name in sig.inputs_to_parameters}
        # graph order: every rank registers the parameters in the same order (FSDP and the
        # gradient buckets pair them up across ranks by position)
        used = [n for n in self.graph.nodes if n in inputs_used]
        fqns = {}
        for node in used:
            fqn = sig.inputs_to_parameters.get(node.name) or sig.inputs_to_buffers.get(node.name)
            if fqn is not None:
                fqns[node.name] = fqn.removeprefix(WRAPPER_PREFIX)
        if mesh is not None:
            shard_parameters(model, {**(kept_params or {}), **stage.params}, mesh, set(fqns.values()))
        named = dict(model.named_parameters(remove_duplicate=False))
        buffers = dict(model.named_buffers(remove_duplicate=False))
        canonical = {id(p): n for n, p in model.named_parameters()}
        self.fixed: dict[fx.Node, Any] = {}  # placeholder -> buffer or constant
        params: dict[fx.Node, nn.Parameter] = {}
        for node in used:
            fqn = fqns.get(node.name)
            if fqn in named:
                params[node] = named[fqn]
            elif fqn is not None:
                self.fixed[node] = buffers[fqn]
            elif node.name in sig.inputs_to_lifted_tensor_constants:
                self.fixed[node] = ep.constants[sig.inputs_to_lifted_tensor_constants[node.name]]
        self.state_buffers = persistent(model, set(fqns.values()))  # what checkpoints save of this part
        # buffers the model updates (BatchNorm's running statistics), from the ops of this part
        self.updates = {by_name[n]: buffers[fqn.removeprefix(WRAPPER_PREFIX)]
                        for n, fqn in sig.buffers_to_mutate.items() if n in self.part.nodes}
        self._buffer_node = {id(t): node for node, t in self.fixed.items()}  # buffer -> its placeholder
        for node in self.graph.nodes:  # submodules of higher-order ops (a rotary cache's no_grad block)
            if node.op == "get_attr":
                self.fixed[node] = operator.attrgetter(node.target)(ep.graph_module)
        want = stage.ops[output.name][1] if output.name in stage.ops else planned.Replicate()
        # split by batch (inputs carry it in dim 0): the loss runs per shard
        self.output_shard = part is None and mesh is not None and want == planned.Shard(0)
        self.unplanned: set[str] = set()  # ops whose output DTensor placed otherwise than the plan
        # at a boundary with a stage of another logical mesh: position -> (batch dim, dp group)
        self.slice_inputs: dict[int, tuple[int | None, Any]] = {}
        self.gather_outputs: dict[int, tuple[int | None, Any]] = {}
        self.copy_views = False  # outputs that are views leave as copies (`forward`)
        self.program: Any = None  # the lowered program (`runtime.lower.Program`); None: interpreted
        self.tracing = False  # while the lowering traces `interpret`
        self._given: dict[fx.Node, Any] = {}  # parameter and buffer values the lowering traces with
        self._regions = 0  # recomputed regions so far in this forward
        given = set(self.fixed) | set(params)
        kept = set(self.outputs) | set(self.updates)
        self.segments = segments(self.nodes, layers or [], kept, given)
        self.written = written(self.nodes)
        self.selective = stage.recompute and stage.recompute_granularity == SELECTIVE
        if self.selective:  # each attention core a checkpointed segment of its own inside its layer's
            cores = attention_cores(self.nodes, set(params))
            self.segments = [s.with_cores(cores, kept, given) for s in self.segments]
            spread = len(cores) - sum(len(s.cores) for s in self.segments)
            if spread:  # the planner priced them as recomputed (`planner.capture`): say where that breaks
                log.warning("%d attention core(s) of this stage span two of its layers and keep their "
                            "activations: selective recomputation frees less than the plan says", spread)
        self.units = nn.ModuleList()  # with `units`: a module per layer holding its own parameters
        self._unit_at: dict[int, Layer] = {}  # segment index -> its unit
        self._wrapped: dict[fx.Node, DTensor] | None = None  # during a forward without recomputation
        home = self._homes(params, units)
        self.param_of: dict[fx.Node, tuple[nn.Module, str]] = {}  # placeholder -> (module, name) holding it
        for node, p in params.items():  # graph order: every rank registers the parameters in the same order
            name = canonical[id(p)].replace(".", "__")  # the model's FQN, dots as "__"
            if not hasattr(home[id(p)], name):
                home[id(p)].register_parameter(name, p)  # what the stage, optimizer and FSDP see
            self.param_of[node] = (home[id(p)], name)

    def _homes(self, params: dict[fx.Node, nn.Parameter], units: bool) -> dict[int, nn.Module]:
        """The module each parameter is registered in: here, or with `units` (ZeRO-3) the unit of the
        one layer that uses it, which FSDP2 gathers for that layer's forward and backward and frees
        after. A weight several layers use (a tied embedding and output layer) stays here, in the
        root unit, gathered for the whole step."""
        home: dict[int, nn.Module] = {id(p): self for p in params.values()}
        if not units:
            return home
        segment_of = {n: i for i, s in enumerate(self.segments) for n in s.nodes}
        users: dict[int, set[int]] = {}
        for node, p in params.items():
            users.setdefault(id(p), set()).update(segment_of[u] for u in node.users if u in segment_of)
        for i, segment in enumerate(self.segments):
            own = [pid for pid, where in users.items() if where == {i}]
            if own:
                self._unit_at[i] = Layer(self, i)
                self.units.append(self._unit_at[i])
                home.update(dict.fromkeys(own, self._unit_at[i]))
        return home

    def model_names(self) -> dict[str, str]:
        """Each parameter's name here (as `named_parameters` gives it) -> its name in the user's model."""
        return {n: n.rpartition(".")[2].replace("__", ".") for n, _ in self.named_parameters()}

    # ---- running ---------------------------------------------------------------------------

    def forward(self, *inputs: torch.Tensor) -> Any:
        inputs = tuple(x for x in inputs if isinstance(x, torch.Tensor))  # None and flags: constants of the export
        if self.program is not None:  # the lowered program (`runtime.lower`), traced from `interpret`
            return self.program(self, inputs)
        return self.interpret(inputs)

    def interpret(self, inputs: tuple, given: dict[fx.Node, Any] | None = None) -> Any:
        """The stage op by op, DTensor placing every split value. `given`: values for parameter and
        buffer placeholders instead of the module's own (the lowering traces with local shards)."""
        # the gradients of values received from the stage before go back to it: in one block, as
        # gloo and NCCL send (the gradient of a permuted or channels-last activation may not be)
        # (a value the stage writes in place is copied first: a received activation is a leaf that requires grad)
        inputs = tuple(x if not x.requires_grad else _ContiguousGrad.apply(x).clone() if node in self.written
                       else _ContiguousGrad.apply(x) for node, x in zip(self.inputs, inputs))
        inputs = tuple(slice_batch(x, *self.slice_inputs[i]) if i in self.slice_inputs else x
                       for i, x in enumerate(inputs))
        self._given, self._regions = given or {}, 0
        env: dict[fx.Node, Any] = {**self.fixed, **self._given, **dict(zip(self.inputs, inputs))}  # outputs may be constants
        recompute = self.stage.recompute and torch.is_grad_enabled()  # each layer runs again before its backward
        # without recomputation, replicated values are wrapped once for the whole part (not passed
        # as an argument: FSDP2's hooks would copy it)
        self._wrapped = None if recompute else {}
        recompute = recompute and not self.selective  # `_segment` checkpoints the attention cores
        try:
            for i, segment in enumerate(self.segments):
                unit = self._unit_at.get(i)
                run = unit if unit is not None else partial(self._part, i)
                values = [env[n] for n in segment.inputs]
                again = segment.recomputes(recompute, self.stage.recompute_layers)
                env.update(zip(segment.outputs, self._recomputed(run, values) if again else run(*values)))
        finally:
            self._wrapped = None
        with torch.no_grad():
            for node, buffer in self.updates.items():
                buffer = self._given.get(self._buffer_node.get(id(buffer)), buffer)  # traced: the buffer's input
                buffer.copy_(env[node].full_tensor() if isinstance(env[node], DTensor) else env[node])
        # values crossing to the next stage are sent as they lie in memory: an expanded mask (stride 0)
        # or a transposed activation is copied into one block first (gloo and NCCL send contiguous ones),
        # and with `copy_views` a view too, into a block of its own (a split backward detaches the outputs
        # in place, which a view refuses)
        outs = [self._plain(env[n]) for n in self.outputs]
        outs = [(x.clone(memory_format=torch.contiguous_format) if self.copy_views and x._is_view()
                 else x.contiguous()) if isinstance(x, torch.Tensor) else x for x in outs]
        outs = [gather_batch(x, *self.gather_outputs[i]) if i in self.gather_outputs else x for i, x in enumerate(outs)]
        return outs[0] if len(outs) == 1 else tuple(outs)

    def _part(self, i: int, *values: Any) -> tuple:
        """Segment i as the stage runs it: its own lowered program where the stage is lowered segment
        by segment (ZeRO: FSDP2 gathers each layer's parameters around its call), else op by op."""
        parts = getattr(self.program, "parts", None)
        if parts is not None and not self.tracing:
            return tuple(parts[i](parts[i].view, values))
        return self._segment(self.segments[i], *values)

    def _segment(self, segment: Segment, *values: Any) -> tuple:
        """The nodes of one segment on the values it reads; the values later ones read."""
        env: dict[fx.Node, Any] = dict(self.fixed)
        for node, (module, name) in self.param_of.items():  # read each call: FSDP swaps in gathered parameters
            env[node] = getattr(module, name)
        env.update(self._given)
        env.update(zip(segment.inputs, values))
        wrapped = {} if self._wrapped is None else self._wrapped
        again = self.selective and torch.is_grad_enabled()
        done: set[fx.Node] = set()
        for node in segment.nodes:
            core = segment.cores.get(node) if again else None
            if core is not None:  # selective recomputation: the core runs again before its backward
                env.update(zip(core.outputs, self._recomputed(partial(self._segment, core), [env[n] for n in core.inputs])))
                done.update(core.nodes)
            if node in done:
                continue
            try:
                with traced_as(node.name, self.tracing):
                    env[node] = self._run(node, env, wrapped)
            except Exception as exc:
                raise OpFailed(f"{node.name} ({node.target}) failed under the plan's placements "
                               f"{self._placements(node, env)}{source_line(node)}: {exc}") from exc
        return tuple(env[n] for n in segment.outputs)

    def _recomputed(self, run: Any, values: list) -> Any:
        self._regions += 1  # (increasing: the partitioner keeps the boundary between two regions)
        return recomputed(run, values, self._regions, self.tracing)

    def _placements(self, node: fx.Node, env: dict) -> str:
        got = [getattr(env.get(i), "placements", "plain") for i in node.all_input_nodes]
        needs, out = self.stage.needs.get(node.name), self.stage.ops.get(node.name)
        return (f"(inputs {got}, needs {needs and [p and str(p) for p in needs]}, "
                f"output {out and [str(p) for p in out]})")

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """This part's parameters, whole (gathered over the tensor and data axes), by the model's names.
        A collective: every rank of the part calls it."""
        names = self.model_names()
        return {names[name]: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu().clone()
                for name, p in sorted(self.named_parameters(), key=lambda item: names[item[0]])}

    def _plain(self, out: Any) -> Any:
        if isinstance(out, DTensor):
            want = Shard(0) if self.output_shard else Replicate()
            return (out if out.placements[0] == want else out.redistribute(self.mesh, [want])).to_local()
        if self.output_shard:
            return out.tensor_split(self.mesh.size())[self.mesh.get_local_rank()]
        return out

    def _run(self, node: fx.Node, env: dict, wrapped: dict) -> Any:
        if node.target is operator.getitem:
            return operator.getitem(env[node.args[0]], node.args[1])
        if node.target in _CHECKS and (self.tracing or any(isinstance(env[i], DTensor) for i in node.all_input_nodes)):
            return None  # export's metadata checks (global shapes, already checked when exporting; in a program, impure)
        needs = self.stage.needs.get(node.name) or []
        # None: as DTensor places it
        want = dtensor_placement(self.stage.ops[node.name][1]) if node.name in self.stage.ops else None
        inputs = node.all_input_nodes
        need = {inp: dtensor_placement(needs[i]) for i, inp in enumerate(inputs)
                if i < len(needs) and needs[i] is not None}
        if mutates(node) and not self._writes_split(node, env, want, need):
            return self._write(node, env, wrapped)
        higher = isinstance(node.target, torch._ops.HigherOrderOperator)
        if (want is None or want.is_replicate()) and higher or \
                want is not None and want.is_replicate() and all(p.is_replicate() for p in need.values()):
            # replicated by the plan: on whole tensors, without DTensor's dispatch (ops DTensor has no
            # rule for, forward or backward, run too: a weight norm's, `cond`, an autocast region);
            # split inputs are gathered (their gradients split back)
            whole = partial(self._whole, env, wrapped)
            return node.target(*fx.node.map_arg(node.args, whole), **fx.node.map_arg(node.kwargs, whole))
        split = (want is not None and not want.is_replicate()) or any(not p.is_replicate() for p in need.values()) \
            or any(isinstance(env[i], DTensor) for i in inputs)
        if not split:
            return node.target(*fx.node.map_arg(node.args, env.__getitem__), **fx.node.map_arg(node.kwargs, env.__getitem__))

        def arg(inp: fx.Node) -> Any:
            value = env[inp]
            if not isinstance(value, torch.Tensor):
                return value
            if not isinstance(value, DTensor):
                if inp not in wrapped:
                    wrapped[inp] = DTensor.from_local(value, self.mesh, [Replicate()], run_check=False)
                value = wrapped[inp]
            if inp in need and not _same(value.placements[0], need[inp]) and not _reduced(value, need[inp]):
                value = self._moved(wrapped, inp, value, need[inp])
            return value

        args = fx.node.map_arg(node.args, arg)
        kwargs = fx.node.map_arg(node.kwargs, arg)
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, DTensor)]
        if rng.is_random(node.target, args, kwargs) and any(a.placements[0].is_shard() for a in tensors):
            # each shard its own mask, from a seed every rank draws alike: on local tensors where the
            # op's inputs lie as its output (a dropout; attention split by batch or heads)
            local = rng.on_shards(node.target, self.mesh.get_local_rank())
            if local is not None and want is not None and want.is_shard() and all(
                    _same(a.placements[0], want) or a.placements[0].is_replicate() for a in tensors):
                return self._op(node, args, kwargs, want, local)
            if self.tracing:
                raise CannotLower(f"{node.target} on a split value draws a mask per rank from a seed drawn "
                                  "at run time")
            with rng.independent(self.mesh.get_local_rank(), torch.device(self.mesh.device_type)):
                return self._op(node, args, kwargs, want)
        return self._op(node, args, kwargs, want)

    def _whole(self, env: dict, wrapped: dict, inp: fx.Node) -> Any:
        """The value of `inp` whole, as a plain tensor."""
        value = env[inp]
        if not isinstance(value, DTensor):
            return value
        return (value if value.placements[0].is_replicate() else self._moved(wrapped, inp, value, Replicate())).to_local()

    def _moved(self, wrapped: dict, inp: fx.Node, value: DTensor, placement: Placement) -> DTensor:
        """`inp`'s value redistributed to `placement`, once for every op that needs it so: their
        gradients add up before the one collective back."""
        if (inp, placement) not in wrapped:
            wrapped[inp, placement] = _FromPartial.apply(value, placement) if _partial(value) and value.requires_grad \
                else value.redistribute(self.mesh, [placement])
        return wrapped[inp, placement]

    def _writes_split(self, node: fx.Node, env: dict, want: Placement | None, need: dict) -> bool:
        """Whether an in-place op writes into a split value as it lies (DTensor's own in-place op:
        an add into a split residual): planned split, and the value needs no redistribution first."""
        first = env[node.args[0]]
        return isinstance(first, DTensor) and want is not None and not want.is_replicate() and (
            node.args[0] not in need or _same(first.placements[0], need[node.args[0]]))

    def _write(self, node: fx.Node, env: dict, wrapped: dict) -> Any:
        """An op writing into its first argument, on whole tensors. Where the value written (or the
        value it is a view of: `x[..., :4].copy_(y)` writes into x) lies in a DTensor, x becomes a
        whole tensor of its own first and its views are made again from it, so the write lands
        where every later reader looks; wrappers made of them before the write are dropped."""
        chain = [node.args[0]]  # back through views, as far as this segment holds their values
        while is_view(chain[-1]) and chain[-1].all_input_nodes and chain[-1].all_input_nodes[0] in env:
            chain.append(chain[-1].all_input_nodes[0])
        if any(isinstance(env[v], DTensor) for v in chain):
            env[chain[-1]] = self._whole(env, wrapped, chain[-1]).clone()
            for view in reversed(chain[:-1]):
                env[view] = view.target(*fx.node.map_arg(view.args, env.__getitem__),
                                        **fx.node.map_arg(view.kwargs, env.__getitem__))
        for value in chain:
            for key in [k for k in wrapped if k is value or isinstance(k, tuple) and k[0] is value]:
                del wrapped[key]
        whole = partial(self._whole, env, wrapped)
        return node.target(*fx.node.map_arg(node.args, whole), **fx.node.map_arg(node.kwargs, whole))

    def _op(self, node: fx.Node, args: Any, kwargs: dict, want: Placement | None, local: Callable | None = None
            ) -> Any:
        """`node` on its inputs as the plan places them (with `local`: that function on each rank's
        shards in its stead); its output placed as the plan says."""
        if local is not None or node.target in _LOCAL or _grouped(node.target):
            out = self._run_local(node, args, kwargs, want, local)
        elif node.target is _EMBEDDING and _split_rows(args[0]) and not _split_rows(args[1]):
            out = self._vocab_parallel(*args[:3])
        elif node.target in _LAYOUT and _partial(args[0]) and want is not None and want.is_partial():
            out = _PartialLayout.apply(args[0], node.target, tuple(args[1:]), kwargs)
        else:
            try:
                out = node.target(*args, **kwargs)
            except NotImplementedError as exc:
                if "sharding strategy" not in str(exc):
                    raise
                out = self._run_local(node, args, kwargs, want)
        if isinstance(out, torch.Tensor) and not isinstance(out, DTensor):  # created by the op (arange, masks)
            out = DTensor.from_local(out, self.mesh, [Replicate()], run_check=False)
        if isinstance(out, DTensor):
            if want is not None and not _same(out.placements[0], want):
                self.unplanned.add(node.name)
                if not _reduced(out, want):
                    out = out.redistribute(self.mesh, [want])
            if isinstance(out.placements[0], Replicate):
                # a value without gradient (a tensor the op created) leaves as a plain tensor, not as the
                # output of `to_local`'s autograd function, a view autograd forbids writing into
                out = out._local_tensor if not out.requires_grad else \
                    out.to_local().clone() if node in self.written else out.to_local()
        return out

    def _vocab_parallel(self, weight: DTensor, ids: Any, padding_idx: int = -1) -> DTensor:
        """Megatron's vocabulary-parallel embedding: each rank looks up the rows it holds, zero for
        the others, a partial sum. DTensor's own rule gives a `_MaskPartial` whose mask does not
        follow later views (T5's relative-position bias is permuted before it is added)."""
        table = weight.to_local()
        ids = ids.to_local() if isinstance(ids, DTensor) else ids
        _, start = Shard.local_shard_size_and_offset(weight.shape[0], self.mesh.size(), self.mesh.get_local_rank())
        outside = (ids < start) | (ids >= start + table.shape[0])
        padding = padding_idx - start if 0 <= padding_idx - start < table.shape[0] else -1  # no gradient there
        rows = torch.ops.aten.embedding.default(table, (ids - start).masked_fill(outside, 0), padding)
        return DTensor.from_local(rows.masked_fill(outside.unsqueeze(-1), 0), self.mesh, [Partial()], run_check=False)

    def _local_experts(self, op: Any, x: Any, weight: DTensor, offs: Any) -> DTensor:
        """Expert parallelism for a grouped matmul (tokens sorted by expert): this rank multiplies
        the rows of the experts it holds; the other rows are zero, so the output is a partial sum
        and the tokens' gradient too. One opaque op (`experts.local_experts`): which rows are this
        rank's depends on the data, which a traced program cannot slice by."""
        w = weight.to_local()
        if isinstance(x, DTensor):
            x = x.to_local(grad_placements=[Partial()])
        offs = offs.to_local() if isinstance(offs, DTensor) else offs
        _, first = Shard.local_shard_size_and_offset(weight.shape[0], self.mesh.size(), self.mesh.get_local_rank())
        rows = local_experts(x, w, offs, first, op.name())
        return DTensor.from_local(rows, self.mesh, [Partial()], run_check=False)

    def _run_local(self, node: fx.Node, args: tuple, kwargs: dict, want: Placement | None,
                   fn: Callable | None = None) -> Any:
        """An op without a (correct) DTensor rule, on each rank's shards: valid when the plan splits
        it along a dimension it computes independently (batch, heads, a convolution's output
        channels) or along one it sums over (input channels: `P`). A replicated input's gradient
        is then a partial sum over the ranks; a convolution's bias joins one rank's partial sum."""
        if want is None or want.is_replicate() and any(
                isinstance(a, DTensor) and not isinstance(a.placements[0], Replicate) for a in args):
            raise NotImplementedError(f"{node.target} has no DTensor sharding rule and the plan splits it "
                                      f"as {want}: it cannot run on local shards")
        if want.is_partial() and node.target not in _CONV and not _grouped(node.target):
            raise NotImplementedError(f"{node.target} has no DTensor sharding rule for a partial result")
        if _grouped(node.target) and _split_rows(args[1]):
            return self._local_experts(node.target, *args[:3])

        def local(a: Any) -> Any:
            if not isinstance(a, DTensor):
                return a
            if isinstance(a.placements[0], Replicate) and not want.is_replicate():
                return a.to_local(grad_placements=[Partial()])
            return a.to_local()

        local_args = [local(a) for a in args]
        if (want.is_partial() and node.target in _CONV and len(local_args) > 2 and local_args[2] is not None
                and self.mesh.get_local_rank() != 0):
            local_args[2] = local_args[2] * 0  # the bias once in the sum (its gradient: zero here)
        out = (fn or node.target)(*local_args, **kwargs)
        return DTensor.from_local(out, self.mesh, [want], run_check=False)
