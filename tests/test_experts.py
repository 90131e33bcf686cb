"""Expert parallelism's grouped matmul on a rank's own experts: one opaque op a program can trace."""

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from autopar.runtime.experts import local_experts

FALLBACK = "transformers::grouped_mm_fallback"


def test_a_ranks_experts_multiply_their_own_tokens_and_pass_their_gradients():
    """Experts 1 and 2 of 4 on this rank: their tokens' rows are the grouped matmul's, the others
    zero (the rank's part of the sum), and the gradients are those of the rows it computed."""
    import transformers.integrations.moe  # noqa: F401  (registers the fallback op)

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(10, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 4, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    offs = torch.tensor([2, 5, 7, 10])
    mine = w[1:3].detach().clone().requires_grad_()
    out = local_experts(x, mine, offs, 1, FALLBACK)
    full = torch.ops.transformers.grouped_mm_fallback(x, w, offs)
    assert torch.equal(out[2:7], full[2:7]) and not out[:2].any() and not out[7:].any()
    grad = torch.randn(10, 3, generator=gen, dtype=torch.float64)
    gx, gw = torch.autograd.grad(out, (x, mine), grad)
    rx, rw = torch.autograd.grad(full, (x, w), torch.cat([grad[:2] * 0, grad[2:7], grad[7:] * 0]))
    assert torch.allclose(gx, rx) and torch.allclose(gw, rw[1:3])


def test_the_data_dependent_rows_stay_inside_one_traced_op():
    """Traced with fake tensors (as the lowering traces a stage), the op is one node: the rows,
    which depend on the router's counts, are sliced inside it."""
    import transformers.integrations.moe  # noqa: F401

    x, w, offs = torch.randn(10, 4), torch.randn(2, 4, 3), torch.tensor([2, 5, 7, 10])
    gm = make_fx(lambda a, b, c: local_experts(a, b, c, 1, FALLBACK), tracing_mode="fake")(x, w, offs)
    calls = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert calls == [torch.ops.autopar.local_experts.default]
