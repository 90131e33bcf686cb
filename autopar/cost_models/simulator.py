"""Replay a pipeline schedule event by event: step time, bubble, per-stage peak memory.

Each stage runs its actions in schedule order ("2F0": stage 2, forward, microbatch 0, as in
torch.distributed.pipelining): a forward waits for the previous stage's forward of the same
microbatch plus the point-to-point transfer; a backward waits for the next stage's backward.
Transfers overlap compute (sends are asynchronous). The data-parallel gradient reduction of a
stage ends the step for that stage: the part of it that its link's `overlap` does not hide behind
the last backward runs after it (the callers price that part). On a host with more ranks than
cores (`Hosts`), stages computing at once share the cores. The bubble fraction is the idle share of all stages' time until the last
backward ends: pipeline fill and drain, and also waiting caused by unequal stages.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autopar.contract import schedules


@dataclass(frozen=True)
class StageTimes:
    forward_s: float  # one microbatch
    backward_s: float  # one microbatch, including a recomputed forward
    send_s: float  # activations of one microbatch to the next stage (and their gradient back)
    grad_sync_s: float  # once per step, after the stage's last backward: the part its overlap does not hide
    state_bytes: float = 0.0  # parameters, gradients, optimizer state
    activation_bytes: float = 0.0  # kept per microbatch between its forward and its backward
    transient_bytes: float = 0.0  # extra while one backward runs (recomputed activations, loss gradients, gathered weights)
    grad_bytes: float = 0.0  # the part of state_bytes the step's first backward allocates (gradients)
    sync_bytes: float = 0.0  # held at the end of backward: flat copies of the gradients being averaged
    optimizer_s: float = 0.0  # once per step, after the gradient synchronisation


@dataclass(frozen=True)
class Event:
    stage: int
    kind: str  # "F", "B", "send", "sync"
    microbatch: int
    start: float
    end: float




@dataclass(frozen=True)
class Hosts:
    """Where the stages' ranks run, when more ranks than cores share a host: stage s holds the
    devices after those of the stages before it, laid host by host."""

    devices: tuple[int, ...]  # per stage
    devices_per_host: int
    cores_per_host: int

    def rates(self, running: list[int]) -> dict[int, float]:
        """The speed of each running stage: its ranks share their hosts' cores with every rank
        computing there (processor sharing: `cores / busy ranks`, at most 1)."""
        busy: dict[int, int] = {}
        spans = {}
        for s in running:
            first = sum(self.devices[:s])
            hosts = range(first // self.devices_per_host, (first + self.devices[s] - 1) // self.devices_per_host + 1)
            spans[s] = hosts
            for h in hosts:
                lo, hi = max(first, h * self.devices_per_host), min(first + self.devices[s], (h + 1) * self.devices_per_host)
                busy[h] = busy.get(h, 0) + hi - lo
        return {s: min(1.0, min(self.cores_per_host / busy[h] for h in spans[s])) for s in running}


@dataclass
class Simulation:
    step_time_s: float
    bubble_fraction: float
    peak_memory_bytes: list[float]
    events: list[Event] = field(default_factory=list)
    hosts: Hosts | None = None


def simulate(stages: list[StageTimes], num_microbatches: int, schedule: str = "1f1b", hosts: Hosts | None = None
             ) -> Simulation:
    """Replays the schedule; with `hosts`, stages computing at the same time on an oversubscribed
    host slow each other down (their work is fixed, their speed `Hosts.rates`)."""
    n = len(stages)
    orders = [schedules.order(schedule, n, s, num_microbatches) for s in range(n)]
    # every stage ends with its exposed gradient synchronisation (what `overlap` of it does not hide
    # behind its last backward: grad_sync_s holds that share) and its optimizer step, on its cores too
    orders = [o + [("S", -1)] for o in orders]
    done: dict[tuple[str, int, int], float] = {}  # (kind, stage, microbatch) -> end time
    pos = [0] * n
    events: list[Event] = []
    in_flight = [0] * n
    backward_done = [False] * n  # gradients exist from the end of a stage's first backward on
    peak = [st.state_bytes - st.grad_bytes for st in stages]
    running: dict[int, list] = {}  # stage -> [kind, microbatch, start, work left]
    now = 0.0
    while True:
        waiting = []
        for s in range(n):
            if s in running or pos[s] == len(orders[s]):
                continue
            kind, mb = orders[s][pos[s]]
            ready = _ready(kind, s, mb, n, stages, done)
            if ready is None:
                continue
            if ready > now:
                waiting.append(ready)
                continue
            st = stages[s]
            work = {"F": st.forward_s, "B": st.backward_s, "S": st.grad_sync_s + st.optimizer_s}[kind]
            running[s] = [kind, mb, now, work]
            held = st.state_bytes - (0.0 if backward_done[s] else st.grad_bytes)
            if kind == "F":
                in_flight[s] += 1
                peak[s] = max(peak[s], held + in_flight[s] * st.activation_bytes)
            elif kind == "B":
                peak[s] = max(peak[s], held + in_flight[s] * st.activation_bytes + st.transient_bytes)
                in_flight[s] -= 1
                backward_done[s] = True
        if not running:
            if not waiting:
                break
            now = min(waiting)
            continue
        rates = hosts.rates(sorted(running)) if hosts is not None else dict.fromkeys(running, 1.0)
        step = min([left / rates[s] for s, (_, _, _, left) in running.items()] + [w - now for w in waiting])
        now += step
        for s in list(running):
            kind, mb, start, left = running[s]
            left -= step * rates[s]
            if left > 1e-12 * max(1.0, now):
                running[s][3] = left
                continue
            del running[s]
            done[(kind, s, mb)] = now
            pos[s] += 1
            if kind != "S" or now > start:
                events.append(Event(s, {"S": "sync"}.get(kind, kind), mb, start, now))
            if kind == "F" and s + 1 < n:
                events.append(Event(s, "send", mb, now, now + stages[s].send_s))
    if any(p < len(o) for p, o in zip(pos, orders)):
        raise RuntimeError("schedule deadlocked")  # a bug in a schedule's order, never the user's input
    peak = [max(p, st.state_bytes + st.sync_bytes) for p, st in zip(peak, stages)]
    pipeline_end = max(e.end for e in events if e.kind in ("F", "B"))
    busy = sum(e.end - e.start for e in events if e.kind in ("F", "B"))
    bubble = 1.0 - busy / (n * pipeline_end) if pipeline_end > 0 else 0.0
    return Simulation(max(done.values()), max(0.0, bubble), peak, events, hosts)


def _ready(kind: str, s: int, mb: int, n: int, stages: list[StageTimes], done: dict) -> float | None:
    """When the inputs of an action have arrived, or None if they have not been produced yet."""
    if kind == "S":
        return max(t for (k, st, _), t in done.items() if k == "B" and st == s)
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
