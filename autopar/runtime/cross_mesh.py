"""Handing activations between pipeline stages whose logical meshes differ (cross-mesh resharding).

Stages of equal size pair their ranks by position (rank j of stage s sends to rank j of stage
s + 1), but with another (dp, tp) split, position j of the next stage holds a different slice of
the microbatch. So a value crosses such a boundary whole: the sending stage all-gathers it over
its data-parallel group (every rank then holds the whole microbatch, replicated), and each
receiving rank keeps its own data-parallel slice.

Gradients follow the data-parallel convention of the rest of the runtime: a rank's gradient is
that of its own mean loss, dp × its share of the global one (the synchroniser averages). Going
back, the receiving stage adds up its ranks' padded slice gradients (all-reduce over its dp
group) and divides by its dp: every rank holds the whole gradient of the global loss; the
sending rank takes its slice and multiplies by its own dp.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _GatherBatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int | None, group: dist.ProcessGroup) -> torch.Tensor:
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        ctx.dim, ctx.n, ctx.rank = dim, n, rank
        if dim is None:  # the same on every rank already
            return x.clone()
        # functional collectives, eager or traced (`runtime.lower`)
        name = group.group_name
        whole = torch.ops._c10d_functional.wait_tensor(
            torch.ops._c10d_functional.all_gather_into_tensor(x.contiguous(), n, name))
        return whole if dim == 0 else torch.cat(whole.chunk(n), dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        mine = grad if ctx.dim is None else grad.tensor_split(ctx.n, ctx.dim)[ctx.rank]
        return mine * ctx.n, None, None


class _SliceBatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int | None, group: dist.ProcessGroup) -> torch.Tensor:
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        ctx.dim, ctx.n, ctx.rank, ctx.group, ctx.shape = dim, n, rank, group, x.shape
        return x.clone() if dim is None else x.tensor_split(n, dim)[rank].clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.dim is None:
            full = grad.clone()
        else:
            full = grad.new_zeros(ctx.shape)
            full.narrow(ctx.dim, ctx.rank * grad.shape[ctx.dim], grad.shape[ctx.dim]).copy_(grad)
        full = torch.ops._c10d_functional.wait_tensor(
            torch.ops._c10d_functional.all_reduce(full, "sum", ctx.group.group_name))
        return full / ctx.n, None, None


def gather_batch(x: torch.Tensor, dim: int | None, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's slice of a value → the whole microbatch (a value without a batch dimension
    passes as it is; its gradient is scaled like a slice's)."""
    if not x.is_floating_point() and dim is None:
        return x
    return _GatherBatch.apply(x, dim, group)


def slice_batch(x: torch.Tensor, dim: int | None, group: dist.ProcessGroup) -> torch.Tensor:
    """The whole microbatch → this rank's slice (a value without a batch dimension passes as it
    is; its gradients from all ranks are added up)."""
    if not x.is_floating_point():
        return x if dim is None else x.tensor_split(dist.get_world_size(group), dim)[dist.get_rank(group)]
    return _SliceBatch.apply(x, dim, group)


def batch_dims(small: torch.fx.Graph, large: torch.fx.Graph, names: list[str]) -> dict[str, int | None]:
    """The batch dimension of each named value, from two exports at different batch sizes."""
    a = {n.name: n.meta.get("val") for n in small.nodes}
    b = {n.name: n.meta.get("val") for n in large.nodes}
    out: dict[str, int | None] = {}
    for name in names:
        x, y = a.get(name), b.get(name)
        dims = [d for d, (p, q) in enumerate(zip(getattr(x, "shape", ()), getattr(y, "shape", ()))) if p != q]
        out[name] = dims[0] if dims else None
    return out
