"""Where a step's time goes on this rank, measured: `autopar bench --breakdown`.

The runners mark their phases (`phase("forward")`, `"backward"`, `"dp_sync"`, `"optimizer"`, a
pipeline's `"schedule"`); while `measuring()` is active those marks add up wall time, and a
dispatch mode times every op that reaches the dispatcher: compute ops (by the phase they run in),
the tensor axis's functional collectives and their waits,
and the process-group collectives (data-axis buckets, FSDP2's gathers, pipeline sends) that are
launched from inside them. What a phase's wall time holds beyond its ops is the runtime's own
overhead: Python, module calls, the sharded-graph interpreter, DTensor's sharding propagation,
autograd's engine, and waits that are not ops (a pipeline's receives, `Work.wait`).
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.runtime.comm_count import nbytes_of

_FUNCTIONAL = {"_c10d_functional", "c10d_functional", "_c10d_functional_autograd"}
_ACTIVE: _Breakdown | None = None


class _Breakdown(TorchDispatchMode):
    """Seconds and counts per category, for one or more steps."""

    supports_higher_order_operators = True

    def __init__(self) -> None:
        super().__init__()
        self.seconds: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)
        self.phases: list[str] = []  # the phases the running op is inside, innermost last

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **(kwargs or {}))
        if any(t is DTensor for t in types):
            return NotImplemented  # DTensor lowers to plain ops first; they come back through here
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        key = _category(func, self.phases[-1] if self.phases else "other")
        self._add(key, time.perf_counter() - start)
        if key == "tp_comm" and func._overloadpacket.__name__ != "wait_tensor":  # one per collective issued
            self.counts["tp_collectives"] += 1
            self.seconds["tp_bytes"] += nbytes_of(args[0] if args else None)
        return out

    def _add(self, key: str, seconds: float) -> None:
        self.seconds[key] += seconds
        self.counts[key] += 1


def _category(func: Any, phase: str) -> str:
    namespace = getattr(func, "namespace", "")
    name = getattr(getattr(func, "_overloadpacket", None), "__name__", str(func))
    if namespace in _FUNCTIONAL:  # DTensor's redistributions: the tensor axis (their waits included)
        return "tp_comm"
    if namespace == "c10d":  # process-group collectives: launches, and blocking sends / receives
        return "pp_comm" if name in ("send", "recv_", "recv_any_source_") else "dp_comm"
    return f"{phase}_ops"  # forward_ops, backward_ops, optimizer_ops, ...


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Adds the block's wall time to `name` while a breakdown is measured (otherwise nothing)."""
    if _ACTIVE is None:
        yield
        return
    mode, start = _ACTIVE, time.perf_counter()
    mode.phases.append(name)
    try:
        yield
    finally:
        mode.phases.pop()
        mode._add(name, time.perf_counter() - start)


@contextlib.contextmanager
def measuring() -> Iterator[_Breakdown]:
    """Times the ops and phases of what runs inside (one rank, this thread)."""
    global _ACTIVE
    mode = _Breakdown()
    _ACTIVE = mode
    try:
        with mode:
            yield mode
    finally:
        _ACTIVE = None


def summarise(mode: _Breakdown, step_s: float, steps: int = 1) -> dict[str, float]:
    """Per step: the phases' wall times, the ops' times inside them, and what is left (overhead)."""
    s = {k: v / steps for k, v in mode.seconds.items()}
    n = {k: v / steps for k, v in mode.counts.items()}
    busy = s.get("forward", 0.0) + s.get("backward", 0.0)
    out = {
        "step_s": step_s,
        "forward_s": s.get("forward", 0.0),
        "backward_s": s.get("backward", 0.0),
        "forward_ops_s": s.get("forward_ops", 0.0),
        "backward_ops_s": s.get("backward_ops", 0.0),
        "tp_comm_s": s.get("tp_comm", 0.0),
        "dp_launch_s": s.get("dp_comm", 0.0),  # launched from backward's hooks (buckets, FSDP2)
        "dp_sync_s": s.get("dp_sync", 0.0),  # waiting for the buckets after backward
        "pipeline_s": max(0.0, s.get("schedule", 0.0) - busy),  # sends, receives and waiting for them
        "optimizer_s": s.get("optimizer", 0.0),
        "optimizer_ops_s": s.get("optimizer_ops", 0.0),
        "ops": n.get("forward_ops", 0.0) + n.get("backward_ops", 0.0),  # in forward and backward
        "optimizer_ops": n.get("optimizer_ops", 0.0),
        "collectives": n.get("tp_collectives", 0.0) + n.get("dp_comm", 0.0) + n.get("pp_comm", 0.0),
        "tp_collectives": n.get("tp_collectives", 0.0),
        "tp_bytes": s.get("tp_bytes", 0.0),  # what this rank handed to them
    }
    inside = out["forward_ops_s"] + out["backward_ops_s"] + out["tp_comm_s"] + out["dp_launch_s"]
    out["overhead_s"] = max(0.0, busy - inside)  # the runtime's own cost around each op
    out["other_s"] = max(0.0, step_s - busy - out["pipeline_s"] - out["dp_sync_s"] - out["optimizer_s"])
    return out
