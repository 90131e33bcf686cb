"""Compressed gradient averaging on the data-parallel axis: memory, communicator, and the spec
strings users write (`compression="dgc:0.999"`).

Three parts kept apart, as in GRACE: the compressor (`runtime.compressors`: encode/decode), the
memory (error feedback: what was not sent is added to the next step's gradient; DGC's momentum
correction), and the communicator (all-reduce for summable encodings, all-gather for the others,
majority vote for signs). `Compressed.average` is what `GradSync` calls per bucket instead of its
dense all-reduce, and reports the bytes it handed to collectives.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from autopar.contract.compression import Spec, carries_momentum, dense_start, matrix, parse
from autopar.runtime.compressors import (
    QSGD,
    DGCSelect,
    Half,
    OneBit,
    PowerSGD,
    RandomK,
    SignSGD,
    TernGrad,
    Threshold,
    TopK,
)

log = logging.getLogger(__name__)

# ---- memory ---------------------------------------------------------------------------------------


@dataclass
class ErrorFeedback:
    """Residuals per gradient: compensate(g) = g + e; after sending, e = compensated − sent."""

    residual: dict[str, torch.Tensor] = field(default_factory=dict)

    def compensate(self, key: str, grad: torch.Tensor) -> torch.Tensor:
        e = self.residual.get(key)
        return grad.clone() if e is None else grad + e

    def update(self, key: str, compensated: torch.Tensor, sent: torch.Tensor, compressed: bool = True) -> None:
        self.residual[key] = compensated - sent


@dataclass
class NoMemory:
    def compensate(self, key: str, grad: torch.Tensor) -> torch.Tensor:
        return grad

    def update(self, key: str, compensated: torch.Tensor, sent: torch.Tensor, compressed: bool = True) -> None:
        pass


@dataclass
class DGCMemory:
    """DGC's memory: momentum correction (accumulate the velocity u = m·u + g into v, and send
    from v), local gradient clipping (each rank clips the norm of each gradient at clip/√N), and
    momentum factor masking (u and v cleared where sent). Tensors sent dense (biases, small layers)
    and every tensor at 0 % sparsity are not masked: nothing is stale there, and the result is momentum SGD.
    Without masking it is also 1-bit SGD's memory: the momentum, compressed with error feedback
    (v is the residual plus this step's momentum), as 1-bit Adam compresses Adam's (Tang et al. 2021)."""

    momentum: float = 0.9
    clip: float | None = None
    ranks: int = 1
    masking: bool = True
    u: dict[str, torch.Tensor] = field(default_factory=dict)
    v: dict[str, torch.Tensor] = field(default_factory=dict)

    def clip_scale(self, grad: torch.Tensor) -> torch.Tensor:
        """The factor local clipping scales this rank's gradient by (its norm at most clip/√N; in
        float64, as Python's arithmetic on the norm would be), a tensor: no wait for the device."""
        return torch.clamp(self.clip / math.sqrt(self.ranks) / (grad.norm().double() + 1e-12), max=1.0)

    def compensate(self, key: str, grad: torch.Tensor, clip: bool = True) -> torch.Tensor:
        """`clip=False`: the gradient was clipped where it was computed (`GradSync` clips each
        rank's before averaging where nothing is compressed)."""
        if clip and self.clip is not None:
            grad = grad * self.clip_scale(grad)
        u = self.u[key] = self.momentum * self.u[key] + grad if key in self.u else grad.clone()
        v = self.v[key] = self.v[key] + u if key in self.v else u.clone()
        return v

    def update(self, key: str, compensated: torch.Tensor, sent: torch.Tensor, compressed: bool = True) -> None:
        self.v[key] = compensated - sent  # zero where sent: the selected values travel exactly
        if self.masking and compressed:
            self.u[key] = torch.where(sent != 0, 0, self.u[key])


def momentum_memory(spec: Spec, ranks: int, masking: bool = False) -> DGCMemory:
    """The memory of a compressor that carries the momentum (`carries_momentum`: DGC, 1-bit SGD),
    for the compressor or, where the plan compresses nothing, for the plain synchroniser."""
    return DGCMemory(spec.option("momentum"), spec.option("clip") or None, ranks, masking=masking)


def _compressor(spec: Spec, nccl: bool) -> Any:
    a = spec.arg
    return {
        "fp16": lambda: Half(torch.bfloat16 if nccl else torch.float16),
        "topk": lambda: TopK(a, warmup=spec.option("warmup")),
        "randk": lambda: RandomK(a),
        "dgc": lambda: DGCSelect(a, warmup=spec.option("warmup")),
        "powersgd": lambda: PowerSGD(int(a or 2)),
        "onebit": OneBit,
        "threshold": lambda: Threshold(a),
        "terngrad": lambda: TernGrad(spec.option("clip") or None),
        "qsgd": lambda: QSGD(int(a or 16)),
        "signsgd": SignSGD,
    }[spec.method]()


# ---- the communicator -----------------------------------------------------------------------------


def _once(x: torch.Tensor) -> Any:
    """A dense tensor as one all-reduce round: (sum over ranks, own)."""
    wire = x.clone()
    yield wire
    return wire, x


class Compressed:
    """Averages gradients over `group` through a compressor: `average(grads, keys)` returns the
    averages (signSGD: the vote) and counts what this rank handed to collectives."""

    def __init__(self, text: str, group: dist.ProcessGroup | None = None) -> None:
        self.spec = parse(text)
        self.group = group
        self.n = dist.get_world_size(group)
        self.compressor = _compressor(self.spec, "nccl" in str(dist.get_backend(group)))
        ef = self.spec.options.get("ef", 1.0 if self.compressor.error_feedback else 0.0)
        if carries_momentum(self.spec):  # DGC masks what it sent (`masking=0`: not); 1-bit's momentum is dense
            masking = self.spec.method == "dgc" and self.spec.arg > 0 and self.spec.options.get("masking", 1) != 0
            self.memory: Any = momentum_memory(self.spec, self.n, masking)
        else:
            self.memory = ErrorFeedback() if ef else NoMemory()
        # the compressors' own draws (sampling, stochastic rounding): independent across ranks, so
        # averaging reduces their noise, and apart from the model's random stream
        self.generator = torch.Generator().manual_seed(int(self.spec.options.get("seed", 0)) * 65537 + dist.get_rank())
        self.step = 0
        self.bytes_sent = 0
        self.collectives: list[tuple[str, int]] = []
        if self.spec.method == "signsgd" and dist.get_rank() == 0:
            log.warning("signsgd averages to a ±1 vote per coordinate: the learning rate is the step itself, about "
                        "1/100 of SGD's (the compression benchmark runs lr/100)")

    @property
    def per_tensor(self) -> bool:
        """Methods that scale by a layer's statistics see each gradient (DGC's threshold per layer,
        PowerSGD's and 1-bit's shapes, TernGrad's maximum, QSGD's buckets start at each layer); the
        others a bucket's compressed gradients end to end."""
        return isinstance(self.compressor, (DGCSelect, PowerSGD, OneBit, TernGrad, QSGD))

    def average(self, grads: list[torch.Tensor], keys: list[str], compressed: list[bool] | None = None
                ) -> list[torch.Tensor]:
        """One bucket. `compressed` says which gradients travel compressed (the plan's decision,
        `cost_models.compression.decide`; None: every weight matrix); the others, and all of
        them during a dense start (PowerSGD's, 1-bit SGD's), travel in one plain all-reduce, through the memory only
        where the compressor carries the momentum. signSGD votes on those too (its step is the
        vote's). The compressed ones' parts travel together, as torch's PowerSGD hook batches its
        Ps and Qs: one all-reduce per round, or one all-gather per kind of part, whatever the
        number of tensors (gloo pays about a millisecond per collective here)."""
        if compressed is None:
            compressed = [matrix(tuple(g.shape)) for g in grads]
        if dense_start(self.spec, self.step):
            compressed = [False] * len(grads)
        out: list[torch.Tensor | None] = [None] * len(grads)
        plain = [i for i, c in enumerate(compressed) if not c]
        carries = isinstance(self.memory, DGCMemory)
        xs = [self.memory.compensate(keys[i], grads[i]) if carries else grads[i] for i in plain]
        for i, x, (total, _) in zip(plain, xs, self._all_reduce_rounds([_once(x) for x in xs])):
            if carries:
                self.memory.update(keys[i], x, x, compressed=False)
            out[i] = total
        coded = [i for i, c in enumerate(compressed) if c]
        if coded:
            units, unit_keys = [grads[i] for i in coded], [keys[i] for i in coded]
            if not self.per_tensor:  # the bucket's compressed gradients as one
                units, unit_keys = [torch.cat([u.reshape(-1) for u in units])], [f"{unit_keys[0]}+{len(units)}"]
            totals = self._encoded(units, unit_keys)
            if not self.per_tensor:
                totals = list(totals[0].split([grads[i].numel() for i in coded]))
            for i, total in zip(coded, totals):
                out[i] = total.view_as(grads[i])
        vote = getattr(self.compressor, "vote", False)
        return [torch.sign(t) if vote else t / self.n for t in out]

    def _encoded(self, grads: list[torch.Tensor], keys: list[str]) -> list[torch.Tensor]:
        """The sums over ranks of these gradients (each through the memory) as the compressor
        encodes them."""
        xs = [self.memory.compensate(k, g) for g, k in zip(grads, keys)]
        c = self.compressor
        if c.allreduce:
            if hasattr(c, "prepare"):
                c.prepare(xs, keys)
            totals, owns = zip(*self._all_reduce_rounds([c.rounds(x, self.n, k, self.step) for x, k in zip(xs, keys)]))
        else:
            totals, owns = self._gathered(xs)
        for k, x, own in zip(keys, xs, owns):
            self.memory.update(k, x, own, compressed=own is not x)
        return list(totals)

    def _gathered(self, xs: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(sum over ranks, own decoded) of each tensor, for the methods whose parts are gathered.
        Where a sparse method's gathers would move as much as a dense all-reduce (a warm-up's first
        stage on 4 ranks and more, a density near the rate's break-even), the tensors travel whole
        in that all-reduce instead: the same bytes, nothing left in the residual, and, as at 0 %
        sparsity, no momentum masked (each rank's own decoded is then its tensor itself)."""
        if not xs:
            return [], []
        c = self.compressor
        parts = [c.compress(x, self.step, self.generator) for x in xs]
        dense_bytes = sum(2 * x.numel() * x.element_size() for x in xs) if getattr(c, "sparse", False) else None
        gathered = self._all_gather(parts, dense_bytes)
        if gathered is None:  # gathering would move more than a dense all-reduce: everything, dense
            total = self._all_reduce_rounds([_once(torch.cat([x.reshape(-1) for x in xs]))])[0][0]
            return [t.view_as(x) for t, x in zip(total.split([x.numel() for x in xs]), xs)], xs
        owns = [c.decompress(p, x) for p, x in zip(parts, xs)]
        totals = []
        for i, x in enumerate(xs):
            every = [g[i] for g in gathered]
            totals.append((c.decompress_sum(every, x) if hasattr(c, "decompress_sum")
                           else torch.stack([c.decompress(p, x) for p in every]).sum(0)).view_as(x))
        return totals, owns

    def _all_reduce_rounds(self, rounds: list[Any]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Drive every tensor's rounds together: each round's wires travel as one all-reduce (summed
        in place); a generator's return value is its (sum, own) pair."""
        results: list[Any] = [None] * len(rounds)
        wires = {i: next(r) for i, r in enumerate(rounds)}
        while wires:
            flat = torch.cat([w.reshape(-1) for w in wires.values()])
            self._collective("all_reduce", flat)
            dist.all_reduce(flat, group=self.group)
            for w, part in zip(wires.values(), flat.split([w.numel() for w in wires.values()])):
                w.copy_(part.view_as(w))
            following = {}
            for i in wires:
                try:
                    following[i] = rounds[i].send(None)
                except StopIteration as done:
                    results[i] = done.value
            wires = following
        return results

    def _all_gather(self, parts: list[list[torch.Tensor]], dense_bytes: int | None) -> list[list[list[torch.Tensor]]] | None:
        """Every rank's parts of every tensor, [rank][tensor][part]: each kind of part of all the
        tensors travels as one all-gather. Where their sizes may differ by rank, the sizes travel
        first (one small gather) and each rank's parts are padded to the longest. None when a
        sparse method's gathered volume would reach `dense_bytes`, what a ring all-reduce moves
        (every rank sees the same sizes, so all decide alike)."""
        sizes = torch.tensor([[p.numel() for p in ps] for ps in parts], dtype=torch.int64)  # tensors × kinds
        every = [sizes] * self.n
        if getattr(self.compressor, "variable", False):
            every = [torch.empty_like(sizes) for _ in range(self.n)]
            self._collective("all_gather", sizes)
            dist.all_gather(every, sizes, group=self.group)
        totals = torch.stack([s.sum(0) for s in every])  # ranks × kinds
        longest = totals.max(0).values
        if dense_bytes is not None and self.n * sum(int(k) * p.element_size() for k, p in zip(longest, parts[0])) >= dense_bytes:
            return None
        out: list[list[list[torch.Tensor]]] = [[[] for _ in parts] for _ in range(self.n)]
        for kind in range(len(parts[0])):
            mine = torch.cat([ps[kind].reshape(-1) for ps in parts])
            padded = torch.nn.functional.pad(mine, (0, int(longest[kind]) - mine.numel()))
            bufs = [torch.empty_like(padded) for _ in range(self.n)]
            self._collective("all_gather", padded)
            dist.all_gather(bufs, padded, group=self.group)
            for r in range(self.n):
                pieces = bufs[r][: int(totals[r, kind])].split(every[r][:, kind].tolist())
                for t, piece in enumerate(pieces):
                    out[r][t].append(piece)
        return out

    def _collective(self, kind: str, t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        self.bytes_sent += nbytes
        self.collectives.append((kind, nbytes))

    def finish_step(self) -> None:
        self.step += 1

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to continue this rank's exact trajectory: the step (warm-up
        schedules), the generator, the memory's residuals or momenta, the compressor's warm start."""
        return {"step": self.step, "generator": self.generator.get_state(), "memory": dict(vars(self.memory)),
                "compressor": dict(vars(self.compressor))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["step"]
        self.generator.set_state(state["generator"])
        vars(self.memory).update(state["memory"])
        vars(self.compressor).update(state["compressor"])
