"""Live tensor bytes during a step, in the planner's categories: what the memory model predicts,
measured on any device (CUDA's allocator statistics have no categories, and a CPU's RSS counts
the interpreter and allocator slack, not tensors).

A dispatch mode sees every tensor an op creates (DTensor's local shards included: it lowers to
plain ops first) and follows each storage until it is freed; the peak's live storages are then
sorted: parameters, gradients and optimizer state by the tensors the model and optimizer hold
after the step, activations by what autograd saved for backward, the rest temporaries
(collective buffers, gathered ZeRO-3 parameters, recomputed activations in backward). torch's
`MemTracker` does the same per module but refuses a module called twice in one step, which every
microbatched plan does.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from autopar.contract import schedules
from autopar.contract.errors import AutoparError
from autopar.contract.plan import Plan
from autopar.contract.units import human_bytes

CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "temporaries")


def _storage(t: torch.Tensor) -> tuple[int, torch.UntypedStorage] | None:
    if isinstance(t, DTensor):
        t = t._local_tensor
    if not isinstance(t, torch.Tensor) or t.device.type == "meta" or isinstance(t, FakeTensor):
        return None  # no memory: DTensor propagates shardings on fake tensors
    try:
        s = t.untyped_storage()
        return (s._cdata, s) if s.nbytes() else None  # the storage itself: FSDP2 resizes one in place
    except (RuntimeError, NotImplementedError):  # no storage of its own (a functional collective's pending result)
        return None


class TensorBytes(TorchDispatchMode):
    """Within the block: the peak of live tensor bytes and the storages live at that peak."""

    # a lowered program holds higher-order ops (a recomputed random op runs under
    # `run_and_save_rng_state`): they run as they are, their outputs counted like any op's
    supports_higher_order_operators = True

    def __init__(self, held: list[torch.Tensor], params: list[torch.Tensor] = ()) -> None:
        super().__init__()
        # gradients as autograd stores them: the data axis's synchroniser later replaces them by
        # views of its buckets, so what holds them after the step does not name them all
        self.grads: set[int | None] = set()
        self._params = [p for p in params if p.requires_grad]
        self._grad_hooks: list = []
        # storage address -> (serial, the storage), read at each op: FSDP2 frees a gathered
        # parameter by resizing its storage to nothing (and gathers into it again), which no op
        # reports. Storages are named by serial, not address: a freed storage's address is reused,
        # and a temporary born there must not inherit its predecessor's category
        self.live: dict[int, tuple[int, weakref.ref]] = {}
        self._serials = 0
        self.peak, self.at_peak = 0, {}
        self.saved: set[int | None] = set()
        for t in held:  # what exists before the step: parameters, optimizer state, buffers
            self._track(t)
        self._note()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _track(self, t: Any) -> int | None:
        """The serial of `t`'s storage, tracked from now on if it was not."""
        found = _storage(t) if isinstance(t, torch.Tensor) else None
        if found is None:
            return None
        address, storage = found
        if address in self.live:
            return self.live[address][0]
        self._serials += 1
        self.live[address] = (self._serials, weakref.ref(storage))
        weakref.finalize(storage, self.live.pop, address, None)
        return self._serials

    def _note(self) -> None:
        sizes = {key: s.nbytes() for key, ref in list(self.live.values()) if (s := ref()) is not None}
        total = sum(sizes.values())
        if total > self.peak:
            self.peak, self.at_peak = total, sizes

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.saved.add(self._track(t))
        return t

    def _stored(self, p: torch.Tensor) -> None:
        self.grads.add(self._track(p.grad))

    def __enter__(self) -> TensorBytes:
        self._hooks.__enter__()
        self._grad_hooks = [p.register_post_accumulate_grad_hook(self._stored) for p in self._params]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._hooks.__exit__(*exc)
        for handle in self._grad_hooks:
            handle.remove()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is DTensor for t in types):
            return NotImplemented  # DTensor lowers to plain ops, which come back through here
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            self._track(t)
        self._note()
        return out

    def by_category(self, params: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """The peak's bytes per category (and `total`), sorted by what holds each storage now."""
        keys = {name: set() for name in CATEGORIES}
        for p in params:
            keys["parameters"].add(self._track(p))
            keys["gradients"].add(self._track(p.grad))
        keys["gradients"] |= self.grads
        for state in optimizer.state.values():
            keys["optimizer"] |= {self._track(t) for t in state.values()}
        keys["activations"] = self.saved
        out = dict.fromkeys(CATEGORIES, 0)
        for key, nbytes in self.at_peak.items():
            name = next((n for n in CATEGORIES[:-1] if key in keys[n]), "temporaries")
            out[name] += nbytes
        return {**out, "total": self.peak}


def measured_step(pm: Any, inputs: Any, target: torch.Tensor, **step: Any) -> tuple[float, dict[str, int]]:
    """One `pm.step` under `TensorBytes`: its loss and this rank's peak tensor bytes by category."""
    params = list(pm.trained.parameters())
    held = params + [t for s in pm.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    held += list(getattr(pm, "state_buffers", {}).values())
    with TensorBytes(held, params) as tracker:
        loss = pm.step(inputs, target, **step)
    return loss, tracker.by_category(params, pm.optimizer)


class MemoryLimitExceeded(AutoparError):
    """A rank's tensors outgrew the memory limit the plan was made for."""


def hold_to(pm: Any, limit: float) -> None:
    """Keep the run within `limit` bytes of tensors per rank, as its plan promised: the first
    step is measured (`TensorBytes`; later steps repeat its shapes, though an fp16 step its loss
    scale skips creates no optimizer state) and, when some rank's peak
    passed the limit, every rank raises `MemoryLimitExceeded` naming that rank's stage and the
    category furthest over the plan's prediction (the measurement: `pm.first_step_tensor_bytes`). On CUDA the allocator is capped at the limit
    as well, for every step (its reserve counts: a little more than the tensors)."""
    import torch.distributed as dist

    if pm.device.type == "cuda":
        total = torch.cuda.get_device_properties(pm.device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total), pm.device)

    def first(inputs: Any, target: torch.Tensor, local: bool = False) -> float:
        del pm.step  # the following steps are plain ones
        loss, measured = measured_step(pm, inputs, target, local=local)
        pm.first_step_tensor_bytes = measured
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (getattr(pm, "stage_index", 0), measured))
        over = [(rank, stage, m) for rank, (stage, m) in enumerate(everyone) if m["total"] > limit]
        if over:
            raise MemoryLimitExceeded(_overflow(*over[0], pm.plan, limit))
        return loss

    pm.step = first


def _overflow(rank: int, index: int, measured: dict[str, int], plan: Plan, limit: float) -> str:
    """What overflowed, against the plan's prediction for the stage, in one message."""
    mine = [s.cost for s, group in zip(plan.stages, plan.stage_ranks) if group == index]  # the group's stages
    states = sum(c.get("state_bytes", 0.0) for c in mine)
    transient = max(c.get("transient_bytes", 0.0) for c in mine)
    per_stage = sum(c.get("activation_bytes_per_microbatch", 0.0) for c in mine) / len(mine)
    acts = per_stage * schedules.in_flight(plan.schedule, plan.groups, index, plan.num_microbatches, plan.virtual)
    got = {"model states": measured["parameters"] + measured["gradients"] + measured["optimizer"],
           "activations": measured["activations"], "temporaries": measured["temporaries"]}
    predicted = {"model states": states, "activations": acts, "temporaries": transient}
    worst = max(got, key=lambda k: got[k] - predicted[k])
    return (f"rank {rank} (stage {index}) held {human_bytes(measured['total'])} of tensors, over the memory limit "
            f"of {human_bytes(limit)} the plan was made for: {worst} {human_bytes(got[worst])}, predicted "
            f"{human_bytes(predicted[worst])}. Plan with a lower --memory-limit to leave room, or raise it")
