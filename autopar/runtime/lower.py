"""A plan's stage lowered to a program over local tensors: the compiler of "planner and compiler".

`ShardedGraph` interprets a stage op by op, handing every op that touches a split value to
DTensor, which decides placements and collectives again on every call (200-470 µs of host time
per op). Here that interpretation runs once per input signature, traced by AOTAutograd
(`aot_function`: `make_fx` with functionalization, the joint forward + backward graph, torch's
partitioner) on fake tensors, as meta's autoparallel lowers its plans: DTensor computes local
shapes and inserts the redistributions the plan's placements need while tracing, and what is
left is a forward and a backward graph of aten ops on local tensors with explicit functional
collectives (`_c10d_functional`). The step then runs those graphs (as generated Python code, or
compiled by inductor with `compile`): no DTensor dispatch between the first forward and the last
backward.

Parameters stay DTensors (optimizers, clipping, checkpoints and FSDP's data axis read them):
one autograd node (`_Locals`) hands the graphs their local shards and wraps the local gradients
back into DTensors placed as the parameter, or partial where the runtime defers a sequence-split
norm's reduction to the end of the step (`sharded_graph.defer_partial_grads`), as recorded while
tracing. The collectives of each traced program are listed (`Collective`) so that the caller can
check them against what the planner priced.

A construct that cannot be traced yet (a random op on a split value other than dropout and
attention's dropout, `rng.on_shards`; an op reading tensor values into Python, as sorted experts
do) makes the stage run interpreted, with one warning saying why (`Program.fallback`).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from autopar.runtime import split_backward
from autopar.runtime.comm_count import CollectiveBytes, nbytes_of
from autopar.runtime.recompute import RECOMPUTE

log = logging.getLogger(__name__)

# functional collectives as they appear in a traced graph -> the kind the plan names
KINDS = {"all_reduce": "all_reduce", "all_reduce_": "all_reduce", "all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
         "all_to_all_single": "all_to_all", "broadcast": "broadcast", "all_reduce_coalesced": "all_reduce",
         "all_gather_into_tensor_coalesced": "all_gather", "reduce_scatter_tensor_coalesced": "reduce_scatter"}


@dataclass(frozen=True)
class Collective:
    """One collective of a lowered program: what the plan prices, per call of the stage."""

    kind: str  # all_reduce, all_gather, reduce_scatter, all_to_all, broadcast
    axis: str  # the mesh axis its group is ("tp", "dp"), or the group's name
    nbytes: int  # the input this rank hands it
    phase: str  # "forward" or "backward"
    node: str = ""  # the stage's node it was traced under (`traced_as`), where known

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "axis": self.axis, "bytes": self.nbytes, "phase": self.phase, "node": self.node}


NODE = "autopar_node"  # the annotation naming the stage's node a traced op came from


def traced_as(node: str, tracing: bool) -> Any:
    """While the stage is traced, the ops run inside are annotated with the stage's node they
    belong to (the partitioner copies annotations to their backward ops): a collective the plan
    did not price is named by its op."""
    if not tracing:
        return contextlib.nullcontext()
    from torch.fx import traceback as fx_traceback

    return fx_traceback.annotate({NODE: node})


# what DTensor issues on a CPU mesh (gloo has no all-to-all: it gathers and keeps its chunk)
ON_CPU = {"all_to_all": "all_gather"}


def unplanned(issued: list[Collective], planned: list[dict[str, Any]], device_type: str = "cpu"
              ) -> tuple[list[dict], list[dict]]:
    """(issued but not priced, priced but not issued): the tensor axis's collectives of one call of a
    program against the plan's for it (`StagePlan.collectives`), by kind (as DTensor issues it on
    the device: `ON_CPU`), phase and bytes."""
    def key(kind: str, phase: str, nbytes: float) -> tuple:
        return (ON_CPU.get(kind, kind) if device_type == "cpu" else kind), phase, round(nbytes)

    left = collections.Counter(key(c["kind"], c["phase"], c["bytes"]) for c in planned)
    extra = []
    for c in issued:
        if c.axis != "tp":
            continue
        k = key(c.kind, c.phase, c.nbytes)
        if left[k] > 0:
            left[k] -= 1
        else:
            extra.append(c.as_dict())
    missing = []
    for c in planned:
        k = key(c["kind"], c["phase"], c["bytes"])
        if left[k] > 0:
            left[k] -= 1
            missing.append(dict(c))
    return extra, missing


def _ranks(group_name: str) -> tuple[int, ...]:
    from torch.distributed.distributed_c10d import _resolve_process_group, get_process_group_ranks

    return tuple(sorted(get_process_group_ranks(_resolve_process_group(group_name))))


def collectives(gm: torch.fx.GraphModule, phase: str, axes: dict[tuple[int, ...], str]) -> list[Collective]:
    """The functional collectives `gm` issues, in order, with the bytes of their inputs; `axes` names
    the groups by their ranks (DTensor may run a value on an equal mesh of another group object:
    its specs are cached by value)."""
    out = []
    for node in gm.graph.nodes:
        packet = getattr(node.target, "_overloadpacket", None)
        kind = KINDS.get(getattr(packet, "__name__", ""))
        if node.op != "call_function" or kind is None or "c10d_functional" not in str(node.target):
            continue
        value = node.args[0]
        vals = [v.meta.get("val") for v in (value if isinstance(value, (list, tuple)) else [value])]
        group = next((a for a in (*node.args[1:], *node.kwargs.values()) if isinstance(a, str) and a.isdigit()), None)
        ranks = _ranks(group) if group is not None else ()
        out.append(Collective(kind, axes.get(ranks, f"ranks {list(ranks)}"), nbytes_of(vals), phase,
                              node.meta.get("custom", {}).get(NODE, "")))
    return out


def _plain_views(gm: torch.fx.GraphModule) -> bool:
    """Drop what tracing leaves that costs host time and computes nothing: a view to the shape its
    input already has (DTensor's `from_local` / `to_local` make one per value they wrap), and a
    chain of views read only by views (`view(view(x))` is one view of x). Values the graph
    returns are left alone: the caller may rely on them being distinct tensors. Like the passes
    below, it says whether it changed the graph (the caller regenerates its code once)."""
    view = torch.ops.aten.view.default
    returned = {a for n in gm.graph.nodes if n.op == "output" for a in n.all_input_nodes}
    changed = False
    for node in list(gm.graph.nodes):
        if node.target is not view or node in returned:
            continue
        source = node.args[0]
        shape = getattr(node.meta.get("val"), "shape", None)
        if getattr(source, "target", None) is view:  # view of a view: of the first one's input
            node.args = (source.args[0], *node.args[1:])
            changed = True
            if not source.users:
                gm.graph.erase_node(source)
            source = node.args[0]
        if shape is not None and getattr(source.meta.get("val"), "shape", None) == shape:
            node.replace_all_uses_with(source)
            gm.graph.erase_node(node)
            changed = True
    if changed:
        gm.graph.eliminate_dead_code()
    return changed


def _reduce_in_place(gm: torch.fx.GraphModule) -> bool:
    """An all-reduce whose input nothing else reads sums that input in place (`all_reduce_`). The
    functional op sums a copy, in memory allocated per call: on gloo, 2 ranks, that copy made a
    256 KiB all-reduce 1.2x and a 1 MiB one 2.5x slower than in place (2026-11-27). Inductor avoids
    it by computing the producer straight into the buffer it reduces; this is the eager program's
    way. The input must be computed here (not handed in: the caller's), contiguous, and read by
    nothing else, through a chain of views each read once."""
    reduce, in_place = torch.ops._c10d_functional.all_reduce.default, torch.ops._c10d_functional.all_reduce_.default

    def view(node: torch.fx.Node) -> bool:  # (`_unsafe_view` aliases its input, its schema unmarked)
        return getattr(node.target, "is_view", False) or node.target is torch.ops.aten._unsafe_view.default

    changed = False
    for node in gm.graph.find_nodes(op="call_function", target=reduce):
        source = node.args[0]
        val = source.meta.get("val")
        if not isinstance(val, torch.Tensor) or not val.is_contiguous() or len(source.users) != 1:
            continue
        while source.op == "call_function" and view(source) and len(source.users) == 1:
            source = source.args[0]
        if source.op == "call_function" and len(source.users) == 1 and not view(source):
            node.target = in_place
            changed = True
    return changed


def _overlap(gm: torch.fx.GraphModule) -> bool:
    """Each collective issued as soon as its input exists, and waited for where its result is first
    read: the ops in between (a linear's weight gradient, while its input's gradient is summed) run
    while the backend moves the bytes, as inductor's reordering passes arrange a compiled program.
    Collectives keep their order (every rank issues them alike)."""
    wait = torch.ops._c10d_functional.wait_tensor.default
    nodes = list(gm.graph.nodes)
    changed, previous = False, None
    for node in nodes:
        if node.op != "call_function" or getattr(node.target, "namespace", None) != "_c10d_functional":
            continue
        if node.target is wait:
            first = min(node.users, key=nodes.index, default=None)
            if first is not None and first.op != "output" and nodes.index(first) > nodes.index(node) + 1:
                first.prepend(node)
                changed = True
        else:
            after = max([*node.all_input_nodes, *([previous] if previous is not None else [])], key=nodes.index,
                        default=None)
            if after is not None and after.op == "placeholder":
                after = max(gm.graph.find_nodes(op="placeholder"), key=nodes.index)
            if after is not None and nodes.index(after) < nodes.index(node) - 1:
                after.append(node)
                changed = True
            previous = node
        if changed:
            nodes = list(gm.graph.nodes)
    return changed


class _Locals(torch.autograd.Function):
    """DTensor parameters -> their local shards, one autograd node for all of them. Their local
    gradients are accumulated here (`_accumulate`), or come back as DTensors with `specs[i]` (the
    parameter's, or a partial one) for autograd to accumulate."""

    @staticmethod
    def forward(ctx: Any, specs: list, *params: DTensor) -> tuple:
        ctx.specs, ctx.params = specs, params
        ctx.set_materialize_grads(False)
        return tuple(p._local_tensor.view_as(p._local_tensor) for p in params)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple:
        out = []
        for g, spec, p, (node, _) in zip(grads, ctx.specs, ctx.params, ctx.next_functions):
            if g is None or _accumulate(p, g, spec, node):
                out.append(None)
            else:  # (DTensor's `__new__` alone: its `__init__` costs more than the rest of the backward per parameter)
                out.append(DTensor.__new__(DTensor, g.contiguous(), spec, requires_grad=False))
        return (None, *out)


def _accumulate(param: DTensor, grad: torch.Tensor, spec: DTensorSpec, node: Any) -> bool:
    """What autograd's AccumulateGrad would do with `grad` (the local shard of a gradient placed as
    `spec`, in memory of its own: `_unaliased_grads`), done on local tensors: store it as the
    parameter's gradient, or add it to the one there. AccumulateGrad does the same through DTensor's
    dispatch (a `detach` or an `add_` per parameter per backward); handed no gradient, it still
    runs the parameter's post-accumulate hooks (the synchroniser's), which then see this one.
    Whether it did (else autograd does): not where this backward does not accumulate into the
    parameter (`autograd.grad`, `backward(inputs=)`), builds a graph of the gradient, meets a hook
    on the parameter's gradient, or adds to a gradient placed otherwise."""
    if torch.is_grad_enabled() or node is None or param._backward_hooks:
        return False
    try:
        if not torch._C._will_engine_execute_node(node):
            return False
    except RuntimeError:  # (inside `autograd.grad`, which never accumulates)
        return False
    have = param.grad
    if have is None:
        param.grad = DTensor.__new__(DTensor, grad.contiguous(), spec, requires_grad=False)
    elif isinstance(have, DTensor) and (have._spec is spec or have._spec == spec):
        have._local_tensor.add_(grad)
    else:
        return False
    return True


_SPLITTING: list | None = None  # while a zero-bubble input pass runs: where weight parts are queued


@contextlib.contextmanager
def splitting(queue: list) -> Any:
    """While the block runs, each lowered backward runs its input part only and appends to `queue`
    a callable that runs its weight part and hands the weights their gradients (the "W" pass)."""
    global _SPLITTING
    before, _SPLITTING = _SPLITTING, queue
    try:
        yield queue
    finally:
        _SPLITTING = before


class _Backward:
    """The backward graph AOTAutograd calls (boxed: with a list of arguments): whole, or under
    `splitting` its input part (`split_backward.split`), the weights' gradients left None, and its
    weight part queued. A graph with nothing to cut runs whole there, its weights' gradients queued."""

    _boxed_call = True

    def __init__(self, whole: Callable, outputs: int, weights: int, parts: tuple | None,
                 deliver: Callable[[list], None]) -> None:
        self.whole, self.outputs, self.weights, self.parts, self.deliver = whole, outputs, weights, parts, deliver

    def __call__(self, args: list) -> list:
        queue = _SPLITTING
        if queue is None:
            return self.whole(args)
        if self.parts is None:
            out = list(self.whole(args))
            grads, out[:self.weights] = out[:self.weights], [None] * self.weights
            queue.append(lambda: self.deliver(grads))
            return out
        first, later = self.parts
        out = list(first(args))
        handed = out[self.outputs:]
        queue.append(lambda: self.deliver(list(later(handed))))
        return out[:self.outputs]


def _deliver(params: list, specs: list, grads: list) -> None:
    """The weights' gradients a weight part computed (local shards of DTensor parameters, placed as
    `specs`, `_Locals`' rule) accumulated by autograd as a backward would: the parameters'
    post-accumulate hooks (the gradient synchroniser's) run."""
    tensors, values, spec = [], [], iter(specs)
    for p, g in zip(params, grads):
        s = next(spec) if isinstance(p, DTensor) else None
        if g is None or not p.requires_grad:
            continue
        tensors.append(p)
        values.append(DTensor.__new__(DTensor, g.contiguous(), s, requires_grad=False) if s is not None else g)
    if tensors:
        torch.autograd.backward(tensors, values)


def _examples(gm: torch.fx.GraphModule) -> list:
    """Example inputs of a graph cut from a traced one: its placeholders' traced values."""
    return [n.meta.get("val") for n in gm.graph.find_nodes(op="placeholder")]


class _AsParam(torch.autograd.Function):
    """While tracing: a parameter's local shard as the DTensor the interpretation computes with.
    Its gradient leaves the graph placed as the parameter, except a partial sum the runtime
    defers (`partial_until_step`), which leaves partial; `record[i]` says which (read after the trace)."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, params: list, record: list, i: int) -> DTensor:
        # (the parameter is passed inside a list: as an argument of its own it would join the traced
        # autograd graph to the real one)
        ctx.param, ctx.record, ctx.i = params[i], record, i
        return DTensor(local.view_as(local), params[i]._spec, requires_grad=local.requires_grad)

    @staticmethod
    def backward(ctx: Any, grad: DTensor) -> tuple:
        param = ctx.param
        if grad.placements != param.placements:
            deferred = getattr(param, "partial_until_step", False) and all(
                g == q or g.is_partial() and q.is_replicate() for g, q in zip(grad.placements, param.placements))
            if deferred:
                ctx.record[ctx.i] = grad.placements
            else:
                grad = grad.redistribute(param.device_mesh, param.placements)
        return grad._local_tensor, None, None, None


def _grad_spec(param: DTensor, placements: tuple | None) -> DTensorSpec:
    if placements is None:
        return param._spec
    return DTensorSpec(param.device_mesh, tuple(Partial() if p.is_partial() else Replicate() if p.is_replicate() else p
                                                for p in placements), param._spec.tensor_meta)


@dataclass
class _Entry:
    run: Callable[..., Any] | None
    specs: list  # per DTensor parameter: the spec its local gradient is wrapped in (`_Locals`)
    record: list  # per parameter: the placements its gradient leaves the graph with where not the parameter's
    collectives: list[Collective]
    seconds: float  # tracing (and compiling) time, once traced
    saved_bytes: int = 0  # what the forward graph keeps for the backward, per call
    outputs: list = field(default_factory=list)  # per output: its DTensor spec, or None for a plain one


class Program:
    """A stage's lowered program: `program(graph, inputs)` runs `graph` (a `ShardedGraph`) on
    `inputs` as the traced graphs for their signature (shapes, dtypes, which need gradients, grad
    mode, train/eval, autocast), lowering once per signature. `axes` names the process groups its
    collectives run on ("tp", "dp" -> group). With `compile`, inductor compiles the graphs."""

    def __init__(self, axes: dict[str, Any], compile: bool = False, planned: list[dict[str, Any]] | None = None) -> None:
        import torch.distributed as dist

        self.axes = {tuple(sorted(dist.get_process_group_ranks(g))): axis for axis, g in axes.items()}
        self.compile = compile
        self.planned = planned  # the collectives the plan priced per call (None: not recorded)
        self.device_type = "cuda" if any(dist.get_backend(g) == "nccl" for g in axes.values()) else "cpu"
        self.cache: dict[tuple, _Entry] = {}
        self.sent: dict[str, int] = {}  # bytes handed to each axis's collectives since `StageBytes` last looked
        self.fallback: str | None = None  # why the stage (or layer) runs interpreted
        self._warned = False

    def _interpreted(self, graph: Any, inputs: tuple) -> Any:
        """The stage run op by op; the warning once it ran (an op that fails there is the build's
        refusal, not a stage run interpreted)."""
        out = graph.interpret(inputs)
        if not self._warned:
            self._warned = True
            log.warning("part of the plan runs interpreted (DTensor per op), not lowered: %s", self.fallback)
        return out

    @property
    def lowered(self) -> bool:
        return self.fallback is None

    def __call__(self, graph: Any, inputs: tuple) -> Any:
        if self.fallback is None and not all(isinstance(x, torch.Tensor) for x in inputs):
            self.fallback = "a value that is not a tensor crosses into it"
        if self.fallback is not None:
            return self._interpreted(graph, inputs)
        params = [getattr(module, name) for module, name in graph.param_of.values()]
        fixed = [t for t in graph.fixed.values() if isinstance(t, torch.Tensor)]
        if self.compile:  # inductor's code assumes the strides it was traced with: a step's inputs may be
            # slices (a batch's tokens and targets cut from one block), traced as contiguous ones
            inputs = tuple(x.contiguous() for x in inputs)
            fixed = [t.contiguous() for t in fixed]
        # a segment (a ZeRO layer) hands DTensors to the next: they cross into and out of the program
        # as local tensors (`_Locals`' rule for gradients: a partial value's is replicated), so the
        # traced graphs see plain values only, as a whole stage's do (AOTAutograd's own handling of
        # tensor-subclass outputs and their tangents left some layers' partitions invalid)
        specs = tuple(x._spec if isinstance(x, DTensor) else None for x in inputs)
        inputs = tuple(x.to_local() if isinstance(x, DTensor) else x for x in inputs)
        key = (tuple((tuple(x.shape), x.dtype, x.requires_grad) for x in (*inputs, *fixed)), specs,
               tuple(p.requires_grad for p in params), torch.is_grad_enabled(), graph.training,
               _autocast_state())
        entry = self.cache.get(key)
        if entry is None:
            entry = self._lower(graph, params, specs)
        dparams = [p for p in params if isinstance(p, DTensor)]
        if dparams and torch.is_grad_enabled() and any(p.requires_grad for p in dparams):
            locals_ = iter(_Locals.apply(entry.specs, *dparams))
        else:
            locals_ = iter([p._local_tensor for p in dparams])
        flat = [next(locals_) if isinstance(p, DTensor) else p for p in params]
        if key in self.cache:
            self._tally(entry)
            return _as_dtensors(entry, entry.run(*flat, *fixed, *inputs))
        # the first call traces (on fake copies of the inputs), then runs
        graph.tracing = True
        try:
            out = entry.run(*flat, *fixed, *inputs)
        except Exception as exc:
            if entry.seconds:  # traced: the failure is the run's own
                raise
            cause = exc.__cause__ or exc
            where = str(exc).split(" failed under")[0] + ": " if "failed under" in str(exc) else ""
            self.fallback = f"{where}{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"
        finally:
            graph.tracing, graph._given = False, {}  # (a recomputed layer's backward is traced by then)
        if self.fallback is not None:
            return self._interpreted(graph, inputs)
        entry.specs[:] = [_grad_spec(p, entry.record[i]) for i, p in enumerate(params) if isinstance(p, DTensor)]
        self.cache[key] = entry
        self._tally(entry)
        return _as_dtensors(entry, out)

    def _tally(self, entry: _Entry) -> None:
        backward = torch.is_grad_enabled()  # (the backward graph runs once per forward that needs it)
        for c in entry.collectives:
            if c.phase == "forward" or backward:
                self.sent[c.axis] = self.sent.get(c.axis, 0) + c.nbytes

    def _latest(self) -> _Entry | None:
        """The program traced last for training (or last traced at all)."""
        entries = list(self.cache.values())
        trained = [e for k, e in self.cache.items() if k[2]]
        return (trained or entries)[-1] if entries else None

    def collectives(self) -> list[Collective]:
        """The collectives of the program traced last for training (or last traced at all)."""
        entry = self._latest()
        return entry.collectives if entry is not None else []

    def unplanned(self) -> tuple[list[dict], list[dict]] | None:
        """(collectives issued but not priced, priced but not issued) by the training program, or
        None where there is nothing to check yet (no plan record, or no training trace)."""
        if self.planned is None or not self.trained():
            return None
        return unplanned(self.collectives(), self.planned, self.device_type)

    def trained(self) -> bool:
        """Whether a training program (grad mode) has been traced."""
        return any(k[2] for k in self.cache)

    def saved_bytes(self) -> int:
        """The bytes of activations the training program's forward keeps for its backward, per call."""
        entry = self._latest()
        return entry.saved_bytes if entry is not None else 0

    def seconds(self) -> float:
        """Time spent lowering (tracing, and with `compile` compiling), over every signature so far."""
        return sum(e.seconds for e in self.cache.values())

    def _compiled(self, gm: torch.fx.GraphModule, example: list) -> Callable:
        """`gm` as it runs: the runtime's passes over its code, or inductor's compile (`compile`);
        boxed (called with a list of arguments, as AOTAutograd calls it)."""
        from functorch.compile import make_boxed_func

        changed = _plain_views(gm)
        if not self.compile:
            changed = _reduce_in_place(gm) | _overlap(gm) | changed
        if changed:
            gm.recompile()
        if self.compile:
            from torch._inductor.compile_fx import compile_fx_inner

            return compile_fx_inner(gm, example)
        return make_boxed_func(_below_autograd(gm.forward))

    def _parts(self, parts: tuple | None) -> tuple | None:
        """The two parts of a cut backward as they run, or None (run whole) where inductor cannot
        compile one from its traced example values."""
        if parts is None:
            return None
        try:
            return tuple(self._compiled(part, _examples(part)) for part in parts)
        except Exception as exc:  # noqa: BLE001 (inductor's failures have no common type)
            log.warning("a zero-bubble schedule's backward runs whole in its input pass: %s", exc)
            return None

    def _lower(self, graph: Any, params: list, specs: tuple) -> _Entry:
        """The program for one signature, traced at its first call; `specs`: the DTensor inputs'
        (their local tensors are handed in)."""
        from functorch.compile import default_partition
        from torch._functorch.aot_autograd import aot_function

        nodes = list(graph.param_of)
        fixed_nodes = [n for n, t in graph.fixed.items() if isinstance(t, torch.Tensor)]
        entry = _Entry(None, [p._spec for p in params if isinstance(p, DTensor)], [None] * len(params), [], 0.0)
        start = time.perf_counter()

        def traced(*flat: torch.Tensor) -> Any:
            locals_, rest = flat[:len(params)], flat[len(params):]
            given = {}
            for i, (node, local, p) in enumerate(zip(nodes, locals_, params)):
                given[node] = _AsParam.apply(local, params, entry.record, i) if isinstance(p, DTensor) else local
            given.update(zip(fixed_nodes, rest[:len(fixed_nodes)]))
            inputs = tuple(x if spec is None else DTensor.from_local(
                x, spec.mesh, spec.placements, run_check=False, shape=spec.shape, stride=spec.stride)
                for x, spec in zip(rest[len(fixed_nodes):], specs))
            out = graph.interpret(inputs, given)
            outs = out if isinstance(out, tuple) else (out,)
            entry.outputs[:] = [o._spec if isinstance(o, DTensor) else None for o in outs]
            outs = tuple(o.to_local() if isinstance(o, DTensor) else o for o in outs)
            return outs if isinstance(out, tuple) else outs[0]

        returned = [0]  # the forward graph's outputs before those it keeps for the backward

        def partition(joint: torch.fx.GraphModule, inputs: Any, *, num_fwd_outputs: int, **kwargs: Any) -> tuple:
            returned[0] = num_fwd_outputs
            _mark_recomputed(joint)
            fw, bw = default_partition(joint, inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)
            if _drop_dead_copies(bw) | _unaliased_grads(bw):
                bw.recompile()
            # listed now: AOTAutograd compiles the backward graph only at the first backward
            entry.collectives[:] = collectives(fw, "forward", self.axes) + collectives(bw, "backward", self.axes)
            return fw, bw

        def compiler(phase: str) -> Callable:
            def compile_graph(gm: torch.fx.GraphModule, example: list) -> Callable:
                began = time.perf_counter()
                if phase == "forward" and returned[0]:
                    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
                    entry.saved_bytes = nbytes_of([getattr(v, "meta", {}).get("val") for v in out[returned[0]:]])
                if not returned[0]:  # a program without backward (not partitioned)
                    entry.collectives[:] = collectives(gm, phase, self.axes)
                if phase == "backward":  # cut before the passes below make it impure (`split_backward`)
                    parts = split_backward.split(gm, len(params))
                    outputs = len(next(n for n in gm.graph.nodes if n.op == "output").args[0])
                    run = _Backward(self._compiled(gm, example), outputs, len(params), self._parts(parts),
                                    lambda grads: _deliver(params, entry.specs, grads))
                else:
                    run = self._compiled(gm, example)
                # forward: tracing, partitioning and this compile; backward: its compile, done at the
                # first backward (which may come long after a build-time trace)
                entry.seconds = time.perf_counter() - start if phase == "forward" else \
                    entry.seconds + time.perf_counter() - began
                return run
            return compile_graph

        decompositions = None
        if self.compile:  # inductor lowers the core aten ops its table leaves
            from torch._inductor.decomposition import select_decomp_table

            decompositions = select_decomp_table()
        entry.run = aot_function(traced, fw_compiler=compiler("forward"), bw_compiler=compiler("backward"),
                                 partition_fn=partition, decompositions=decompositions,
                                 keep_inference_input_mutations=True,
                                 enable_log=False)  # (its graph printing costs 5 % of a trace, logged or not)
        return entry


class StageBytes:
    """Bytes the stages `modules` hand to the tensor axis's collectives within the block: lowered
    programs' from their lists (counting costs nothing per op); where some stage runs interpreted,
    all of them as dispatched (`CollectiveBytes`, a dispatch mode: it sees the programs' too)."""

    def __init__(self, modules: list[Any], axis: str = "tp") -> None:
        self.programs = [m.program for m in modules if getattr(m, "program", None) is not None]
        interpreted = len(self.programs) < len(modules) or any(p.fallback is not None for p in self.programs)
        self.counter = CollectiveBytes() if interpreted else None
        self.axis, self.nbytes = axis, 0

    def __enter__(self) -> StageBytes:
        for p in self.programs:
            p.sent.clear()
        if self.counter is not None:
            self.counter.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.counter is not None:
            self.counter.__exit__(*exc)
            self.nbytes += self.counter.nbytes
            self.counter.nbytes = 0
        else:
            self.nbytes += sum(p.sent.get(self.axis, 0) for p in self.programs)


def programs(modules: list[Any], stages: list[int]) -> list[dict[str, Any]]:
    """How each stage runs, for reports (`train --json`, `bench`, the families sweep): "lowered"
    with its collectives per call, "interpreted" with why, or "eager" (a one-stage plan without a
    tensor axis runs the user's module itself, as DDP does)."""
    out = []
    for stage, module in zip(stages, modules):
        program = getattr(module, "program", None)
        if program is None:
            out.append({"stage": stage, "runs": "eager" if module is None else "interpreted", "why": None})
        elif program.fallback is not None:
            out.append({"stage": stage, "runs": "interpreted", "why": program.fallback})
        else:
            unplanned_, missing = program.unplanned() or (None, None)
            out.append({"stage": stage, "runs": "lowered", "why": None, "lowering_s": round(program.seconds(), 3),
                        "collectives": [c.as_dict() for c in program.collectives()],
                        "unplanned": unplanned_, "missing": missing})  # None: nothing to check against
    return out


class _SegmentView:
    """One segment of a stage as a `Program` sees a stage: the parameters and fixed values its nodes
    read, and `interpret` running just its nodes."""

    def __init__(self, graph: Any, index: int) -> None:
        self.graph, self.segment = graph, graph.segments[index]
        read = {i for n in self.segment.nodes for i in n.all_input_nodes}
        self.param_of = {n: where for n, where in graph.param_of.items() if n in read}
        self.fixed = {n: v for n, v in graph.fixed.items() if n in read}

    @property
    def training(self) -> bool:
        return self.graph.training

    @property
    def tracing(self) -> bool:
        return self.graph.tracing

    @tracing.setter
    def tracing(self, value: bool) -> None:
        self.graph.tracing = value

    @property
    def _given(self) -> dict:
        return self.graph._given

    @_given.setter
    def _given(self, value: dict) -> None:
        self.graph._given = value

    def interpret(self, inputs: tuple, given: dict | None = None) -> tuple:
        graph = self.graph
        wrapped, graph._wrapped = graph._wrapped, None  # the stage's eager wrappers stay out of the trace
        graph._given = given or {}
        try:
            out = graph._segment(self.segment, *inputs)
        finally:
            graph._wrapped = wrapped
        # an output that is (a view of) an input leaves as a copy: AOTAutograd would regenerate it
        # outside the graph, and its partitioner refuses the gradient it then cannot place
        ids = {id(x) for x in inputs}
        return tuple(o.clone() if isinstance(o, torch.Tensor) and (o._is_view() or id(o) in ids) else o for o in out)


class Segmented(Program):
    """A stage lowered segment by segment (`parts[i]`, each a `Program` of segment i, with its
    `view`): under ZeRO, FSDP2 gathers each layer's parameters around its module's call, so each
    layer is a program of its own, which the stage's loop calls (Python, one call per layer)."""

    def __init__(self, graph: Any, axes: dict[str, Any], compile: bool = False,
                 planned: list[dict[str, Any]] | None = None) -> None:
        super().__init__(axes, compile, planned)  # checked against the parts' together
        self.parts = []
        for i in range(len(graph.segments)):
            part = Program(axes, compile)
            part.view = _SegmentView(graph, i)
            self.parts.append(part)

    def __call__(self, graph: Any, inputs: tuple) -> Any:
        for p in self.parts:
            p.sent.clear()
        out = graph.interpret(inputs)
        failed = [(i, p.fallback) for i, p in enumerate(self.parts) if p.fallback is not None]
        self.fallback = (f"{len(failed)} of {len(self.parts)} layers interpreted, layer {failed[0][0]}: "
                         f"{failed[0][1]}") if failed else None
        for p in self.parts:  # added to what earlier microbatches sent (`StageBytes` clears it per step)
            for axis, n in p.sent.items():
                self.sent[axis] = self.sent.get(axis, 0) + n
        return out

    def collectives(self) -> list[Collective]:
        return [c for p in self.parts for c in p.collectives()]

    def trained(self) -> bool:
        return all(p.trained() for p in self.parts)

    def saved_bytes(self) -> int:
        return sum(p.saved_bytes() for p in self.parts)

    def seconds(self) -> float:
        return sum(p.seconds() for p in self.parts)


def lower(graph: Any, axes: dict[str, Any], compile: bool = False,
          planned: list[dict[str, Any]] | None = None) -> Program:
    """Give `graph` (a `ShardedGraph`) its lowered program, traced at its first call: one for the
    whole stage, or under ZeRO (FSDP2's units) one per layer (`Segmented`). `planned`: the
    collectives the plan priced for the stage (`Plan.priced_collectives`; None: nothing to check)."""
    graph.program = Segmented(graph, axes, compile, planned) if len(graph.units) else Program(axes, compile, planned)
    return graph.program


def lower_now(graph: Any, inputs: tuple) -> None:
    """Trace `graph`'s training program at build time, on `inputs` as a step will hand them (one
    forward run and dropped; random state and buffers kept), and check its collectives against
    the plan's: a program that issues a collective the plan did not price, or does not issue one
    it priced, raises `NotAsPlanned` naming their ops (`programs()` reports them too). A stage
    lowered layer by layer (ZeRO) is traced at its first step, once FSDP2 gathers its layers'
    parameters: there `programs()` reports a mismatch. An op that fails under the plan (the trace
    falls back to the interpreter, where it fails again) raises `OpFailed`."""
    program = getattr(graph, "program", None)
    if program is None or program.fallback is not None or isinstance(program, Segmented):
        return
    kept = [(t, t.clone()) for t in graph.fixed.values() if isinstance(t, torch.Tensor)]  # BatchNorm's statistics
    try:
        with torch.enable_grad(), torch.random.fork_rng(devices=[]):
            graph(*inputs)
    finally:
        with torch.no_grad():
            for tensor, value in kept:
                tensor.copy_(value)
    found = program.unplanned()
    if found and (found[0] or found[1]):
        raise NotAsPlanned(f"its lowered program does not issue the collectives the plan priced ({mismatch(*found)})")


class NotAsPlanned(RuntimeError):
    """A stage's lowered program is not its plan: the planner priced other collectives than the
    program issues (the planner's error, not the user's)."""


def mismatch(extra: list[dict], missing: list[dict]) -> str:
    """Collectives a program issues that its plan did not price, and ones priced it does not issue,
    in words (each kind, phase and op once)."""
    def said(cs: list[dict]) -> str:
        return ", ".join(sorted({f"{c['kind']} in {c['phase']}" + (f" at {c['node']}" if c.get("node") else "")
                                 for c in cs}))
    return "; ".join(part for part in (extra and f"issued, not priced: {said(extra)}",
                                       missing and f"priced, not issued: {said(missing)}") if part)


def _drop_dead_copies(gm: torch.fx.GraphModule) -> bool:
    """Remove the collectives and random ops whose results nothing reads, and what only they read.
    The partitioner copies into the backward graph every forward op whose inputs the backward
    holds, then removes the unread ones, but keeps collectives and random ops (side effects to
    dead-code elimination): a sequence-parallel reduce-scatter computed again for nothing, once per
    layer, and every dropout drawn again, advancing the random state (the next step's masks then
    depended on whether the plan recomputes). Every rank drops the same."""
    def impure(node: torch.fx.Node) -> bool:
        if node.op == "call_function" and "_c10d_functional" in str(node.target):
            return False  # functional: its output is its only effect
        return node.is_impure(impure_random=False)

    return gm.graph.eliminate_dead_code(is_impure_node=impure)


def _unaliased_grads(gm: torch.fx.GraphModule) -> bool:
    """Each gradient the backward graph returns in memory of its own. The graph may return one
    tensor, or views of one, for several inputs (at one sample per microbatch a position embedding's
    gradient is the incoming gradient itself, and the class token's a slice of it), or the incoming
    gradient it was handed. Autograd stores a gradient it is handed as the parameter's and adds the
    next microbatch's into it in place: gradients sharing memory would add into each other. (Eager
    autograd sees the sharing; the graph runs below view tracking, `_below_autograd`.)"""
    def base(node: Any) -> Any:
        while isinstance(node, torch.fx.Node) and node.op == "call_function" and getattr(node.target, "is_view", False):
            node = node.args[0]
        return node

    output = next(n for n in gm.graph.nodes if n.op == "output")
    returned = list(output.args[0])
    seen: set = set()
    changed = False
    for i, value in enumerate(returned):
        if not isinstance(value, torch.fx.Node) or not isinstance(value.meta.get("val"), torch.Tensor):
            continue  # (an opaque value passed through: a device mesh)
        root = base(value)
        if root.op == "placeholder" or root in seen:
            with gm.graph.inserting_before(output):
                returned[i] = gm.graph.call_function(torch.ops.aten.clone.default, (value,))
            returned[i].meta = dict(value.meta)
            changed = True
        else:
            seen.add(root)
    if changed:
        output.args = (tuple(returned), *output.args[1:])
    return changed


def _mark_recomputed(joint: torch.fx.GraphModule) -> None:
    """The nodes the stage traced as recomputed regions (`runtime.recompute.recomputed`), marked as
    torch's selective checkpointing marks them: the partitioner keeps what they read and runs
    them again in the backward graph (a collective's output stays saved: `force_save_collectives`)."""
    from torch.utils.checkpoint import CheckpointPolicy

    for node in joint.graph.nodes:
        region = node.meta.get("custom", {}).get(RECOMPUTE)
        if region is not None and node.op == "call_function":
            node.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
            node.meta["ac_graph_id"] = region


def _as_dtensors(entry: _Entry, out: Any) -> Any:
    """The outputs as `interpret` returns them: one value, or a tuple (AOTAutograd gives a list),
    DTensors again where they were traced as DTensors."""
    if not any(entry.outputs):
        return tuple(out) if isinstance(out, list) else out
    outs = out if isinstance(out, (list, tuple)) else [out]
    outs = tuple(o if spec is None else DTensor.from_local(
        o, spec.mesh, spec.placements, run_check=False, shape=spec.shape, stride=spec.stride)
        for o, spec in zip(outs, entry.outputs))
    return outs if isinstance(out, (list, tuple)) else outs[0]


def _below_autograd(run: Callable) -> Callable:
    """`run` with the autograd and view-tracking dispatch keys skipped for each of its ops: the graph
    runs inside AOTAutograd's own autograd node, so nothing in it records a graph; skipping them saves
    their per-op cost, most of all on functional collectives, whose autograd kernel is Python."""
    def below(*args: Any) -> Any:
        with torch._C._AutoDispatchBelowADInplaceOrView():
            return run(*args)
    return below


def _autocast_state() -> tuple:
    return tuple((device, torch.get_autocast_dtype(device)) for device in ("cpu", "cuda")
                 if torch.is_autocast_enabled(device))
