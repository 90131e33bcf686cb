"""Planner speed: the whole `autopar plan` command in a fresh process (Python's start and
`import torch` included), for the intra-op pass alone (`--stages 1`) and for the full search.

    python benchmarks/plan_speed.py
"""

from __future__ import annotations

from _cli import run_cli
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
    print("| command | layers | stages found | ILP solves | cache hits | planning s | wall s | predicted TFLOP/s/GPU |")
    print("|---|---|---|---|---|---|---|---|")
    for model, cluster, mesh, batch, extra in track(CASES, description="plan", transient=True):
        args = ["plan", model, "--cluster", cluster, "--mesh", mesh, "--batch", str(batch), *extra]
        plan, wall, _ = run_cli(*args)
        shapes = ", ".join(sorted({f"{s['submesh'][0]}x{s['submesh'][1]} ({s['logical_mesh'][0]}×{s['logical_mesh'][1]})"
                                   for s in plan["stages"]}))
        schedule = plan["schedule"] + (f" v{plan['virtual']}" if plan["virtual"] > 1 else "")
        print(f"| `autopar {' '.join(args)}` | {len(plan['layers'])} | {len(plan['stages'])} × {shapes}, {schedule} | "
              f"{plan['search']['ilp_solves']} | {plan['search']['cache_hits']} | {plan['planning_time_s']:.1f} | "
              f"{wall:.1f} | {plan['estimate']['tflops_per_device']:.1f} |")


if __name__ == "__main__":
    main()
