"""Expert parallelism's grouped matmul on the experts this rank holds, as one opaque op.

Where a rank's experts' tokens start and end depends on the data (the router's counts), so the
slicing cannot be traced into a static graph: `make_fx` would stop at `offs.tolist()` and the
stage would run op by op. As a custom op with a shape function (its output has the input's rows
and the weight's columns) and a backward of its own, the lowering traces it as one node, as
transformers makes its own grouped-matmul fallback opaque to `torch.compile`.
"""

from __future__ import annotations

import torch


def _grouped_op(name: str) -> torch._ops.OpOverload:
    """`name` ("transformers::grouped_mm_fallback", "aten::_grouped_mm") as the op to call."""
    namespace, op = name.split("::")
    return getattr(getattr(torch.ops, namespace), op).default


def _rows(offs: torch.Tensor, first: int, count: int) -> tuple[int, int]:
    """The rows of experts [first, first + count): tokens are sorted by expert, `offs` each
    expert's running token count."""
    bounds = [0, *offs.tolist()]
    return bounds[first], bounds[first + count]


@torch.library.custom_op("autopar::local_experts", mutates_args=())
def local_experts(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, first: int, op: str) -> torch.Tensor:
    """`op` (a grouped matmul) of the rows of experts [first, first + len(weight)) by their weights
    (this rank's); the other experts' rows zero: one rank's part of the sum over ranks."""
    start, end = _rows(offs, first, weight.shape[0])
    out = x.new_zeros(x.shape[0], weight.shape[2])
    out[start:end] = _grouped_op(op)(x[start:end], weight, offs[first:first + weight.shape[0]] - start)
    return out


@local_experts.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, first: int, op: str) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[2])


@torch.library.custom_op("autopar::local_experts_backward", mutates_args=())
def local_experts_backward(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, first: int,
                           grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of `local_experts` for x (zero outside this rank's rows) and its weights: per
    expert, its rows' gradient by its weight, and its rows by their gradient (a grouped matmul's
    backward, as transformers' fallback computes it; autograd does not run inside a custom op)."""
    bounds = [0, *offs.tolist()][first:first + weight.shape[0] + 1]
    grad_x, grad_weight = torch.zeros_like(x), torch.zeros_like(weight)
    for e, (start, end) in enumerate(zip(bounds, bounds[1:])):
        if end > start:
            grad_x[start:end] = grad[start:end] @ weight[e].T
            grad_weight[e] = x[start:end].T @ grad[start:end]
    return grad_x, grad_weight


@local_experts_backward.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, first: int,
      grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(weight)


def _setup(ctx, inputs, output) -> None:
    x, weight, offs, first, op = inputs
    ctx.save_for_backward(x, weight, offs)
    ctx.first = first


def _backward(ctx, grad: torch.Tensor) -> tuple:
    x, weight, offs = ctx.saved_tensors
    grad_x, grad_weight = local_experts_backward(x, weight, offs, ctx.first, grad)
    return grad_x, grad_weight, None, None, None


local_experts.register_autograd(_backward, setup_context=_setup)

