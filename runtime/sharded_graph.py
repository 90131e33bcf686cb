"""The tensor axis at run time: the exported graph, op by op, with the plan's placements (DTensor).

The model is exported again at the shape one rank runs (its microbatch), so node names are the
plan's. Parameters become DTensors with the plan's tensor-axis placements; before each op its
inputs are redistributed to the placements the plan says it needs (`StagePlan.needs`), and after
it the output is brought to the plan's placement when DTensor chose another. Values replicated on
the tensor axis stay plain tensors between ops (no DTensor dispatch where nothing is split), and
each is wrapped once, so the partial gradients of all its split consumers add up before the one
all-reduce that makes them whole (the planner's assumption). Ops DTensor has no sharding rule for
(CPU attention, DESIGN.md §6) run on the local shards when the plan splits a dimension they treat
independently; the plan only splits such ops along letters present in all their inputs and outputs.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor

from autopar.capture import _WRAPPER_PREFIX, _export


_CHECKS = {torch.ops.aten._assert_tensor_metadata.default}
# attention on CPU: no DTensor rule (DTensor would try propagating through its decomposition, which
# takes minutes for a masked attention); the plan splits it by batch or heads, so it runs locally
_LOCAL = {torch.ops.aten.scaled_dot_product_attention.default,
          torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}


def placement(text: str) -> Placement:
    if text == "R":
        return Replicate()
    if text == "P":
        return Partial()
    return Shard(int(text[2:-1]))


def _same(have: Placement, want: Placement) -> bool:
    if isinstance(want, Partial):
        return isinstance(have, Partial)  # the embedding's masked partial sum is a partial sum too
    return have == want


def shard_parameters(model: nn.Module, params: dict[str, list[str]], mesh: DeviceMesh) -> None:
    """Replace each parameter of `model` by a DTensor with its plan placement on the tensor axis
    (every alias of a tied weight points to the one new parameter)."""
    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    for names in aliases.values():
        p = model.get_parameter(names[0])
        spec = next((params[n][1] for n in names if n in params), "R")
        new = nn.Parameter(distribute_tensor(p.detach(), mesh, [placement(spec)]), requires_grad=p.requires_grad)
        if new.requires_grad:  # registered first: the gradient synchroniser's hooks see the fixed gradient
            new.register_post_accumulate_grad_hook(_grad_like_param)
        for name in names:
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner), leaf, new)


def _grad_like_param(p: torch.Tensor) -> None:
    """DTensor leaves a gradient where its backward rule put it (an embedding's can come back
    replicated); the optimizer and the synchroniser need it placed like the parameter."""
    if p.grad is not None and p.grad.placements != p.placements:
        p.grad = p.grad.redistribute(p.device_mesh, p.placements)


class ShardedGraph:
    """Runs `model`'s exported graph with the tensor-axis placements of one plan stage.

    Call it with one microbatch (this rank's slice); it returns the output as a plain tensor,
    replicated on the tensor axis, or this rank's samples of it when the plan leaves the output
    split by batch (`output_shard`; the loss is then computed per shard)."""

    def __init__(self, model: nn.Module, stage: Any, mesh: DeviceMesh, example_inputs: tuple) -> None:
        self.mesh, self.stage = mesh, stage
        ep = _export(model, example_inputs, {})  # before sharding: export traces plain tensors
        shard_parameters(model, stage.params, mesh)
        self.graph = ep.graph_module.graph
        sig = ep.graph_signature
        named = dict(model.named_parameters(remove_duplicate=False))
        buffers = dict(model.named_buffers(remove_duplicate=False))
        self.fixed: dict[str, Any] = {}  # placeholder -> parameter, buffer or constant
        self.user_inputs: list[str] = []
        for node in self.graph.nodes:
            if node.op != "placeholder":
                continue
            fqn = sig.inputs_to_parameters.get(node.name) or sig.inputs_to_buffers.get(node.name)
            if fqn is not None:
                fqn = fqn.removeprefix(_WRAPPER_PREFIX)
                self.fixed[node.name] = named[fqn] if fqn in named else buffers[fqn]
            elif node.name in sig.inputs_to_lifted_tensor_constants:
                self.fixed[node.name] = ep.constants[sig.inputs_to_lifted_tensor_constants[node.name]]
            else:
                self.user_inputs.append(node.name)
        out = next(n for n in self.graph.nodes if n.op == "output").args[0]
        self.output = out[0] if isinstance(out, (tuple, list)) else out
        want = stage.ops.get(self.output.name, ["R", "R"])[1]
        self.output_shard = want == "S(0)"  # split by batch (inputs carry it in dim 0): the loss runs per shard
        self.unplanned: list[str] = []  # ops whose output DTensor placed otherwise than the plan

    # ---- running ---------------------------------------------------------------------------

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        env: dict[fx.Node, Any] = {}
        wrapped: dict[fx.Node, DTensor] = {}  # replicated values wrapped once (see module docstring)
        user = iter(inputs)
        for node in self.graph.nodes:
            if node.op == "placeholder":
                env[node] = self.fixed[node.name] if node.name in self.fixed else next(user)
            elif node.op == "call_function":
                env[node] = self._run(node, env, wrapped)
            elif node.op == "get_attr":
                raise RuntimeError(f"unexpected get_attr {node.target} in an exported graph")
        out = env[self.output]
        if isinstance(out, DTensor):
            want = Shard(0) if self.output_shard else Replicate()
            return (out if out.placements[0] == want else out.redistribute(self.mesh, [want])).to_local()
        return out.tensor_split(self.mesh.size())[self.mesh.get_local_rank()] if self.output_shard else out

    def _run(self, node: fx.Node, env: dict, wrapped: dict) -> Any:
        if node.target is operator.getitem:
            return operator.getitem(env[node.args[0]], node.args[1])
        if node.target in _CHECKS and any(isinstance(env[i], DTensor) for i in node.all_input_nodes):
            return None  # export's metadata checks (global shapes, already checked when exporting)
        needs = self.stage.needs.get(node.name) or []
        want = self.stage.ops[node.name][1] if node.name in self.stage.ops else None  # None: as DTensor places it
        inputs = node.all_input_nodes
        need = {inp: needs[i] for i, inp in enumerate(inputs) if i < len(needs) and needs[i] is not None}
        split = want not in (None, "R") or any(p != "R" for p in need.values()) or any(isinstance(env[i], DTensor) for i in inputs)
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
            if inp in need and not _same(value.placements[0], placement(need[inp])):
                value = value.redistribute(self.mesh, [placement(need[inp])])
            return value

        args = fx.node.map_arg(node.args, arg)
        kwargs = fx.node.map_arg(node.kwargs, arg)
        if node.target in _LOCAL:
            out = self._run_local(node, args, kwargs, want)
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
            if want is not None and not _same(out.placements[0], placement(want)):
                self.unplanned.append(node.name)
                out = out.redistribute(self.mesh, [placement(want)])
            if isinstance(out.placements[0], Replicate):
                out = out.to_local()
        return out

    def _run_local(self, node: fx.Node, args: tuple, kwargs: dict, want: str | None) -> Any:
        """An op without a DTensor rule, on each rank's shards: valid when every split input and the
        output are split along a dimension the op treats independently (batch, heads)."""
        if want is None or want == "P" or want == "R" and any(
                isinstance(a, DTensor) and not isinstance(a.placements[0], Replicate) for a in args):
            raise NotImplementedError(f"{node.target} has no DTensor sharding rule and the plan splits it "
                                      f"as {want}: it cannot run on local shards")
        local = [a.to_local() if isinstance(a, DTensor) else a for a in args]
        out = node.target(*local, **kwargs)
        return DTensor.from_local(out, self.mesh, [placement(want)], run_check=False)
