"""The data-parallel synchronizer: averaged gradients equal single-process ones, in overlapped buckets."""

import torch
from torch import nn

from autopar.runtime.grad_sync import GradSync
from tests.distributed import run_ranks


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def _dp_grads(rank, world, bucket_bytes, microbatches):
    model = _model()
    sync = GradSync(list(model.parameters()), bucket_bytes=bucket_bytes)
    x, y = _batch()
    xs, ys = x.chunk(world)[rank].chunk(microbatches), y.chunk(world)[rank].chunk(microbatches)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = []
    def viewed():  # every gradient is its view of its bucket's buffer
        return all(b.buffer is not None and p.grad is v for b in sync.buckets for p, v in zip(b.params, b.views))

    # gradients set to None and left so (copied in at launch); `pm.step`'s zero_grad (one fill per
    # bucket); your own loop's `zero_grad()`, then the module's start of backward (`before_backward`)
    for start in ("fresh", "step", "yours"):
        optimizer.zero_grad(set_to_none=True)
        if start == "step":
            sync.zero_grad(optimizer)
        elif start == "yours":
            sync.before_backward()
        if start != "fresh":
            assert viewed() and all(not p.grad.any() for p in model.parameters())
        for i, (xm, ym) in enumerate(zip(xs, ys)):
            sync.sync = i == microbatches - 1  # accumulate locally, reduce on the last microbatch only
            (nn.functional.mse_loss(model(xm), ym) / microbatches).backward()
        sync.finish()
        stats = sync.reset_stats()
        steps.append(({n: p.grad.clone() for n, p in model.named_parameters()}, stats.collectives,
                      [b.in_backward for b in sync.buckets], stats.bytes_raw, viewed()))
    return steps


def test_averaged_gradients_equal_single_process_and_overlap_backward(tmp_path):
    model = _model()
    x, y = _batch()
    nn.functional.mse_loss(model(x), y).backward()
    expected = {n: p.grad for n, p in model.named_parameters()}
    bucket = 4096  # bytes: force several buckets
    results = run_ranks(_dp_grads, 2, tmp_path, bucket, 2)
    for steps in results:
        for grads, collectives, overlapped, nbytes, in_buckets in steps:
            for name, g in grads.items():
                torch.testing.assert_close(g, expected[name], rtol=1e-5, atol=1e-7)
            assert len(collectives) == len(overlapped) >= 2 and {k for k, _ in collectives} == {"all_reduce"}
            assert all(overlapped)  # every bucket launched from a gradient hook, during backward
            assert nbytes == sum(p.numel() * 4 for p in model.parameters())  # each gradient once per step
            assert in_buckets  # the averages are views of the buckets: no copy of every gradient held beside them
