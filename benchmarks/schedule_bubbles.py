"""Measured pipeline bubbles of each schedule on this machine against the simulator's.

gpt-small (4 blocks) on 2 gloo ranks, one stage or two per rank (a core each): every schedule of
the registry at several microbatch counts, run by torch's classes (`autopar.bench.measure`: two
warm-up and five timed steps, then one step whose phases are timed per rank). The measured bubble
is the idle share of the ranks' schedule time, 1 − Σ_r (forward_r + backward_r) / (ranks × the
longest schedule). Beside it, the simulator's: replayed from the plan's own cost model (predicted),
and replayed from the measured compute (each rank's forward and backward time split evenly over
its stages' microbatches; the weight-gradient share of a backward as the plan prices it), which
tests the schedule model apart from the cost model. Prints a Markdown table and writes it, with a
picture of the measured bubble against microbatches per schedule, to
docs/benchmarks/results/schedule_bubbles.md (and .png).

    python benchmarks/schedule_bubbles.py [REPEATS]
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
from pathlib import Path

from _page import picture, table, write
from _stamp import stamp
from rich.progress import track

from autopar.bench import measure
from autopar.cost_models import get_cluster
from autopar.cost_models.simulator import simulate
from autopar.models import load_workload
from autopar.planner.manual import Layout, manual_plan, manual_search
from autopar.planner.search import Search, replay, stage_times

MODEL, NPROC, BATCH = "gpt-small", 2, 16
RUNS = [(schedule, virtual, m) for m in (2, 4, 8)
        for schedule, virtual in (("1f1b", 1), ("interleaved-zb", 1), ("interleaved-1f1b", 2), ("interleaved-zb", 2),
                                  ("zbv", 2))]


def plans() -> list:
    w = load_workload(MODEL, batch=BATCH, device="cpu")
    cluster = dataclasses.replace(get_cluster("cpu-local"), devices_per_host=NPROC)
    view = manual_search(Search.start(w, cluster, (1, NPROC)))
    return [dataclasses.replace(manual_plan(dataclasses.replace(view, schedule=s), Layout(1, 1, NPROC, m, virtual=v)),
                                name=f"{s} v{v} m{m}") for s, v, m in RUNS]


def from_measured(plan, parts: list[dict]) -> float:
    """The simulator's bubble with each stage's compute as this run measured it."""
    where, m = plan.stage_ranks, plan.num_microbatches
    stages = []
    for s, stage in enumerate(plan.stages):
        rank = parts[where[s]]
        predicted = stage_times(stage.cost)
        backward = rank["backward_s"] / (plan.virtual * m)
        share = predicted.weight_s / predicted.backward_s if predicted.backward_s else 0.0
        stages.append(dataclasses.replace(predicted, forward_s=rank["forward_s"] / (plan.virtual * m),
                                          backward_s=backward, weight_s=backward * share, send_s=0.0,
                                          grad_sync_s=0.0, optimizer_s=0.0))
    return simulate(stages, m, plan.schedule, virtual=plan.virtual).bubble_fraction


HEADER = ["schedule", "stages per rank", "microbatches", "measured step ms", "measured bubble",
          "simulated from measured compute", "predicted bubble (cost model)", "predicted step ms"]


def main() -> None:
    started = stamp()
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    chosen = plans()
    samples = _measure(chosen, repeats)
    rows, points = [], []
    for plan, (schedule, virtual, m) in zip(chosen, RUNS):
        step, bubble, simulated = (statistics.median(x) for x in zip(*samples[plan.name]))
        predicted = replay(plan).bubble_fraction
        rows.append([schedule, virtual, m, f"{step * 1e3:.0f}", f"{bubble:.1%}", f"{simulated:.1%}",
                     f"{predicted:.1%}", f"{plan.estimate.step_time_s * 1e3:.0f}"])
        points.append((f"{schedule} v{virtual}", m, bubble, predicted))
    body = table(HEADER, rows)
    print(body)
    _draw(points, picture("schedule_bubbles"))
    write("schedule_bubbles", started, body + "\n![measured bubble against microbatches, a line per schedule]"
                                              "(results/schedule_bubbles.png)\n")


def _measure(chosen: list, repeats: int) -> dict[str, list[tuple[float, float, float]]]:
    """Per plan, one (step s, measured bubble, simulated from measured compute) a repetition."""
    samples: dict[str, list] = {p.name: [] for p in chosen}
    for _ in track(range(repeats), description="schedules", transient=True):
        for plan, (step, _, parts, _) in zip(chosen, measure(MODEL, NPROC, BATCH, chosen, breakdown=True)):
            span = max(r["forward_s"] + r["backward_s"] + r["pipeline_s"] for r in parts)
            busy = sum(r["forward_s"] + r["backward_s"] for r in parts)
            samples[plan.name].append((step, 1 - busy / (NPROC * span), from_measured(plan, parts)))
    return samples


def _draw(points: list[tuple[str, int, float, float]], path: Path) -> None:
    """Measured bubble (solid) and the cost model's (dotted) against microbatches, a colour per schedule."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for name in dict.fromkeys(p[0] for p in points):
        mine = [p for p in points if p[0] == name]
        line, = ax.plot([p[1] for p in mine], [100 * p[2] for p in mine], "o-", label=name)
        ax.plot([p[1] for p in mine], [100 * p[3] for p in mine], ":", color=line.get_color())
    ax.set(xscale="log", xlabel="microbatches", ylabel="bubble %",
           title=f"{MODEL} on {NPROC} ranks: measured (solid), predicted (dotted)")
    counts = sorted({p[1] for p in points})
    ax.set_xticks(counts, [str(m) for m in counts])
    ax.minorticks_off()
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
