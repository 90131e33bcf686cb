"""A plan as a picture (`autopar show plan.json --png FILE`): the pipeline schedule as the simulator
replays it, which devices each stage holds, and each stage's memory against the device's.

The schedule is replayed from the plan's own per-stage costs, so the chart shows what the
prediction assumed: one row per stage, forward and backward of every microbatch, the transfers
between stages, the data-parallel gradient reduction, and the bubble as the empty space.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from autopar.contract.plan import Plan, PlanError
from autopar.contract.units import human_bytes, human_time, printable
from autopar.cost_models.simulator import Simulation
from autopar.planner.search import replay

MAX_BARS = 50_000  # forward and backward bars in the Gantt: past it the picture is unreadable and slow
MAX_STAGES = 256  # rows

COLOURS = {"F": "#4C78A8", "B": "#F58518", "I": "#F58518", "W": "#E45756", "send": "#9D9D9D", "sync": "#54A24B"}
LABELS = {"F": "forward", "B": "backward", "I": "backward (input gradient)", "W": "backward (weight gradient)",
          "send": "send to next stage", "sync": "gradient reduction (data axis)"}


def draw(plan: Plan, memory_limit: float | None = None) -> Any:
    """A matplotlib Figure with three panels: schedule (Gantt), stage-to-device map, memory."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch


    n = len(plan.stages)
    if n > MAX_STAGES or 2 * n * plan.num_microbatches > MAX_BARS:
        raise PlanError(f"the plan has {n} stages × {plan.num_microbatches} microbatches: a drawing holds at most "
                        f"{MAX_STAGES} stages and {MAX_BARS // 2} stage-microbatches; `autopar show` without --png "
                        "prints it")
    sim = replay(plan)
    fig = plt.figure(figsize=(13, 4.5 + 0.45 * n), constrained_layout=True)
    grid = fig.add_gridspec(2, 2, height_ratios=[1.3 + 0.25 * n, 2.2])
    gantt, devices, memory = fig.add_subplot(grid[0, :]), fig.add_subplot(grid[1, 0]), fig.add_subplot(grid[1, 1])
    _gantt(gantt, plan, sim)
    _devices(devices, plan)
    _memory(memory, plan, sim, memory_limit)
    split = any(e.kind == "I" for e in sim.events)  # a zero-bubble schedule's two backward parts
    kinds = [k for k in COLOURS if k not in (("B",) if split else ("I", "W"))]
    fig.legend(handles=[Patch(color=COLOURS[k], label=LABELS[k]) for k in kinds], loc="outside lower center",
               ncols=4, fontsize=9, frameon=False)
    est = plan.estimate
    fig.suptitle(f"{_literal(plan.name)} plan for {_literal(plan.model)} (batch {plan.batch}) on {_literal(plan.cluster)} "
                 f"{plan.mesh[0]}x{plan.mesh[1]}: {n} stage(s), {plan.num_microbatches} microbatches, {plan.schedule}"
                 + (f" — {human_time(sim.step_time_s)} per step, bubble {sim.bubble_fraction:.0%}" if est else ""),
                 x=0.01, ha="left", fontsize=11)
    return fig


def save(plan: Plan, path: str | Path, memory_limit: float | None = None) -> None:
    import matplotlib.pyplot as plt

    fig = draw(plan, memory_limit)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _gantt(ax: Any, plan: Plan, sim: Simulation) -> None:
    """Compute on the stage's row; its sends on a thin lane below; the reduction after the last backward."""
    scale = 1e3  # ms
    for e in sim.events:
        start, width = e.start * scale, (e.end - e.start) * scale
        if width <= 0:
            continue
        if e.kind in ("F", "B", "I", "W"):
            ax.barh(e.stage, width, left=start, height=0.6, color=COLOURS[e.kind], edgecolor="white", linewidth=0.5)
            if width > 0.012 * sim.step_time_s * scale:
                ax.text(start + width / 2, e.stage, str(e.microbatch), ha="center", va="center", fontsize=7,
                        color="white")
        elif e.kind == "send":
            ax.barh(e.stage + 0.4, width, left=start, height=0.12, color=COLOURS["send"])
        else:
            ax.barh(e.stage - 0.4, width, left=start, height=0.12, color=COLOURS["sync"])
    ax.set_yticks(range(len(plan.stages)),
                  [f"stage {i}\n{s.devices} dev, dp {s.logical_mesh[0]} × tp {s.logical_mesh[1]}"
                   for i, s in enumerate(plan.stages)], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("time within one training step (ms)")
    ax.set_xlim(0, sim.step_time_s * scale * 1.01)
    ax.set_title("pipeline schedule (numbers: microbatch; empty space: bubble)", fontsize=10, loc="left")
    ax.grid(axis="x", alpha=0.3)


def _devices(ax: Any, plan: Plan) -> None:
    """Ranks fill hosts in order, device group after group, as the runtime places them (group r
    holds stage r, and with v stages per group the others the schedule puts there)."""
    import matplotlib.pyplot as plt

    hosts, per_host = plan.mesh
    cmap = plt.get_cmap("tab20")
    rank = 0
    for i, s in enumerate(plan.stages[:plan.groups]):
        tp = s.logical_mesh[1]
        for j in range(s.devices):
            h, d = divmod(rank, per_host)
            ax.add_patch(plt.Rectangle((d, h), 0.95, 0.95, color=cmap(i % 20)))
            if per_host <= 16:
                ax.text(d + 0.47, h + 0.47, f"{'g' if plan.virtual > 1 else 's'}{i}\n{j // tp},{j % tp}", ha="center",
                        va="center", fontsize=7)
            rank += 1
    ax.set_xlim(0, per_host)
    ax.set_ylim(hosts, 0)
    ax.set_xticks([d + 0.47 for d in range(per_host)], range(per_host), fontsize=7)
    ax.set_yticks([h + 0.47 for h in range(hosts)], [f"host {h}" for h in range(hosts)], fontsize=7)
    ax.set_xlabel("device in host")
    ax.set_title("stage of each device (sS / dp index, tp index)", fontsize=10, loc="left")
    ax.set_aspect("equal", adjustable="box")


def _memory(ax: Any, plan: Plan, sim: Simulation, limit: float | None) -> None:
    """Per device group (a stage, or the v stages of one)."""
    where = plan.stage_ranks
    states = [sum(s.cost.get("state_bytes", 0.0) for s, r in zip(plan.stages, where) if r == g)
              for g in range(plan.groups)]
    peaks = [sim.peak_memory_bytes[where.index(g)] for g in range(plan.groups)]
    x = range(plan.groups)
    ax.bar(x, states, color="#B279A2", label="parameters, gradients, optimizer state")
    ax.bar(x, [p - s for p, s in zip(peaks, states)], bottom=states, color="#FF9DA6",
           label="activations in flight, transients")
    if limit:
        ax.axhline(limit, color="red", linestyle="--", linewidth=1, label=f"device limit {human_bytes(limit)}")
    ax.set_xticks(list(x), [f"{'group' if plan.virtual > 1 else 'stage'} {i}" for i in x], fontsize=8)
    ax.yaxis.set_major_formatter(lambda v, _: human_bytes(v))
    ax.set_ylabel("peak memory per device")
    ax.set_title("memory per stage", fontsize=10, loc="left")
    ax.legend(fontsize=8, loc="lower right")


def _literal(name: str) -> str:
    """A name from the plan file as matplotlib shows it literally (no mathtext between "$" signs)."""
    return printable(name).replace("$", r"\$")
