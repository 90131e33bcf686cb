"""Replay a pipeline schedule event by event: step time, bubble, per-stage peak memory.

Each stage runs its actions in schedule order ("2F0": stage 2, forward, microbatch 0, as in
torch.distributed.pipelining): a forward waits for the previous stage's forward of the same
microbatch plus the point-to-point transfer; a backward waits for the next stage's backward.
Transfers overlap compute (sends are asynchronous). The data-parallel gradient reduction of a
stage starts with its last backward (bucketed reduction overlaps the backward pass) and ends the
step for that stage. The bubble fraction is the idle share of all stages' time until the last
backward ends: pipeline fill and drain, and also waiting caused by unequal stages.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class StageTimes:
    forward_s: float  # one microbatch
    backward_s: float  # one microbatch, including a recomputed forward
    send_s: float  # activations of one microbatch to the next stage (and their gradient back)
    grad_sync_s: float  # once per step, after the stage's last backward starts
    state_bytes: float = 0.0  # parameters, gradients, optimizer state
    activation_bytes: float = 0.0  # kept per microbatch between its forward and its backward
    transient_bytes: float = 0.0  # extra while one backward runs (recomputed activations, loss gradients, gathered weights)
    grad_bytes: float = 0.0  # the part of state_bytes the step's first backward allocates (gradients)
    sync_bytes: float = 0.0  # held at the end of backward: flat copies of the gradients being averaged


@dataclass(frozen=True)
class Event:
    stage: int
    kind: str  # "F", "B", "send", "sync"
    microbatch: int
    start: float
    end: float


@dataclass
class Simulation:
    step_time_s: float
    bubble_fraction: float
    peak_memory_bytes: list[float]
    events: list[Event] = field(default_factory=list)


def schedule_order(schedule: str, num_stages: int, stage: int, num_microbatches: int) -> list[tuple[str, int]]:
    """The actions of one stage: GPipe all forwards then all backwards; 1F1B warms up with
    `stages - stage - 1` forwards, then alternates one forward and one backward. 1F1B with fewer
    microbatches than stages runs GPipe's order (torch's `Schedule1F1B` refuses it; the runtime
    falls back), so every stage holds all of them."""
    m = num_microbatches
    if schedule == "gpipe" or schedule == "1f1b" and m < num_stages:
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    if schedule != "1f1b":
        raise ValueError(f"unknown schedule {schedule!r}: '1f1b' or 'gpipe'")
    warmup = min(num_stages - stage - 1, m)
    order = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [("F", warmup + i), ("B", i)]
    return order + [("B", i) for i in range(m - warmup, m)]


def simulate(stages: list[StageTimes], num_microbatches: int, schedule: str = "1f1b") -> Simulation:
    n = len(stages)
    orders = [schedule_order(schedule, n, s, num_microbatches) for s in range(n)]
    done: dict[tuple[str, int, int], float] = {}  # (kind, stage, microbatch) -> end time
    free = [0.0] * n
    pos = [0] * n
    events: list[Event] = []
    in_flight = [0] * n
    backward_done = [False] * n  # gradients exist from the end of a stage's first backward on
    peak = [st.state_bytes - st.grad_bytes for st in stages]
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(n):
            if pos[s] == len(orders[s]):
                continue
            kind, mb = orders[s][pos[s]]
            ready = _ready(kind, s, mb, n, stages, done)
            if ready is None:
                continue
            start = max(free[s], ready)
            dur = stages[s].forward_s if kind == "F" else stages[s].backward_s
            free[s] = done[(kind, s, mb)] = start + dur
            events.append(Event(s, kind, mb, start, start + dur))
            st = stages[s]
            held = st.state_bytes - (0.0 if backward_done[s] else st.grad_bytes)
            if kind == "F":
                in_flight[s] += 1
                peak[s] = max(peak[s], held + in_flight[s] * st.activation_bytes)
                if s + 1 < n:
                    events.append(Event(s, "send", mb, start + dur, start + dur + st.send_s))
            else:
                peak[s] = max(peak[s], held + in_flight[s] * st.activation_bytes + st.transient_bytes)
                in_flight[s] -= 1
                backward_done[s] = True
            pos[s] += 1
            remaining -= 1
            progressed = True
        if not progressed:
            raise RuntimeError("schedule deadlocked")  # a bug in schedule_order, never the user's input
    peak = [max(p, st.state_bytes + st.sync_bytes) for p, st in zip(peak, stages)]
    ends = []
    for s, st in enumerate(stages):
        last = max((e for e in events if e.stage == s and e.kind == "B"), key=lambda e: e.end)
        end = max(last.end, last.start + st.grad_sync_s)
        if st.grad_sync_s:
            events.append(Event(s, "sync", -1, last.start, end))
        ends.append(end)
    pipeline_end = max(e.end for e in events if e.kind in ("F", "B"))
    busy = sum(num_microbatches * (st.forward_s + st.backward_s) for st in stages)
    bubble = 1.0 - busy / (n * pipeline_end) if pipeline_end > 0 else 0.0
    return Simulation(max(ends), max(0.0, bubble), peak, events)


def _ready(kind: str, s: int, mb: int, n: int, stages: list[StageTimes], done: dict) -> float | None:
    """When the inputs of an action have arrived, or None if they have not been produced yet."""
    if kind == "F":
        if s == 0:
            return 0.0
        prev = done.get(("F", s - 1, mb))
        return None if prev is None else prev + stages[s - 1].send_s
    own = done.get(("F", s, mb))
    if own is None:
        return None
    if s == n - 1:
        return own
    nxt = done.get(("B", s + 1, mb))
    return None if nxt is None else max(own, nxt + stages[s].send_s)
