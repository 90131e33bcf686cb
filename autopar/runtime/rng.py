"""Random ops (dropout) under a tensor axis: one mask where a value is replicated, independent
masks where it is split (Megatron-LM's model-parallel RNG tracker, in spirit).

A value the plan replicates over the tensor axis is computed on every rank of the group; if their
random generators differ, so do its dropout masks, and the replicas of the model silently drift
apart. So the ranks of a tensor-parallel group start from one generator state (`share`) and
consume it alike. A random op on a split value draws a seed from that shared stream (every rank
alike) and runs under a generator seeded by it and the rank's position, then the shared stream
continues: each shard gets its own mask, and recomputation (which restores the shared stream, or
keeps the seed) draws the same masks again. Dropout and attention's dropout do so as ops a program
can hold (`on_shards`: the seed is drawn by an op of the graph at every run, the mask by
`seeded_dropout`, opaque to tracing and to inductor); other random ops only op by op
(`independent`). DTensor's own offset-based tracker stays off: on CUDA it would begin by
broadcasting a seed over the whole job at its first random op, a collective that the ranks of
other pipeline stages never join.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh


def share(mesh: DeviceMesh, device: torch.device) -> None:
    """Every rank of the 1-D `mesh` (a tensor axis) takes the random state of its first rank (CPU,
    and the device's); DTensor's tracker is switched off."""
    from torch.distributed.tensor import _random

    if device.type != "cpu" and _random._rng_tracker is None:  # (on a CPU DTensor has none)
        _random._rng_tracker = _random.OffsetBasedRNGTracker(mesh, run_state_sync=False)
    if _random._rng_tracker is not None:
        _random._rng_tracker.distribute_region_enabled = False
    group = mesh.get_group()
    if dist.get_world_size(group) == 1:
        return
    states = [torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None]
    dist.broadcast_object_list(states, group_src=0, group=group, device=device if device.type == "cuda" else None)
    torch.set_rng_state(states[0])
    if states[1] is not None:
        torch.cuda.set_rng_state(states[1], device)


def is_random(target: object, args: tuple = (), kwargs: dict | None = None) -> bool:
    """Whether a call of `target` draws random numbers: a seeded op, unless the call turns its draw
    off (dropout or attention with probability 0, dropout with `train=False`)."""
    if not (isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags):
        return False
    kwargs = kwargs or {}
    for i, arg in enumerate(target._schema.arguments):
        value = args[i] if i < len(args) else kwargs.get(arg.name, arg.default_value)
        if arg.name in ("p", "dropout_p") and isinstance(value, (int, float)) and value == 0 \
                and "bernoulli" not in target.name() or arg.name == "train" and value is False:
            return False
    return True


def _devices(device: torch.device) -> list[int]:
    return [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []


@contextlib.contextmanager
def independent(position: int, device: torch.device) -> Iterator[None]:
    """The body draws from a generator of its own, seeded from the shared stream and `position`."""
    seed = int(draw_seed())  # the shared stream advances alike on every rank
    with torch.random.fork_rng(devices=_devices(device)):
        torch.manual_seed(seed + position)
        yield


def draw_seed() -> torch.Tensor:
    """One draw from the shared stream, alike on every rank of the tensor axis; traced, an op of the
    program that draws again at every run."""
    return torch.randint(0, 2**62, (), device="cpu")


@torch.library.custom_op("autopar::seeded_dropout", mutates_args=())
def seeded_dropout(x: torch.Tensor, p: float, seed: torch.Tensor, position: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dropout of `x` (its output and mask) under a generator seeded by `seed` + `position`: this
    shard's own mask, the same again for the same seed (recomputation)."""
    with torch.random.fork_rng(devices=_devices(x.device)):
        torch.manual_seed(int(seed) + position)
        return torch.ops.aten.native_dropout.default(x, p, True)


@seeded_dropout.register_fake
def _(x: torch.Tensor, p: float, seed: torch.Tensor, position: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(x, dtype=torch.bool)


def _setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    ctx.save_for_backward(output[1])
    ctx.scale = 0.0 if inputs[1] == 1 else 1 / (1 - inputs[1])  # as torch's own dropout's backward


def _backward(ctx: Any, grad: torch.Tensor, _: Any) -> tuple:
    (mask,) = ctx.saved_tensors
    return torch.ops.aten.native_dropout_backward.default(grad, mask, ctx.scale), None, None, None


seeded_dropout.register_autograd(_backward, setup_context=_setup)


def _dropout(position: int, input: torch.Tensor, p: float, train: bool | None = True) -> torch.Tensor:
    return seeded_dropout(input, p, draw_seed(), position)[0]


def _attention(position: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False, *,
               scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
    """`scaled_dot_product_attention` as torch's math kernel computes it, its dropout seeded per shard."""
    factor = math.sqrt(scale if scale is not None else 1 / math.sqrt(query.size(-1)))
    if enable_gqa:
        repeat = query.size(-3) // key.size(-3)
        key, value = key.repeat_interleave(repeat, -3), value.repeat_interleave(repeat, -3)
    scores = (query * factor) @ (key * factor).transpose(-2, -1)
    if is_causal:
        attn_mask = torch.ones(query.size(-2), key.size(-2), dtype=torch.bool, device=query.device).tril()
    if attn_mask is not None:
        scores = scores.masked_fill(attn_mask.logical_not(), float("-inf")) if attn_mask.dtype == torch.bool \
            else scores + attn_mask
    weights = torch.ops.aten._safe_softmax.default(scores, -1)
    return seeded_dropout(weights, dropout_p, draw_seed(), position)[0] @ value


_SEEDED: dict[Any, Callable] = {torch.ops.aten.dropout.default: _dropout,
                                torch.ops.aten.scaled_dot_product_attention.default: _attention}


def on_shards(target: object, position: int) -> Callable | None:
    """`target` (a random op) on one rank's shards, drawing its own mask from a seed drawn alike on
    every rank: a function of local tensors a program can hold; None for an op without one."""
    fn = _SEEDED.get(target)
    return None if fn is None else functools.partial(fn, position)
