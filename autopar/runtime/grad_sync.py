"""Data-parallel gradient averaging in buckets, launched while backward still runs (DDP's scheme).

DDP itself is not used because the data axis needs a point where compressors and delayed
averaging can replace the all-reduce (see DESIGN.md): `reduce` is that point. Buckets follow the
reverse order of the parameters (roughly the order backward produces their gradients); a bucket
is reduced as soon as its last gradient is accumulated, asynchronously, and `finish()` waits for
all of them and writes the averages back. Under gradient accumulation (pipeline microbatches),
only the backward that runs with `sync=True` launches anything. With a compressor
(`runtime.compression`) the buckets are compressed and averaged in `finish()`, after backward:
their collectives come in rounds whose sizes depend on the data.
"""

from __future__ import annotations

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
    flat: torch.Tensor | None = None
    work: object = None
    in_backward: bool = False  # launched from a gradient hook, i.e. overlapped with backward
    launched: float = 0.0


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
    ) -> None:
        self.group, self.reduce, self.compressed, self.link = group, reduce, compressed, link
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

    def _hook(self, bucket: _Bucket) -> Callable[[torch.Tensor], None]:
        def ready(_: torch.Tensor) -> None:
            if not self.sync or self.compressed is not None:
                return
            bucket.ready += 1
            if bucket.ready == len(bucket.params):
                self._launch(bucket, in_backward=True)

        return ready

    def carry(self, value: torch.Tensor) -> bool:
        """Sum the scalar `value` over the group with the step's last gradient bucket instead of a
        collective of its own (the step's loss), where the buckets are all-reduced in a dtype
        that holds it (fp32 or wider); `finish` leaves the sum in `carried`. Whether it will."""
        dtypes = {local(p).dtype for b in self.buckets for p in b.params}
        if self.compressed is not None or not dtypes or not dtypes <= {torch.float32, torch.float64} or not self.sync:
            return False
        self._carry = value
        return True

    def _launch(self, bucket: _Bucket, in_backward: bool) -> None:
        grads = [local(p.grad) if p.grad is not None else torch.zeros_like(local(p)) for p in bucket.params]
        self._launched += 1
        last = self._launched == len(self.buckets) and self._carry is not None
        bucket.flat = torch.cat([g.reshape(-1) for g in grads]
                                + ([self._carry.reshape(1).to(grads[0].dtype)] if last else []))
        nbytes = sum(g.numel() * g.element_size() for g in grads)  # the gradients' (a carried scalar aside)
        self.stats.bytes_raw += nbytes
        self.stats.bytes_sent += nbytes
        self.stats.collectives.append(("all_reduce", nbytes))
        bucket.work, bucket.in_backward = self.reduce(bucket.flat, self.group), in_backward
        bucket.launched = time.perf_counter()
        self.stats.overlapped += in_backward

    @torch.no_grad()
    def finish(self) -> None:
        """Wait for every bucket (launching those whose gradients never all arrived, e.g. unused
        parameters, so every rank issues the same collectives) and write the averages back."""
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
            sizes = [local(p).numel() for p in bucket.params]
            if bucket.flat.numel() > sum(sizes):  # the carried sum, before averaging
                self.carried = bucket.flat[-1].clone()
            averaged = bucket.flat[:sum(sizes)].div_(self.world)
            for p, avg in zip(bucket.params, averaged.split(sizes)):
                write_grad(p, avg.view_as(local(p)))
            bucket.ready, bucket.flat, bucket.work = 0, None, None
        self._launched, self._carry = 0, None

    def _finish_compressed(self) -> None:
        before = self.compressed.bytes_sent
        for b, bucket in enumerate(self.buckets):  # keys name the same gradient on every rank
            grads = [local(p.grad) if p.grad is not None else torch.zeros_like(local(p)) for p in bucket.params]
            self.stats.bytes_raw += sum(g.numel() * g.element_size() for g in grads)
            keys = [f"{b}.{i}" for i in range(len(grads))]
            launched, sent = time.perf_counter(), self.compressed.bytes_sent
            averages = self.compressed.average(grads, keys)
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
        """Per-rank state a resumed run needs (a compressor's memories); dense averaging has none."""
        return self.compressed.state_dict() if self.compressed is not None else None

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if self.compressed is not None and state is not None:
            self.compressed.load_state_dict(state)

    def reset_stats(self) -> SyncStats:
        stats, self.stats = self.stats, SyncStats()
        return stats
