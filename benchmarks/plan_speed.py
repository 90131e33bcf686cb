"""Planner speed: the whole `autopar plan` command in a fresh process (Python's start and
`import torch` included), for the intra-op pass alone (`--stages 1`) and for the full search.
Prints a Markdown table and writes it, with a picture of planning time against model size, to
docs/benchmarks/results/plan_speed.md (and .png).

    python benchmarks/plan_speed.py
"""

from __future__ import annotations

from _cli import run_cli
from _page import picture, table, write
from _stamp import stamp
from rich.progress import track

CASES = [  # (model, cluster, mesh, batch, extra arguments)
    ("gpt-1.3b", "a100-dgx", "1x8", 16, ["--stages", "1"]),
    ("gpt-15b", "a100-dgx", "1x8", 16, ["--stages", "1"]),
    ("gpt-1.3b", "v100-p3", "1x4", 1024, []),
    ("gpt-6.7b", "v100-p3", "2x8", 1024, []),
    ("gpt-39b", "v100-p3", "8x8", 1024, []),
    ("gpt3-175b", "a100-dgx", "128x8", 1536, []),
]


def main() -> None:
    started, rows, points = stamp(), [], []
    for model, cluster, mesh, batch, extra in track(CASES, description="plan", transient=True):
        args = ["plan", model, "--cluster", cluster, "--mesh", mesh, "--batch", str(batch), *extra]
        plan, wall, _ = run_cli(*args)
        shapes = ", ".join(sorted({f"{s['submesh'][0]}x{s['submesh'][1]} ({s['logical_mesh'][0]}×{s['logical_mesh'][1]})"
                                   for s in plan["stages"]}))
        schedule = plan["schedule"] + (f" v{plan['virtual']}" if plan["virtual"] > 1 else "")
        rows.append([model, cluster, mesh, batch, "intra-op only (`--stages 1`)" if extra else "full",
                     len(plan["layers"]), f"{len(plan['stages'])} × {shapes}, {schedule}",
                     plan["search"]["ilp_solves"], plan["search"]["cache_hits"], f"{plan['planning_time_s']:.1f}",
                     f"{wall:.1f}", f"{plan['estimate']['tflops_per_device']:.1f}"])
        if not extra:
            hosts, per_host = (int(x) for x in mesh.split("x"))
            points.append((model, hosts * per_host, plan["planning_time_s"], wall))
    body = ("Each row: `autopar plan MODEL --cluster CLUSTER --mesh MESH --batch BATCH --json`.\n\n"
            + table(["model", "cluster", "mesh", "batch", "search", "layers", "stages found", "ILP solves", "cache hits",
                     "planning s", "wall s", "predicted TFLOP/s/GPU"], rows, right=(5, 7, 8, 9, 10, 11)))
    print(body)
    _draw(points, picture("plan_speed"))
    write("plan_speed", started, body + "\n![planning time of the full search against the devices planned for]"
                                        "(results/plan_speed.png)\n")


def _draw(points: list[tuple[str, int, float, float]], path) -> None:
    """Planning and wall time of the full search against the devices it plans for (log-log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    devices = [p[1] for p in points]
    ax.plot(devices, [p[2] for p in points], "o-", label="planning (in the command)")
    ax.plot(devices, [p[3] for p in points], "s--", label="wall (Python's start and imports included)")
    for model, n, t, _ in points:
        ax.annotate(model, (n, t), textcoords="offset points", xytext=(4, -12), fontsize=8)
    ax.set(xscale="log", yscale="log", xlabel="devices planned for", ylabel="seconds",
           title="autopar plan: the full search")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
