"""Replay a pipeline schedule action by action: step time, bubble, per-stage peak memory.

Each device group (a pipeline rank) runs its actions in the schedule's order, one at a time
("2F0": stage 2, forward, microbatch 0, as in torch.distributed.pipelining); a group holds one
stage, or v of them with interleaved and V-shaped schedules. A forward waits for the previous
stage's forward of the same microbatch plus the point-to-point transfer; a backward (or, split,
its input-gradient part "I") waits for the next stage's; a weight-gradient part "W" waits for
its own "I". Transfers overlap compute (sends are asynchronous) and cost nothing between stages of
one group. The data-parallel gradient reduction of a group ends the step for it: the part of it
that its link's `overlap` does not hide behind the last backward runs after it (the callers price
that part). On a host with more ranks than cores (`Hosts`), groups computing at once share the
cores. The bubble fraction is the idle share of all groups' time until the last backward ends:
pipeline fill and drain, and also waiting caused by unequal stages.
"""

from __future__ import annotations

import functools
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
    weight_s: float = 0.0  # the part of backward_s that computes weight gradients (a split backward's "W")


@dataclass(slots=True)
class Event:
    stage: int
    kind: str  # "F", "B", "I", "W", "send", "sync"
    microbatch: int
    start: float
    end: float
    rank: int = 0  # the device group that ran it


@dataclass(frozen=True)
class Hosts:
    """Where the groups' ranks run, when more ranks than cores share a host: group r holds the
    devices after those of the groups before it, laid host by host."""

    devices: tuple[int, ...]  # per device group
    devices_per_host: int
    cores_per_host: int

    def rates(self, running: list[int]) -> dict[int, float]:
        """The speed of each running group: its ranks share their hosts' cores with every rank
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
    peak_memory_bytes: list[float]  # per stage: the peak of the group holding it
    events: list[Event] = field(default_factory=list)
    hosts: Hosts | None = None


def simulate(stages: list[StageTimes], num_microbatches: int, schedule: str = "1f1b", hosts: Hosts | None = None,
             virtual: int = 1) -> Simulation:
    """Replays the schedule over `len(stages) / virtual` device groups; with `hosts`, groups
    computing at the same time on an oversubscribed host slow each other down (their work is
    fixed, their speed `Hosts.rates`)."""
    n, m = len(stages), num_microbatches
    p = n // virtual
    wrong = "stages do not split into groups" if n % virtual else schedules.problem(schedule, p, m, virtual)
    if wrong:
        raise ValueError(f"cannot simulate {schedule} over {n} stages, {virtual} per group: {wrong}")
    where = schedules.stage_ranks(schedule, p, virtual)
    # every group ends with its exposed gradient synchronisation (what `overlap` of it does not hide
    # behind its last backward: grad_sync_s holds that share) and its optimizer step, on its cores too
    mine = [[s for s in range(n) if where[s] == r] for r in range(p)]
    durations = [{"F": st.forward_s, "B": st.backward_s, "I": st.backward_s - st.weight_s, "W": st.weight_s}
                 for st in stages]
    finish = [sum(stages[k].grad_sync_s + stages[k].optimizer_s for k in group) for group in mine]
    memory = _Memory(stages, mine)
    if hosts is None:  # every action at full speed: its start is a recurrence over a fixed order
        events, step = _replay(stages, where, mine, durations, finish, memory, _topology(schedule, p, m, virtual))
    else:
        events, step = _shared(stages, m, schedule, virtual, where, mine, durations, finish, memory, hosts)
    compute = [e for e in events if e.kind in ("F", "B", "I", "W")]
    pipeline_end = max(e.end for e in compute)
    busy = sum(e.end - e.start for e in compute)
    bubble = 1.0 - busy / (p * pipeline_end) if pipeline_end > 0 else 0.0
    peak = memory.peaks()
    return Simulation(step, max(0.0, bubble), [peak[where[s]] for s in range(n)], events, hosts)


class _Memory:
    """What each group holds as it starts its actions (it depends only on each group's order):
    activations from a forward to its backward (or "W"), gradients from a stage's first backward on,
    a backward's transient; at the end of the step the synchroniser's buffer."""

    def __init__(self, stages: list[StageTimes], mine: list[list[int]]) -> None:
        self.stages, self.mine = stages, mine
        self.held = [sum(stages[s].state_bytes - stages[s].grad_bytes for s in group) for group in mine]
        self.peak = list(self.held)
        self.backward_done = [False] * len(stages)

    def start(self, r: int, kind: str, s: int) -> None:
        st, held, peak = self.stages[s] if s >= 0 else None, self.held, self.peak
        if kind == "F":
            held[r] += st.activation_bytes
            peak[r] = max(peak[r], held[r])
        elif kind == "B" or kind == "I":
            peak[r] = max(peak[r], held[r] + st.transient_bytes)
            if not self.backward_done[s]:  # its gradients, from here on
                held[r] += st.grad_bytes
                self.backward_done[s] = True
            if kind == "B":
                held[r] -= st.activation_bytes
        elif kind == "W":
            held[r] -= st.activation_bytes

    def peaks(self) -> list[float]:
        return [max(self.peak[r], sum(self.stages[s].state_bytes + self.stages[s].sync_bytes for s in group))
                for r, group in enumerate(self.mine)]


def _shared(stages: list[StageTimes], m: int, schedule: str, virtual: int, where: list[int], mine: list[list[int]],
            durations: list[dict], finish: list[float], memory: _Memory, hosts: Hosts) -> tuple[list[Event], float]:
    """The replay where groups computing at once share cores: event by event, each running action's
    work left shrinking at its rate (`Hosts.rates`). (events, step)."""
    n, p = len(stages), len(mine)
    orders = [schedules.order(schedule, p, r, m, virtual) + [("S", -1, -1)] for r in range(p)]
    done: dict[tuple[str, int, int], float] = {}  # ("F" | "G" (input gradient) | "W", stage, microbatch) -> end
    pos = [0] * p
    events: list[Event] = []
    running: dict[int, list] = {}  # group -> [kind, stage, microbatch, start, work left]
    now = 0.0

    def begin(r: int, now: float) -> None:
        """Start the group's next action (its inputs are in)."""
        kind, s, mb = orders[r][pos[r]]
        running[r] = [kind, s, mb, now, finish[r] if kind == "S" else durations[s][kind]]
        memory.start(r, kind, s)

    def end(r: int, now: float) -> None:
        kind, s, mb, start, _ = running.pop(r)
        done[("G" if kind in "BI" else kind, s, mb)] = now
        pos[r] += 1
        if kind == "S":
            if now > start:
                events.append(Event(mine[r][0], "sync", -1, start, now, r))
            return
        events.append(Event(s, kind, mb, start, now, r))
        if kind == "F" and s + 1 < n and where[s + 1] != r:
            events.append(Event(s, "send", mb, now, now + stages[s].send_s, r))

    def ready(r: int) -> float | None:
        kind, s, mb = orders[r][pos[r]]
        return _ready(kind, s, mb, stages, where, done)

    while True:
        waiting = []
        for r in range(p):
            if r in running or pos[r] == len(orders[r]):
                continue
            at = ready(r)
            if at is None:
                continue
            if at > now:
                waiting.append(at)
                continue
            begin(r, now)
        if not running:
            if not waiting:
                break
            now = min(waiting)
            continue
        rates = hosts.rates(sorted(running))
        step = min([left / rates[r] for r, (*_, left) in running.items()] + [w - now for w in waiting])
        now += step
        for r in list(running):
            running[r][4] -= step * rates[r]
            if running[r][4] <= 1e-12 * max(1.0, now):
                end(r, now)
    if any(k < len(o) for k, o in zip(pos, orders)):
        raise RuntimeError("schedule deadlocked")  # a bug in a schedule's order, never the user's input
    return events, max([now] + [e.end for e in events])


def step_floor(stages: list[StageTimes], m: int) -> float:
    """A step no replay of `stages`, one per group (1F1B, GPipe), can beat, in O(stages²) where a
    whole simulation of a deep pipeline takes seconds: stage i starts once microbatch 0 has come
    through the stages before it, runs its m forwards and backwards one after another (slower, not
    faster, where ranks share cores), and its last input gradient then goes back through the stages
    before it; every group ends with its tail (exposed gradient synchronisation, optimizer)."""
    floor, start = 0.0, 0.0
    for i, st in enumerate(stages):
        end = start + m * (st.forward_s + st.backward_s)
        chain = 0.0  # from stage i's last backward to stage j's
        for j in range(i, -1, -1):
            if j < i:
                chain += stages[j].send_s + stages[j].backward_s
            floor = max(floor, end + chain + stages[j].grad_sync_s + stages[j].optimizer_s)
        start += st.forward_s + st.send_s
    return floor


@functools.lru_cache(maxsize=32)
def _topology(schedule: str, p: int, m: int, virtual: int) -> tuple[tuple, ...]:
    """Every group's actions in one order that runs each after what it waits for (its group's
    previous action, its inputs: `_ready`'s rules), as (group, kind, stage, microbatch, inputs)
    with inputs (index, stage whose send it waits for or -1). The same whatever the durations, so
    a replay without shared cores is one pass over it (planning replays thousands of pipelines)."""
    where = schedules.stage_ranks(schedule, p, virtual)
    n = p * virtual
    orders = [schedules.order(schedule, p, r, m, virtual) + [("S", -1, -1)] for r in range(p)]
    made: dict[tuple[str, int, int], tuple[int, int]] = {}  # ("F" | "G", stage, mb) -> (group, position)
    for r, actions in enumerate(orders):
        for k, (kind, s, mb) in enumerate(actions):
            if kind in ("F", "B", "I"):
                made[("F" if kind == "F" else "G", s, mb)] = (r, k)

    def inputs(kind: str, s: int, mb: int) -> list[tuple[tuple[int, int], int]]:
        if kind == "W":
            return [(made[("G", s, mb)], -1)]
        if kind == "F":
            return [] if s == 0 else [(made[("F", s - 1, mb)], s - 1 if where[s - 1] != where[s] else -1)]
        if kind in ("B", "I"):
            return [(made[("F", s, mb)], -1)] + ([] if s == n - 1 else
                                                  [(made[("G", s + 1, mb)], s if where[s + 1] != where[s] else -1)])
        return []

    index: dict[tuple[int, int], int] = {}
    out: list[tuple] = []
    pos = [0] * p
    progress = True
    while progress:  # round-robin: each group runs on as far as its inputs are placed
        progress = False
        for r in range(p):
            while pos[r] < len(orders[r]):
                kind, s, mb = orders[r][pos[r]]
                needs = inputs(kind, s, mb)
                if any(at not in index for at, _ in needs):
                    break
                index[(r, pos[r])] = len(out)
                out.append((r, kind, s, mb, tuple((index[at], sender) for at, sender in needs)))
                pos[r] += 1
                progress = True
    if len(out) < sum(len(o) for o in orders):
        raise RuntimeError("schedule deadlocked")  # a bug in a schedule's order, never the user's input
    return tuple(out)


def _replay(stages: list[StageTimes], where: list[int], mine: list[list[int]], durations: list[dict],
            finish: list[float], memory: _Memory, topology: tuple[tuple, ...]) -> tuple[list[Event], float]:
    """The replay where every action runs at full speed: each starts when its group is free and its
    inputs are in, in `_topology`'s order. (events in the order they end, step)."""
    n = len(stages)
    free = [0.0] * len(mine)
    ends = [0.0] * len(topology)
    sends = [st.send_s for st in stages]
    events: list[Event] = []
    for a, (r, kind, s, mb, needs) in enumerate(topology):
        start = free[r]
        for at, sender in needs:
            ready = ends[at] + (sends[sender] if sender >= 0 else 0.0)
            if ready > start:
                start = ready
        if kind == "S":
            end = start + finish[r]
            if end > start:
                events.append(Event(mine[r][0], "sync", -1, start, end, r))
        else:
            memory.start(r, kind, s)
            end = start + durations[s][kind]
            events.append(Event(s, kind, mb, start, end, r))
            if kind == "F" and s + 1 < n and where[s + 1] != r:
                events.append(Event(s, "send", mb, end, end + sends[s], r))
        ends[a] = free[r] = end
    events.sort(key=lambda e: e.end)
    return events, max([0.0] + [e.end for e in events] + free)


def _ready(kind: str, s: int, mb: int, stages: list[StageTimes], where: list[int], done: dict) -> float | None:
    """When the inputs of an action have arrived, or None if they have not been produced yet."""
    if kind == "S":
        return 0.0  # a group's last action: everything before it has ended
    if kind == "W":
        return done.get(("G", s, mb))
    if kind == "F":
        if s == 0:
            return 0.0
        prev = done.get(("F", s - 1, mb))
        return None if prev is None else prev + (stages[s - 1].send_s if where[s - 1] != where[s] else 0.0)
    own = done.get(("F", s, mb))
    if own is None:
        return None
    if s == len(stages) - 1:
        return own
    nxt = done.get(("G", s + 1, mb))
    return None if nxt is None else max(own, nxt + (stages[s].send_s if where[s + 1] != where[s] else 0.0))
