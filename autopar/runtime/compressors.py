"""Gradient compressors: what one rank puts on the wire for a gradient, and how it reads it back.

A compressor only encodes and decodes; the error-feedback memory (`runtime.compression`) decides
what it is given, and the communicator how the encoded parts travel:

- summable ones (`allreduce = True`) produce tensors whose sums across ranks mean something, so
  they are all-reduced: fp16 / bf16, shared-seed random-k, PowerSGD (two rounds). They are written
  as generators: each `yield` hands a tensor to the all-reduce (summed in place) and the return
  value is (sum over ranks, this rank's own contribution as the sum would count it);
- the others are all-gathered and each rank decodes every rank's part: top-k, DGC, threshold
  quantisation, 1-bit SGD, TernGrad, QSGD; signSGD's parts are majority-voted instead of summed.

Signs and ternary values travel bit-packed (uint8), indices as int32.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Generator
from dataclasses import dataclass, field

import numpy as np
import torch

from autopar.contract.compression import DGC_WARMUP_STEPS, dgc_density

# ---- bit packing --------------------------------------------------------------------------------

_WEIGHTS = {bits: torch.tensor([1 << (bits * i) for i in range(8 // bits)], dtype=torch.int32)
            for bits in (1, 2)}


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Small non-negative integer codes (< 2**bits) → uint8, 8 // bits codes per byte."""
    per = 8 // bits
    flat = codes.reshape(-1).to(torch.int32)
    flat = torch.nn.functional.pad(flat, (0, -flat.numel() % per))
    return (flat.view(-1, per) * _WEIGHTS[bits].to(flat.device)).sum(1).to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    codes = (packed.to(torch.int32).unsqueeze(1) // _WEIGHTS[bits].to(packed.device)) % (1 << bits)
    return codes.reshape(-1)[:n]


# ---- all-reduced ---------------------------------------------------------------------------------

Rounds = Generator[torch.Tensor, None, tuple[torch.Tensor, torch.Tensor]]


@dataclass
class Half:
    """fp16 (bf16 where NCCL runs: its range is fp32's). Divided by the ranks first, as torch's
    fp16 hook does, so the sum cannot overflow where the mean would not."""

    dtype: torch.dtype = torch.float16
    allreduce = True
    error_feedback = False

    def rounds(self, x: torch.Tensor, n: int, key: str, step: int) -> Rounds:
        wire = (x / n).to(self.dtype)
        own = wire.to(x.dtype) * n
        yield wire
        return wire.to(x.dtype) * n, own


@dataclass
class RandomK:
    """Random-k with a seed every rank shares: all ranks pick the same coordinates, so the values
    add up (an all-reduce of k values instead of a gather of values and indices)."""

    ratio: float
    seed: int = 0
    allreduce = True
    error_feedback = True

    def rounds(self, x: torch.Tensor, n: int, key: str, step: int) -> Rounds:
        flat = x.reshape(-1)
        k = max(1, math.ceil(flat.numel() * self.ratio))
        gen = torch.Generator().manual_seed(hash((self.seed, step, zlib.crc32(key.encode()))) % 2**63)
        index = torch.randperm(flat.numel(), generator=gen)[:k].to(flat.device)
        values = flat[index].clone()
        own = torch.zeros_like(flat).index_copy_(0, index, values)
        yield values
        return torch.zeros_like(flat).index_copy_(0, index, values).view_as(x), own.view_as(x)


@dataclass
class PowerSGD:
    """Rank-r PowerSGD (Vogels et al. 2019): one power iteration per step, warm-started from the
    previous step's Q, orthogonalised before use; the error is taken against the averaged
    approximation, as in the paper. A bucket's first Qs are drawn as torch's hook draws them
    (`prepare`), so both start from the same Q. The dense start is the communicator's
    (`contract.compression.dense_start`)."""

    rank: int = 2
    seed: int = 0
    allreduce = True
    error_feedback = True
    _q: dict[str, torch.Tensor] = field(default_factory=dict)
    _draws: int = 0  # buckets started: the numpy generator's draws so far (a checkpoint holds plain values)

    def prepare(self, xs: list[torch.Tensor], keys: list[str]) -> None:
        """Random Qs for a bucket's gradients that have none, as torch's PowerSGD hook draws them at
        its first compressed step: one seed per bucket from a numpy generator seeded with `seed`
        (the same on every rank), then a normal draw per matrix, grouped by shape in order of first
        appearance."""
        missing = [(x, k) for x, k in zip(xs, keys) if self._shape(x) != self._q.get(k, torch.empty(0)).shape]
        if not missing:
            return
        self._draws += 1
        seed = np.random.RandomState(self.seed).randint(1_000_000_000, size=self._draws)[-1]
        gen = torch.Generator().manual_seed(int(seed))
        shapes = list(dict.fromkeys(self._shape(x) for x, _ in missing))
        for shape in shapes:
            for x, k in missing:
                if self._shape(x) == shape:
                    self._q[k] = torch.randn(shape, generator=gen).to(x)

    def _shape(self, x: torch.Tensor) -> tuple[int, int]:
        cols = x.numel() // x.shape[0]
        return (cols, min(self.rank, x.shape[0], cols))

    def rounds(self, x: torch.Tensor, n: int, key: str, step: int) -> Rounds:
        m = x.reshape(x.shape[0], -1)
        if key not in self._q:
            self.prepare([x], [key])
        q = torch.linalg.qr(self._q[key]).Q
        p = m @ q
        yield p  # summed over ranks
        p = torch.linalg.qr(p).Q
        q = m.T @ p
        yield q  # summed over ranks
        self._q[key] = q / n
        approx = (p @ q.T).view_as(x)
        return approx, approx / n


# ---- all-gathered -------------------------------------------------------------------------------


def _sparse(flat: torch.Tensor, index: torch.Tensor) -> list[torch.Tensor]:
    return [flat[index].clone(), index.to(torch.int32)]


def _dense(parts: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    values, index = parts
    return torch.zeros(like.numel(), dtype=like.dtype, device=like.device).index_add_(
        0, index.long(), values).view_as(like)


class _Sparse:
    """Values and indices: every rank's parts decode into one sum with a single scatter-add."""

    def decompress(self, parts: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
        return _dense(self.values_and_indices(parts, like), like)

    def decompress_sum(self, every: list[list[torch.Tensor]], like: torch.Tensor) -> torch.Tensor:
        pairs = [self.values_and_indices(p, like) for p in every]
        return _dense([torch.cat([v for v, _ in pairs]), torch.cat([i for _, i in pairs])], like)

    def values_and_indices(self, parts: list[torch.Tensor], like: torch.Tensor) -> list[torch.Tensor]:
        return parts


@dataclass
class TopK(_Sparse):
    """Top-k by magnitude (Aji & Heafield 2017), values and int32 indices; the fraction kept warms
    down to `ratio` over DGC's stages of `warmup` steps (`contract.compression.dgc_density`)."""

    ratio: float
    warmup: float = 0
    allreduce = False
    error_feedback = True
    sparse = True  # falls back to a dense all-reduce of the whole tensors when gathering would move more

    def k(self, numel: int, step: int) -> int:
        return max(1, math.ceil(numel * dgc_density(1 - self.ratio, self.warmup, step)))

    def compress(self, x: torch.Tensor, step: int, gen: torch.Generator | None = None) -> list[torch.Tensor]:
        flat = x.reshape(-1)
        return _sparse(flat, flat.abs().topk(self.k(flat.numel(), step), sorted=False).indices)


@dataclass
class DGCSelect(_Sparse):
    """Deep Gradient Compression's selection (Lin et al. 2018), per weight matrix: the threshold is
    the top-k magnitude of a random sample (1 %, at least 1000 elements), so selection costs a
    pass, not a sort; more than 1.3 k survivors are cut to k exactly. The density warms up
    exponentially over `autopar.contract.compression.DGC_STAGES` stages of `warmup` steps. The
    momentum correction, clipping and masking live in its memory (`runtime.compression.DGCMemory`);
    tensors it does not sparsify (`dgc_sparsifies`) the communicator averages dense."""

    sparsity: float
    warmup: float = DGC_WARMUP_STEPS
    sample: float = 0.01
    allreduce = False
    error_feedback = True
    variable = True  # how many survive differs by rank and step
    sparse = True

    def density(self, step: int) -> float:
        return dgc_density(self.sparsity, self.warmup, step)

    def compress(self, x: torch.Tensor, step: int, gen: torch.Generator | None = None) -> list[torch.Tensor]:
        flat = x.reshape(-1)
        k = max(1, math.ceil(flat.numel() * self.density(step)))
        if k >= flat.numel():
            return _sparse(flat, torch.arange(flat.numel(), device=flat.device))
        size = min(flat.numel(), max(1000, math.ceil(flat.numel() * self.sample)))
        sample = flat[torch.randint(flat.numel(), (size,), generator=gen).to(flat.device)].abs()
        threshold = sample.topk(max(1, math.ceil(size * k / flat.numel())), sorted=False).values.min()
        index = (flat.abs() >= threshold).nonzero().reshape(-1)
        if index.numel() > 1.3 * k:
            index = index[flat[index].abs().topk(k, sorted=False).indices]
        return _sparse(flat, index)


@dataclass
class Threshold(_Sparse):
    """Threshold quantisation (Strom 2015): elements with |x| ≥ τ travel as ±τ (int32 index and a
    packed sign bit); error feedback keeps the rest."""

    tau: float
    allreduce = False
    error_feedback = True
    variable = True
    sparse = True

    def compress(self, x: torch.Tensor, step: int, gen: torch.Generator | None = None) -> list[torch.Tensor]:
        flat = x.reshape(-1)
        index = (flat.abs() >= self.tau).nonzero().reshape(-1)
        return [index.to(torch.int32), pack(flat[index] > 0, 1)]

    def values_and_indices(self, parts: list[torch.Tensor], like: torch.Tensor) -> list[torch.Tensor]:
        index, signs = parts
        return [(unpack(signs, 1, index.numel()).to(like.dtype) * 2 - 1) * self.tau, index]


@dataclass
class OneBit:
    """1-bit SGD (Seide et al. 2014): a sign bit per element and, per column, the means of its
    positive and of its negative entries as the two reconstruction values."""

    allreduce = False
    error_feedback = True

    def compress(self, x: torch.Tensor, step: int, gen: torch.Generator | None = None) -> list[torch.Tensor]:
        m = x.reshape(x.shape[0], -1) if x.dim() > 1 else x.reshape(-1, 1)
        pos = m >= 0
        count = pos.sum(0)
        up = torch.where(pos, m, 0).sum(0) / count.clamp_min(1)
        down = torch.where(pos, 0, m).sum(0) / (m.shape[0] - count).clamp_min(1)
        return [pack(pos, 1), torch.cat([up, down])]

    def decompress(self, parts: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
        bits, scales = parts
        up, down = scales.view(2, -1)
        rows = like.shape[0] if like.dim() > 1 else like.numel()
        pos = unpack(bits, 1, like.numel()).view(rows, -1).bool()
        return torch.where(pos, up, down).view_as(like)


@dataclass
class TernGrad:
    """TernGrad (Wen et al. 2017): s·sign(x)·Bernoulli(|x|/s) with s = max|x| of each layer's
    gradient (the paper's per-layer scaling): unbiased for the gradient it is given. As in the
    paper, that gradient is first clipped to `clip` standard deviations (None: not clipped),
    which bounds s and so the variance; the ternary values travel in 2 bits."""

    clip: float | None = 2.5
    allreduce = False
    error_feedback = False

    def compress(self, x: torch.Tensor, step: int, gen: torch.Generator | None = None) -> list[torch.Tensor]:
        flat = x.reshape(-1)
        if self.clip is not None and flat.numel() > 1:
            bound = float(self.clip * flat.std())
            flat = flat.clamp(-bound, bound)
        s = flat.abs().max()
        keep = torch.rand(flat.shape, generator=gen).to(flat.device) < flat.abs() / s.clamp_min(torch.finfo(flat.dtype).tiny)
        codes = torch.where(keep, torch.sign(flat), 0).to(torch.int32) + 1  # {-1, 0, 1} → {0, 1, 2}
        return [pack(codes, 2), s.reshape(1)]

    def decompress(self, parts: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
        codes, s = parts
        return ((unpack(codes, 2, like.numel()) - 1).to(like.dtype) * s).view_as(like)


@dataclass
class QSGD:
    """QSGD (Alistarh et al. 2017) with s levels: ‖x‖·sign(x)·ℓ/s, ℓ rounded up or down at random
    so it is unbiased. Norms are taken over buckets of `bucket` elements, as the paper's
    experiments do (one norm over a whole layer makes the variance grow with its size); sign and
    level travel in one int8 (s ≤ 127), each bucket's norm as fp32."""

    levels: int = 16
    bucket: int = 512
    allreduce = False
    error_feedback = False

    def compress(self, x: torch.Tensor, step: int, gen: torch.Generator | None = None) -> list[torch.Tensor]:
        flat = x.reshape(-1)
        chunks = torch.nn.functional.pad(flat, (0, -flat.numel() % self.bucket)).view(-1, self.bucket)
        norms = chunks.norm(dim=1)
        scaled = chunks.abs() / norms.clamp_min(torch.finfo(flat.dtype).tiny)[:, None] * self.levels
        level = scaled.floor() + (torch.rand(scaled.shape, generator=gen).to(scaled.device) < scaled - scaled.floor())
        return [(torch.sign(chunks) * level).reshape(-1)[: flat.numel()].to(torch.int8), norms]

    def decompress(self, parts: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
        level, norms = parts
        n = like.numel()
        padded = torch.nn.functional.pad(level.to(like.dtype), (0, -n % self.bucket)).view(-1, self.bucket)
        return (padded * norms[:, None] / self.levels).reshape(-1)[:n].view_as(like)


@dataclass
class SignSGD:
    """signSGD with majority vote (Bernstein et al. 2019): each rank sends packed signs, every rank
    takes the sign of their sum; the result is a vote of ±1 (0 on a tie), not an average, so the
    learning rate is the step size."""

    allreduce = False
    error_feedback = False
    vote = True

    def compress(self, x: torch.Tensor, step: int, gen: torch.Generator | None = None) -> list[torch.Tensor]:
        return [pack(x.reshape(-1) >= 0, 1)]

    def decompress(self, parts: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
        return (unpack(parts[0], 1, like.numel()).to(like.dtype) * 2 - 1).view_as(like)
