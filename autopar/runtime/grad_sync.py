"""Data-parallel gradient averaging in buckets, launched while backward still runs (DDP's scheme).

DDP itself is not used because the data axis needs a point where compressors and delayed
averaging can replace the all-reduce (see DESIGN.md): `reduce` is that point. Buckets follow the
reverse order of the parameters (roughly the order backward produces their gradients); a bucket
is reduced as soon as its last gradient is accumulated, asynchronously, and `finish()` waits for
all of them and averages in place: the gradients are views of their bucket's buffer (DDP's
`gradient_as_bucket_view`), pointed there before backward wherever they are None (the step's
`zero_grad`, or yours in your own loop), so backward accumulates into the buffer, nothing is
copied in or back, and the end of backward holds the gradients once, not twice; a gradient you
set to a tensor of your own is copied in at launch. Under
gradient accumulation (pipeline microbatches), only the backward that runs with `sync=True`
launches anything. With a compressor
(`runtime.compression`) the buckets are compressed and averaged in `finish()`, after backward:
their collectives come in rounds whose sizes depend on the data. A compressor that carries the
momentum (DGC, 1-bit SGD) but compresses nothing here averages as dense does (`momentum`): each
rank's gradient clipped as it is produced, the buckets overlapped with backward, the momentum
applied to the averages in `finish()`.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from autopar.contract.buckets import BUCKET_BYTES, bucketed


def local(t: torch.Tensor) -> torch.Tensor:
    """The shard a rank holds (DTensor parameters sync their local tensors on the data axis)."""
    return t.to_local() if hasattr(t, "to_local") else t


def write_grad(p: torch.nn.Parameter, value: torch.Tensor) -> None:
    if p.grad is None:
        p.grad = value.clone() if not hasattr(p, "to_local") else None
    else:
        local(p.grad).copy_(value)


@dataclass
class EmulatedLink:
    """A slower link than the one at hand, for benchmarks (labelled emulated wherever reported):
    a collective's result is usable only `latency + bytes / bandwidth` seconds after its launch."""

    latency: float = 0.0
    bandwidth: float = float("inf")  # bytes per second

    def wait(self, launched: float, nbytes: int) -> None:
        delay = launched + self.latency + nbytes / self.bandwidth - time.perf_counter()
        if delay > 0:
            time.sleep(delay)


@dataclass
class _Bucket:
    params: list[torch.nn.Parameter]
    ready: int = 0
    flat: torch.Tensor | None = None  # what the collective reduces
    work: object = None
    in_backward: bool = False  # launched from a gradient hook, i.e. overlapped with backward
    launched: float = 0.0
    buffer: torch.Tensor | None = None  # plain buckets: the gradients' home, one slot over for a carried scalar
    views: list[torch.Tensor] = field(default_factory=list)  # each parameter's gradient as a view of `buffer`
    sizes: list[int] = field(default_factory=list)  # each parameter's elements (its local shard's)
    nbytes: int = 0  # the gradients' bytes
    plain: bool = True  # plain tensors of one dtype: gradients can be views of the buffer
    viewed: bool = False  # this step's gradients are views of `flat`

    def __post_init__(self) -> None:
        self.sizes = [local(p).numel() for p in self.params]
        self.nbytes = sum(local(p).numel() * local(p).element_size() for p in self.params)
        self.plain = len({p.dtype for p in self.params}) == 1 and not any(hasattr(p, "to_local") for p in self.params)

    def _views(self) -> list[torch.Tensor]:
        """The bucket's buffer, allocated once and kept (as DDP's reducer keeps its buckets), and its
        views shaped as the parameters: made once, so pointing a gradient at its view is a
        pointer's assignment (gpt-tiny's 36: 11 µs, against 160 µs splitting and reshaping anew)."""
        if self.buffer is None:
            first = self.params[0]
            self.buffer = torch.empty(sum(self.sizes) + 1, dtype=first.dtype, device=first.device)
            self.views = [v.view_as(p) for p, v in zip(self.params, self.buffer[:-1].split(self.sizes))]
        return self.views

    def attach(self) -> None:
        """Point every gradient that is None (a `zero_grad()`, yours or the step's) at its view,
        zeroed: backward then accumulates into the buffer in place (autograd adds into a gradient
        that exists) and `gather` neither copies nor re-points. A gradient you set to a tensor of
        your own is left to `gather`. The buffer is zeroed in place, so a gradient kept from the
        step before changes with it (as under DDP's `gradient_as_bucket_view`)."""
        if not self.plain:
            return
        views = self._views()
        unset = [(p, view) for p, view in zip(self.params, views) if p.grad is None]
        whole = len(unset) == len(self.params)
        if whole:  # one fill for the bucket
            self.buffer[:-1].zero_()
        for p, view in unset:
            if not whole:
                view.zero_()
            p.grad = view

    def gather(self, carry: torch.Tensor | None) -> None:
        """`flat`: the bucket's gradients (zeros for those that never arrived), with `carry` last.
        Gradients that are their views (`attach`) are reduced where they accumulated; others are
        copied into their views and re-pointed there, so each fresh gradient is freed as its bucket
        launches. A bucket of DTensor shards (whose gradients cannot be views of a plain buffer) or
        mixed dtypes is gathered into a buffer of its own, written back by `scatter`."""
        n = sum(self.sizes)
        self.viewed = self.plain
        if self.plain:
            views = self._views()
            fresh = [(p, v) for p, v in zip(self.params, views) if p.grad is not v]
            if fresh:
                given = [(v, p.grad) for p, v in fresh if p.grad is not None]
                if given:
                    torch._foreach_copy_([v for v, _ in given], [g for _, g in given])
                for p, v in fresh:
                    if p.grad is None:
                        v.zero_()
                    p.grad = v
            buffer = self.buffer
        else:
            grads = [(local(p.grad) if p.grad is not None else torch.zeros_like(local(p))).reshape(-1)
                     for p in self.params]
            dtype = functools.reduce(torch.promote_types, (g.dtype for g in grads))
            buffer = torch.empty(n + 1, dtype=dtype, device=grads[0].device)
            torch.cat([g if g.dtype == dtype else g.to(dtype) for g in grads], out=buffer[:n])
        if carry is not None:
            buffer[n] = carry
        self.flat = buffer if carry is not None else buffer[:n]

    def scatter(self, world: int) -> torch.Tensor | None:
        """Average in place (gradients that are views of the buffer now hold their average) and
        write back those that are not; the carried sum, if any."""
        n = sum(self.sizes)
        carried = self.flat[-1].clone() if self.flat.numel() > n else None
        averaged = self.flat[:n].div_(world)
        if not self.viewed:
            for p, avg in zip(self.params, averaged.split(self.sizes)):
                write_grad(p, avg.view_as(local(p)))
        return carried


@dataclass
class SyncStats:
    """What this rank handed to collectives (bytes) and how many it issued."""

    bytes_raw: int = 0
    bytes_sent: int = 0
    collectives: list[tuple[str, int]] = field(default_factory=list)  # (kind, bytes)
    overlapped: int = 0  # buckets launched while backward still ran


def all_reduce(flat: torch.Tensor, group: dist.ProcessGroup | None) -> object:
    return dist.all_reduce(flat, group=group, async_op=True)


class GradSync:
    """Averages the gradients of `params` over `group` in buckets of `bucket_bytes`."""

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        group: dist.ProcessGroup | None = None,
        bucket_bytes: int = BUCKET_BYTES,
        reduce: Callable[[torch.Tensor, dist.ProcessGroup | None], object] = all_reduce,
        compressed: Any = None,
        link: EmulatedLink | None = None,
        travels: dict[torch.nn.Parameter, bool] | None = None,
        momentum: Any = None,
    ) -> None:
        """`travels`: which gradients the compressor compresses (the plan's decision; None: every
        weight matrix). `momentum`: the memory (`runtime.compression.momentum_memory`) of a
        compressor that carries the momentum where the plan compresses nothing: its local clipping
        and its momentum around the plain averaging, keyed as the compressor keys it."""
        self.group, self.reduce, self.compressed, self.link = group, reduce, compressed, link
        self.travels, self.momentum = travels, momentum
        self.world = dist.get_world_size(group)
        self.sync = True
        self.stats = SyncStats()
        self._carry: torch.Tensor | None = None  # a value summed with the step's last bucket (`carry`)
        self.carried: torch.Tensor | None = None  # its sum over the group, once `finish` ran
        self._launched = 0
        ordered = list(reversed([p for p in params if p.requires_grad]))  # as backward produces them
        self.buckets = [_Bucket([ordered[i] for i in group]) for group in bucketed(
            [local(p).numel() * local(p).element_size() for p in ordered], bucket_bytes)]
        for bucket in self.buckets:
            for p in bucket.params:
                p.register_post_accumulate_grad_hook(self._hook(bucket))
        dtypes = {local(p).dtype for b in self.buckets for p in b.params}
        self._carries = bool(dtypes) and dtypes <= {torch.float32, torch.float64}  # a loss rides along in full

    def _hook(self, bucket: _Bucket) -> Callable[[torch.Tensor], None]:
        def ready(p: torch.Tensor) -> None:
            if not self.sync or self.compressed is not None:
                return
            if self.momentum is not None and self.momentum.clip is not None and p.grad is not None:
                local(p.grad).mul_(self.momentum.clip_scale(local(p.grad)))  # DGC's local clipping, before it is sent
            bucket.ready += 1
            if bucket.ready == len(bucket.params):
                self._launch(bucket, in_backward=True)

        return ready

    @torch.no_grad()
    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """The step's `optimizer.zero_grad()`: every gradient set to None, then those of plain
        buckets pointed at their zeroed views (`_Bucket.attach`; DDP's `gradient_as_bucket_view`
        with `set_to_none=False`): backward accumulates into the buffers, so no bucket is copied
        and no gradient re-pointed at launch (gpt-tiny's 36 parameters: 0.4 ms a step of 14), and
        the gradients are held from the step's start, as the memory model counts them. With a
        compressor every gradient stays None."""
        optimizer.zero_grad(set_to_none=True)
        self.before_backward()

    @torch.no_grad()
    def before_backward(self) -> None:
        """At a backward's start (the module path, after your `zero_grad()`): gradients that are
        None get their zeroed views (`_Bucket.attach`)."""
        if self.compressed is None:
            for bucket in self.buckets:
                bucket.attach()

    def carry(self, value: torch.Tensor) -> bool:
        """Sum the scalar `value` over the group with the step's last gradient bucket instead of a
        collective of its own (the step's loss), where the buckets are all-reduced in a dtype
        that holds it (fp32 or wider); `finish` leaves the sum in `carried`. Whether it will."""
        if self.compressed is not None or not self._carries or not self.sync:
            return False
        self._carry = value
        return True

    def _launch(self, bucket: _Bucket, in_backward: bool) -> None:
        self._launched += 1
        last = self._launched == len(self.buckets) and self._carry is not None
        bucket.gather(self._carry if last else None)
        self.stats.bytes_raw += bucket.nbytes  # a carried scalar aside
        self.stats.bytes_sent += bucket.nbytes
        self.stats.collectives.append(("all_reduce", bucket.nbytes))
        bucket.work, bucket.in_backward = self.reduce(bucket.flat, self.group), in_backward
        bucket.launched = time.perf_counter()
        self.stats.overlapped += in_backward

    @torch.no_grad()
    def finish(self) -> None:
        """Wait for every bucket (launching those whose gradients never all arrived, e.g. unused
        parameters, so every rank issues the same collectives) and average."""
        if self.compressed is not None:
            self._finish_compressed()
            return
        for bucket in self.buckets:
            if bucket.work is None:
                self._launch(bucket, in_backward=False)
        for bucket in self.buckets:
            bucket.work.wait()
            if self.link is not None:
                self.link.wait(bucket.launched, bucket.flat.numel() * bucket.flat.element_size())
            carried = bucket.scatter(self.world)
            if carried is not None:
                self.carried = carried
            bucket.ready, bucket.flat, bucket.work = 0, None, None
        self._launched, self._carry = 0, None
        if self.momentum is not None:
            self._momentum()

    def _momentum(self) -> None:
        """The carried momentum on the averages: u = m·u + avg, the average of each rank's u (the
        update is linear); nothing was held back, so nothing stays behind and nothing is masked."""
        for b, bucket in enumerate(self.buckets):
            for i, p in enumerate(bucket.params):
                key, avg = f"{b}.{i}", local(p.grad) if p.grad is not None else torch.zeros_like(local(p))
                x = self.momentum.compensate(key, avg, clip=False)
                self.momentum.update(key, x, x, compressed=False)
                write_grad(p, x)

    def _finish_compressed(self) -> None:
        before = self.compressed.bytes_sent
        for b, bucket in enumerate(self.buckets):  # keys name the same gradient on every rank
            grads = [local(p.grad) if p.grad is not None else torch.zeros_like(local(p)) for p in bucket.params]
            self.stats.bytes_raw += sum(g.numel() * g.element_size() for g in grads)
            keys = [f"{b}.{i}" for i in range(len(grads))]
            launched, sent = time.perf_counter(), self.compressed.bytes_sent
            averages = self.compressed.average(grads, keys, None if self.travels is None
                                               else [self.travels[p] for p in bucket.params])
            if self.link is not None:
                self.link.wait(launched, self.compressed.bytes_sent - sent)
            for p, avg in zip(bucket.params, averages):
                write_grad(p, avg)
        self.stats.bytes_sent += self.compressed.bytes_sent - before
        self.stats.collectives += self.compressed.collectives
        self.compressed.collectives = []
        self.compressed.finish_step()

    def after_step(self) -> None:
        """After the optimizer's step (delayed averaging re-synchronises replicas there)."""

    def state_dict(self) -> dict[str, Any] | None:
        """Per-rank state a resumed run needs (a compressor's memories, a carried momentum); dense
        averaging has none."""
        if self.compressed is not None:
            return self.compressed.state_dict()
        return {"memory": dict(vars(self.momentum))} if self.momentum is not None else None

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if state is None:
            return
        if self.compressed is not None:
            self.compressed.load_state_dict(state)
        elif self.momentum is not None:
            vars(self.momentum).update(state["memory"])

    def reset_stats(self) -> SyncStats:
        stats, self.stats = self.stats, SyncStats()
        return stats
