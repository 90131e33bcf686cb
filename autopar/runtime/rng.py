"""Random ops (dropout) under a tensor axis: one mask where a value is replicated, independent
masks where it is split (Megatron-LM's model-parallel RNG tracker, in spirit).

A value the plan replicates over the tensor axis is computed on every rank of the group; if their
random generators differ, so do its dropout masks, and the replicas of the model silently drift
apart. So the ranks of a tensor-parallel group start from one generator state (`share`) and
consume it alike. A random op on a split value (`independent`) draws a seed from that shared stream
(every rank alike) and runs under a generator seeded by it and the rank's position, then the shared
stream continues: each shard gets its own mask, and recomputation (which restores the shared stream)
draws the same masks again. DTensor's own offset-based tracker stays off: on CUDA it would begin by
broadcasting a seed over the whole job at its first random op, a collective that the ranks of
other pipeline stages never join.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

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


@contextlib.contextmanager
def independent(position: int, device: torch.device) -> Iterator[None]:
    """The body draws from a generator of its own, seeded from the shared stream and `position`."""
    seed = int(torch.randint(0, 2**62, (), device="cpu"))  # the shared stream advances alike on every rank
    devices = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed + position)
        yield
