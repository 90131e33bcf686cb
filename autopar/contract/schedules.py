"""Pipeline schedules: one registry entry per schedule, the one place that knows a schedule by name.

An entry says everything the other floors ask of a schedule: the order in which each rank runs its
actions (the simulator replays it; the runtime's fan-out pipeline issues it), how many stages a
rank holds and which (virtual stages: interleaved schedules hold v per rank in a loop, ZBV two in
a V), the class of `torch.distributed.pipelining` that runs it (by name, so importing this module
loads no torch), and what runs instead when torch's class refuses the microbatch count. This is
torchtitan's `get_schedule_class` with the planner's questions beside it.

An action is (kind, stage, microbatch), stage counted over all p·v virtual stages: "F" a forward,
"B" a whole backward, or, for zero-bubble schedules, its two parts: "I" the gradient of the input
(what the previous stage waits for) and "W" the gradient of the weights (free to fill a bubble).
The orders are the ones torch's classes compute (`tests/test_schedules.py` compares those of the
interleaved and zero-bubble classes with torch's action by action), written here so that the
simulator and the planner price what the runtime will run.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

Action = tuple[str, int, int]  # (kind, stage, microbatch)
Order = list[Action]


@dataclass(frozen=True)
class Schedule:
    name: str
    order: Callable[[int, int, int, int], Order]  # (ranks, rank, microbatches, virtual) -> the rank's actions
    torch_class: str  # in torch.distributed.pipelining
    virtual: tuple[int, ...] | None = (1,)  # the stages per rank it runs (None: any)
    style: str = "loop"  # which rank holds stage s: "loop" s mod p, "v" down the ranks and back up
    fallback: str | None = None  # run instead when `refuses` (torch would refuse the microbatch count)
    refuses: Callable[[int, int, int], str | None] = lambda ranks, m, virtual: None  # why torch's class would


SCHEDULES: dict[str, Schedule] = {}


def register(schedule: Schedule) -> Schedule:
    SCHEDULES[schedule.name] = schedule
    return schedule


def get(name: str) -> Schedule:
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}: one of {', '.join(SCHEDULES)}")
    return SCHEDULES[name]


def runs(name: str, ranks: int, num_microbatches: int, virtual: int = 1) -> Schedule:
    """The schedule a pipeline of `ranks` device groups runs when asked for `name`."""
    schedule = get(name)
    if schedule.fallback and schedule.refuses(ranks, num_microbatches, virtual):
        return get(schedule.fallback)
    return schedule


def problem(name: str, ranks: int, num_microbatches: int, virtual: int = 1) -> str | None:
    """Why `name` cannot run `virtual` stages per rank on `ranks` groups with this many
    microbatches (None: it can, perhaps as its fallback)."""
    schedule = get(name)
    if schedule.virtual is not None and virtual not in schedule.virtual:
        allowed = " or ".join(map(str, schedule.virtual))
        return f"schedule {name} runs {allowed} stage{'s' if schedule.virtual != (1,) else ''} per device group, not {virtual}"
    if schedule.fallback is None:
        return schedule.refuses(ranks, num_microbatches, virtual)
    return None


def order(name: str, ranks: int, rank: int, num_microbatches: int, virtual: int = 1) -> Order:
    return runs(name, ranks, num_microbatches, virtual).order(ranks, rank, num_microbatches, virtual)


@functools.cache
def in_flight(name: str, ranks: int, rank: int, num_microbatches: int, virtual: int = 1) -> int:
    """The most microbatch-stages whose activations the rank holds at once: a forward keeps them
    until its backward ("B") or, split, its weight-gradient part ("W") ends."""
    held = peak = 0
    for kind, _, _ in order(name, ranks, rank, num_microbatches, virtual):
        held += {"F": 1, "B": -1, "W": -1}.get(kind, 0)
        peak = max(peak, held)
    return peak


def stage_ranks(name: str, ranks: int, virtual: int = 1) -> list[int]:
    """The device group of each of the p·v stages, in model order."""
    if get(name).style == "v":
        return [s if s < ranks else 2 * ranks - 1 - s for s in range(ranks * virtual)]
    return [s % ranks for s in range(ranks * virtual)]


def splits_backward(name: str) -> bool:
    """Whether the schedule runs a backward as two actions (its input and weight gradients)."""
    return any(kind == "I" for kind, _, _ in get(name).order(2, 0, 4, (get(name).virtual or (2,))[-1]))


def _gpipe(p: int, rank: int, m: int, v: int) -> Order:
    return [("F", rank, i) for i in range(m)] + [("B", rank, i) for i in range(m)]


def _one_f_one_b(p: int, rank: int, m: int, v: int) -> Order:
    """`p - rank - 1` forwards to warm up, then one forward and one backward in turn."""
    warmup = min(p - rank - 1, m)
    actions = [("F", rank, i) for i in range(warmup)]
    for i in range(m - warmup):
        actions += [("F", rank, warmup + i), ("B", rank, i)]
    return actions + [("B", rank, i) for i in range(m - warmup, m)]


def _rounds(p: int, m: int) -> tuple[int, int]:
    """torch's flexible interleaving: max(1, m // p) rounds of equally many microbatches."""
    rounds = max(1, m // p)
    return rounds, m // rounds


def _uneven_rounds(p: int, m: int, v: int) -> str | None:
    rounds, _ = _rounds(p, m)
    if m % rounds:
        return (f"interleaved schedules split the microbatches into max(1, m // p) = {rounds} equal rounds "
                f"on {p} device groups: {m} microbatches do not split; use a multiple of {rounds}")
    return None


def _interleaved(p: int, rank: int, m: int, v: int, zero_bubble: bool) -> Order:
    """Megatron-LM's interleaved 1F1B (Narayanan et al., 2021) over torch's flexible rounds: warm up
    with the forwards of the first chunks (two per hop from the last rank), then one forward and one
    backward in turn, chunk by chunk a round of microbatches at a time. Zero bubble (Qi et al., ZB1P)
    warms up one forward per hop, splits each backward and delays rank r's weight gradients by r."""
    _, per_round = _rounds(p, m)
    total = m * v
    warmup = min((v - 1) * per_round + (1 if zero_bubble else 2) * (p - 1 - rank), total)

    def forward_stage(op: int) -> int:
        return (op // per_round) % v * p + rank

    def backward_stage(op: int) -> int:
        return (v - 1 - (op - warmup) // per_round % v) * p + rank

    done = {"F": [0] * (p * v), "B": [0] * (p * v), "W": [0] * (p * v)}

    def next_of(kind: str, stage: int) -> int:
        done[kind][stage] += 1
        return done[kind][stage] - 1

    backward = "I" if zero_bubble else "B"
    actions: Order = []
    backward_ops: list[int] = []
    weights = 0  # weight-gradient parts issued so far
    for op in range(warmup + total):
        if op < total:
            actions.append(("F", s := forward_stage(op), next_of("F", s)))
        if op >= warmup:
            actions.append((backward, s := backward_stage(op), next_of("B", s)))
            backward_ops.append(op)
            if zero_bubble and op - warmup >= rank:
                s = backward_stage(backward_ops[weights])
                actions.append(("W", s, next_of("W", s)))
                weights += 1
    if zero_bubble:
        for op in backward_ops[weights:]:
            s = backward_stage(op)
            actions.append(("W", s, next_of("W", s)))
    return actions


def _zbv(p: int, rank: int, m: int, v: int) -> Order:
    """ZB-V (Qi et al., ICLR 2024, section 6): two stages per rank, the first down the ranks and the
    second back up, so the last stage sits beside the first. Planned for at least 2p − 1
    microbatches (fewer leave holes where the missing ones would be)."""
    n = max(2 * p - 1, m)
    first, second = rank, 2 * p - 1 - rank
    count = {(k, s): 0 for k in "FIW" for s in (first, second)}
    actions: Order = []

    def add(kind: str, stage: int) -> None:
        actions.append((kind, stage, count[(kind, stage)]))
        count[(kind, stage)] += 1

    for _ in range(2 * (p - rank) - 1):
        add("F", first)
    for _ in range(rank):
        add("F", second)
        add("F", first)
    for _ in range(p - rank):
        add("F", second)
        add("I", second)
        add("W", second)
    while count[("F", second)] < count[("F", first)] or count[("F", first)] < n:
        if count[("F", first)] < n:
            add("F", first)
        add("I", first)
        add("W", first)
        add("F", second)
        add("I", second)
        add("W", second)
    for _ in range(rank):
        add("I", first)
        add("I", second)
    for _ in range(p - rank):
        add("I", first)
        add("W", first)
    for stage in (second, first):
        while count[("W", stage)] < count[("I", stage)]:
            add("W", stage)
    return [a for a in actions if a[2] < m]


register(Schedule("1f1b", _one_f_one_b, "Schedule1F1B", fallback="gpipe",
                  refuses=lambda p, m, v: "fewer microbatches than stages" if m < p else None))
register(Schedule("gpipe", _gpipe, "ScheduleGPipe"))
register(Schedule("interleaved-1f1b", lambda p, r, m, v: _interleaved(p, r, m, v, False), "ScheduleInterleaved1F1B",
                  virtual=None, refuses=_uneven_rounds))
register(Schedule("interleaved-zb", lambda p, r, m, v: _interleaved(p, r, m, v, True),
                  "ScheduleInterleavedZeroBubble", virtual=None, refuses=_uneven_rounds))
register(Schedule("zbv", _zbv, "ScheduleZBVZeroBubble", virtual=(2,), style="v"))
