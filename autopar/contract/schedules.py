"""Pipeline schedules: one registry entry per schedule, the one place that knows a schedule by name.

An entry says everything the other floors ask of a schedule: the order of each stage's forward and
backward actions (the simulator replays it; the runtime's fan-out pipeline issues it), how many
microbatches' activations a stage holds at its peak (the memory model), the class of
`torch.distributed.pipelining` that runs it (by name, so importing this module loads no torch),
and what runs instead when torch's class refuses the microbatch count. This is torchtitan's
`get_schedule_class` with the planner's two questions beside it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

Order = list[tuple[str, int]]  # ("F" | "B", microbatch) in the order one stage runs them


@dataclass(frozen=True)
class Schedule:
    name: str
    order: Callable[[int, int, int], Order]  # (stages, stage, microbatches) -> that stage's actions
    in_flight: Callable[[int, int, int], int]  # (stages, stage, microbatches) -> activations held at the peak
    torch_class: str  # in torch.distributed.pipelining
    fallback: str | None = None  # run instead with fewer microbatches than stages (torch refuses those)


SCHEDULES: dict[str, Schedule] = {}


def register(schedule: Schedule) -> Schedule:
    SCHEDULES[schedule.name] = schedule
    return schedule


def get(name: str) -> Schedule:
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}: one of {', '.join(SCHEDULES)}")
    return SCHEDULES[name]


def runs(name: str, num_stages: int, num_microbatches: int) -> Schedule:
    """The schedule a pipeline of `num_stages` runs when asked for `name`."""
    schedule = get(name)
    if schedule.fallback and num_microbatches < num_stages:
        return get(schedule.fallback)
    return schedule


def order(name: str, num_stages: int, stage: int, num_microbatches: int) -> Order:
    return runs(name, num_stages, num_microbatches).order(num_stages, stage, num_microbatches)


def in_flight(name: str, num_stages: int, stage: int, num_microbatches: int) -> int:
    return runs(name, num_stages, num_microbatches).in_flight(num_stages, stage, num_microbatches)


def _gpipe_order(num_stages: int, stage: int, m: int) -> Order:
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]


def _one_f_one_b_order(num_stages: int, stage: int, m: int) -> Order:
    """`stages - stage - 1` forwards to warm up, then one forward and one backward in turn."""
    warmup = min(num_stages - stage - 1, m)
    actions = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        actions += [("F", warmup + i), ("B", i)]
    return actions + [("B", i) for i in range(m - warmup, m)]


register(Schedule("1f1b", _one_f_one_b_order, lambda stages, stage, m: min(stages - stage, m), "Schedule1F1B",
                  fallback="gpipe"))  # torch's Schedule1F1B refuses fewer microbatches than stages
register(Schedule("gpipe", _gpipe_order, lambda stages, stage, m: m, "ScheduleGPipe"))
