"""How the data axis groups gradients into buckets (DDP's sizes): the synchroniser groups by it,
the cost models and the planner count by it."""

from __future__ import annotations

import numpy as np

BUCKET_BYTES = 25 * 2**20  # DDP's default gradient bucket
FIRST_BUCKET_BYTES = 2**20  # DDP's first bucket: small, so that communication starts early in backward


def bucketed(sizes: list[float], cap: float = BUCKET_BYTES) -> list[list[int]]:
    """Gradients (bytes each, in the order backward produces them) grouped into buckets as DDP
    groups them: a bucket closes once it holds its cap, the first one's 1 MiB."""
    out: list[list[int]] = []
    current: list[int] = []
    size = 0.0
    for i, n in enumerate(sizes):
        current.append(i)
        size += n
        if size >= (min(FIRST_BUCKET_BYTES, cap) if not out else cap):
            out.append(current)
            current, size = [], 0.0
    return out + [current] if current else out


def bucket_count(nbytes):
    """How many buckets `nbytes` of gradients fill (`bucketed`, tensors small beside a bucket);
    numpy arrays too (the planner prices every layer range at once)."""
    n = np.asarray(nbytes, dtype=float)
    count = np.where(n > 0, 1 + np.ceil(np.maximum(n - FIRST_BUCKET_BYTES, 0) / BUCKET_BYTES), 0)
    return count if count.ndim else int(count)


def flat_held(averaged, largest: float):
    """What the synchroniser holds beside the gradients while it averages `averaged` bytes of them:
    one bucket's flat buffer, allocated while that bucket's fresh gradients still exist (each
    bucket's are freed as it launches: `runtime.grad_sync`), so at most a bucket's cap and one
    tensor (`largest` bytes) more, never more than all of them. numpy arrays too."""
    return np.minimum(averaged, BUCKET_BYTES + largest)
